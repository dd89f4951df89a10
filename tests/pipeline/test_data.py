"""Prompt sources (list, JSONL, Parquet, datasets.Dataset) and the shuffled prompt stream."""

from __future__ import annotations

import json

import psutil
import pytest
from conftest import python_peak

from pipeline.data import PromptColumnError, PromptLengthError, PromptStream, fit_to_context, read_prompts

TEXTS = ["what is 1 plus 2? ", "what is 3 minus 1? ", "say 7: "]


def test_read_prompts_from_a_list_of_strings():
    assert read_prompts(list(TEXTS)) == TEXTS
    assert read_prompts(tuple(TEXTS)) == TEXTS


def test_read_prompts_from_a_list_of_dicts_uses_the_column():
    rows = [{"question": t, "answer": str(i)} for i, t in enumerate(TEXTS)]
    assert read_prompts(rows, column="question") == TEXTS
    assert read_prompts(rows, column="answer") == ["0", "1", "2"]


def test_read_prompts_from_jsonl_skips_blank_lines(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": t, "id": i}) for i, t in enumerate(TEXTS)) + "\n\n")
    assert read_prompts(path) == TEXTS
    assert read_prompts(str(path)) == TEXTS  # str and PathLike both work


def test_read_prompts_from_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"text": TEXTS, "n": [1, 2, 3]}), path)
    assert read_prompts(path, column="text") == TEXTS


def test_read_prompts_from_a_datasets_dataset():
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict({"prompt": TEXTS, "label": [0, 1, 0]})
    assert read_prompts(dataset) == TEXTS


@pytest.mark.parametrize("kind", ["dicts", "jsonl", "parquet", "dataset"])
def test_a_missing_column_names_the_column_and_prompt_column(kind, tmp_path):
    rows = [{"question": t} for t in TEXTS]
    if kind == "dicts":
        source = rows
    elif kind == "jsonl":
        source = tmp_path / "p.jsonl"
        source.write_text("\n".join(json.dumps(r) for r in rows))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        source = tmp_path / "p.parquet"
        pq.write_table(pa.table({"question": TEXTS}), source)
    else:
        source = pytest.importorskip("datasets").Dataset.from_dict({"question": TEXTS})
    with pytest.raises(KeyError) as error:
        read_prompts(source, column="prompt")
    message = str(error.value)
    assert "'prompt'" in message and "prompt_column" in message


def test_a_missing_column_in_a_file_names_the_file_the_column_and_the_fix(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"question": "b", "id": 2}\n')
    with pytest.raises(PromptColumnError) as error:
        read_prompts(path)
    assert str(error.value) == (f"{path} line 2: no 'prompt' field (its fields are ['question', 'id']). "
                                "Fix: set prompt_column to the field that holds the prompt text.")
    assert isinstance(error.value, KeyError) and isinstance(error.value, ValueError)


BAD_LINES = {
    "not json": (b'{"prompt": "a"}\n{"prompt": "b",}\n',
                 "line 2: not valid JSON (Expecting property name enclosed in double quotes, column 16). "
                 'Fix: write one JSON object per line, e.g. {"prompt": "..."}.'),
    "truncated": (b'{"prompt": "a"}\n\n{"prompt": "b', "line 3: not valid JSON (Unterminated string"),
    "not utf-8": (b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n',
                  "line 2: not UTF-8 text (byte 0xe9 at column 16). Fix: save the file as UTF-8."),
    "deep nesting": (b"[" * 100_000 + b"\n", "line 1: JSON nested too deeply. Fix: write one JSON object"),
    "a number": (b'{"prompt": "a"}\n42\n', "line 2: no 'prompt' field (it is 42). Fix: set prompt_column"),
    "a json array file": (b'[{"prompt": "a"},\n {"prompt": "b"}]\n', "line 1: not valid JSON"),
    # 64 MiB without a newline: refused after reading 4 MiB of it, not read whole.
    "a binary blob": (b'{"prompt": "a"}\n' + b"\x00" * (64 << 20),
                      "line 2: longer than 4 MiB, too long for a prompt. Fix: check the path points at a JSONL"),
}


@pytest.mark.parametrize("content, expected", BAD_LINES.values(), ids=BAD_LINES.keys())
def test_a_malformed_jsonl_line_names_the_file_and_the_line(tmp_path, content, expected):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(content)
    with python_peak(16 << 20), pytest.raises(ValueError) as error:  # the 64 MiB blob is not read whole
        read_prompts(path)
    message = str(error.value)
    assert message.startswith(f"{path} {expected}") and "\n" not in message and len(message) < 400


def test_a_long_value_in_a_bad_line_is_cut_short(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(["x" * 100_000]) + "\n")
    with pytest.raises(PromptColumnError) as error:
        read_prompts(path)
    # 100 characters of the repr: "['" and 95 x, then "...".
    assert f"line 1: no 'prompt' field (it is ['{'x' * 95}...). Fix:" in str(error.value)


def test_an_empty_or_corrupt_prompt_file_is_named(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=f"^{tmp_path / 'empty.jsonl'}: the file holds no prompts. Fix: "):
        read_prompts(tmp_path / "empty.jsonl")
    (tmp_path / "p.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=f"^{tmp_path / 'p.parquet'}: not a readable Parquet file .*Fix: "):
        read_prompts(tmp_path / "p.parquet")


def test_unknown_sources_are_rejected(tmp_path):
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(FileNotFoundError, match=f"^prompt file {missing} does not exist. Fix: check the path"):
        read_prompts(missing)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_prompts(tmp_path)  # a directory is no prompt file
    (tmp_path / "p.csv").write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match=r"\.jsonl or \.parquet"):
        read_prompts(tmp_path / "p.csv")
    with pytest.raises(TypeError, match="prompts must be"):
        read_prompts(42)


def _prompts(n: int) -> list[list[int]]:
    return [[i + 2, i + 3] for i in range(n)]  # distinct non-empty token lists


def _epoch(stream: PromptStream, n: int) -> list[int]:
    batch, _ = stream.next_batch(n)
    return [ids[0] - 2 for ids in batch]  # back to the prompt index


def test_each_epoch_is_a_shuffled_permutation():
    n = 10
    stream = PromptStream(_prompts(n), seed=3)
    epochs = [_epoch(stream, n) for _ in range(4)]
    for order in epochs:
        assert sorted(order) == list(range(n))  # every prompt exactly once per epoch
    assert all(order != list(range(n)) for order in epochs)  # shuffled, not in file order
    assert len({tuple(order) for order in epochs}) == 4  # a new order each epoch


def test_batches_that_straddle_epochs_keep_each_epoch_a_permutation():
    n = 7
    whole = PromptStream(_prompts(n), seed=1)
    reference = _epoch(whole, 3 * n)
    pieces = PromptStream(_prompts(n), seed=1)
    drawn = [i for size in (3, 5, 2, 4, 7) for i in _epoch(pieces, size)]
    assert drawn == reference  # batch sizes do not change the order
    for e in range(3):
        assert sorted(drawn[e * n:(e + 1) * n]) == list(range(n))


def test_the_stream_is_deterministic_by_seed():
    n = 12
    first = _epoch(PromptStream(_prompts(n), seed=5), 2 * n)
    again = _epoch(PromptStream(_prompts(n), seed=5), 2 * n)
    other = _epoch(PromptStream(_prompts(n), seed=6), 2 * n)
    assert first == again
    assert first != other


def test_draw_ids_are_unique_and_count_up():
    stream = PromptStream(_prompts(4), seed=0)
    ids = [d for size in (3, 3, 5) for d in stream.next_batch(size)[1]]
    assert ids == list(range(11))  # unique across epochs, so GRPO groups never merge
    assert stream.position == 11


def test_empty_prompts_are_errors():
    with pytest.raises(ValueError, match="no prompts"):
        PromptStream([], seed=0)
    with pytest.raises(ValueError, match=r"prompts \[1\] encode to no tokens"):
        PromptStream([[5], [], [6]], seed=0)


def test_an_empty_prompt_text_is_caught_once_encoded(tiny_model):
    from pipeline.data import encode_prompts
    from pipeline.models import load_tokenizer

    tokenizer = load_tokenizer(tiny_model)
    ids = encode_prompts(tokenizer, ["ab", ""])
    assert ids[0] == [2, 3]  # the char tokenizer: pad=0, eos=1, then 'a', 'b', ...
    with pytest.raises(ValueError, match="encode to no tokens"):
        PromptStream(ids, seed=0)


def test_prompts_that_fit_the_context_pass_unchanged():
    ids = [[1] * 5, [2] * 6]
    assert fit_to_context(ids, context=10, max_new_tokens=4, long_prompts="refuse") is ids  # 6 + 4 = 10 fits
    assert fit_to_context(ids, context=None, max_new_tokens=4, long_prompts="refuse") is ids  # no limit known


LONG = [[1] * 3, [2] * 9, [3] * 4, [4] * 7]  # context 10 - max_new_tokens 4 = 6 tokens: prompts 1 and 3 are long
LONG_WHAT = ("2 of 4 prompts are longer than 6 tokens (the model's context of 10 minus train.max_new_tokens 4); "
             "the longest, prompt 1, has 9")


def test_long_prompts_are_refused_with_their_count_and_the_longest(tmp_path):
    with pytest.raises(PromptLengthError) as error:
        fit_to_context(LONG, 10, 4, "refuse", source=tmp_path / "p.jsonl")
    assert str(error.value) == (f"{tmp_path / 'p.jsonl'}: {LONG_WHAT}. Fix: shorten them, lower train.max_new_tokens, "
                                "or set train.long_prompts: truncate (keep each one's last 6 tokens) or drop "
                                "(leave them out).")


def test_long_prompts_are_truncated_to_their_last_tokens_or_dropped(caplog):
    ids = [list(range(9)), [7, 8], list(range(20, 27))]
    with caplog.at_level("WARNING", logger="dask_rl"):
        assert fit_to_context(ids, 10, 4, "truncate") == [[3, 4, 5, 6, 7, 8], [7, 8], [21, 22, 23, 24, 25, 26]]
    assert "prompts: 2 of 3 prompts are longer than 6 tokens" in caplog.text and "kept their last 6" in caplog.text
    assert fit_to_context(LONG, 10, 4, "drop") == [[1] * 3, [3] * 4]
    with pytest.raises(PromptLengthError, match=r"^prompts: 2 of 2 prompts are longer .* truncate \(keep each "
                                                r"one's last 6 tokens\)\.$"):
        fit_to_context([[1] * 9, [2] * 7], 10, 4, "drop")  # nothing would be left


def test_max_new_tokens_that_fill_the_context_are_refused():
    with pytest.raises(PromptLengthError, match=r"train.max_new_tokens: 10 leaves no room for a prompt in the model's "
                                                r"context of 10 tokens. Fix: use max_new_tokens below 10."):
        fit_to_context([[1]], 10, 10, "truncate")


def test_the_trainer_refuses_long_prompts_before_starting_a_cluster(tiny_model, shared_config):
    from pipeline.trainer import HybridTrainer

    # The tiny model takes 256 positions: 250 characters (one token each) + 16 new tokens do not fit.
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    with pytest.raises(PromptLengthError, match=r"^prompts: 1 of 2 prompts are longer than 240 tokens .* the "
                                                r"longest, prompt 1, has 250"):
        HybridTrainer(tiny_model, len, shared_config, prompts=["short", "a" * 250], max_new_tokens=16,
                      show_progress=False)
    # Refused before a cluster started: no scheduler or worker process was started for it.
    assert {child.pid for child in psutil.Process().children(recursive=True)} <= before
