"""Prompt sources: a Python list, a local JSONL or Parquet file, or a `datasets` dataset."""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path
from typing import Any, Iterable


from resources.config import shorten

logger = logging.getLogger("dask_rl")
# A JSONL line past this is not a prompt (1M characters is far past any model's context):
# most likely a binary or one-line file, which must not be read into memory whole.
MAX_LINE_BYTES = 4 << 20
FIX_COLUMN = "set prompt_column to the field that holds the prompt text"


class PromptColumnError(KeyError, ValueError):
    """A prompt source without the prompt column. A KeyError (a key is missing, as before)
    and a ValueError (bad input: the CLI reports it in one line, no traceback)."""

    def __str__(self) -> str:  # KeyError's str() quotes its message; this reads as written
        return str(self.args[0]) if self.args else ""


def read_prompts(source: Any, column: str = "prompt") -> list[str]:
    """All prompt texts of `source`.

    Accepts a list of strings (or of dicts with `column`), a .jsonl/.json or .parquet path,
    or anything indexable by column name like a `datasets.Dataset`.
    """
    if isinstance(source, (str, os.PathLike)):
        return _read_file(Path(source), column)
    if isinstance(source, (list, tuple)):
        return [_text(item, column, f"prompt {i}") for i, item in enumerate(source)]
    if hasattr(source, "column_names"):  # datasets.Dataset
        if column not in source.column_names:
            raise PromptColumnError(f"the dataset has no column {column!r} (it has {source.column_names}). "
                                    f"Fix: {FIX_COLUMN}.")
        return [str(text) for text in source[column]]
    raise TypeError(f"prompts must be a list, a .jsonl/.parquet path or a datasets.Dataset, not {type(source).__name__}")


def _read_file(path: Path, column: str) -> list[str]:
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist. Fix: check the path (in a run file it "
                                f"is relative to the run file).")
    if path.suffix == ".parquet":
        texts = _read_parquet(path, column)
    elif path.suffix in (".jsonl", ".json"):
        texts = _read_jsonl(path, column)
    else:
        raise ValueError(f"{path}: unknown prompt file type {path.suffix!r}. Fix: use .jsonl or .parquet.")
    if not texts:
        raise ValueError(f"{path}: the file holds no prompts. Fix: add one row per prompt.")
    return texts


def _read_parquet(path: Path, column: str) -> list[str]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pyarrow.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: not a readable Parquet file ({shorten(str(exc))}). "
                         f"Fix: check the path, or write the file again.") from None
    if column not in table.column_names:
        raise PromptColumnError(f"{path} has no column {column!r} (it has {shorten(str(table.column_names))}). "
                                f"Fix: {FIX_COLUMN}.")
    return [str(text) for text in table.column(column).to_pylist()]


def _read_jsonl(path: Path, column: str) -> list[str]:
    texts = []
    with path.open("rb") as file:  # line by line: one bad line is named, and a big file streams
        for number, raw in enumerate(iter(lambda: file.readline(MAX_LINE_BYTES + 1), b""), start=1):
            where = f"{path} line {number}"
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError(f"{where}: longer than {MAX_LINE_BYTES >> 20} MiB, too long for a prompt. Fix: "
                                 f"check the path points at a JSONL file (one JSON object per line)")
            if raw.strip():
                texts.append(_text(_parse_line(raw, where, column), column, where))
    return texts


def _parse_line(raw: bytes, where: str, column: str) -> Any:
    fix = f'Fix: write one JSON object per line, e.g. {{"{column}": "..."}}.'
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}). "
                         f"Fix: save the file as UTF-8.") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg}, column {exc.colno}). {fix}") from None
    except RecursionError:  # json nests by recursion: [[[[... thousands deep
        raise ValueError(f"{where}: JSON nested too deeply. {fix}") from None


def _text(item: Any, column: str, where: str) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and column in item:
        return str(item[column])
    found = f"its fields are {shorten(str(list(item)))}" if isinstance(item, dict) else f"it is {shorten(repr(item))}"
    raise PromptColumnError(f"{where}: no {column!r} field ({found}). Fix: {FIX_COLUMN}.")


class PromptStream:
    """Endless shuffled epochs over the prompts, tokenised once; resumable by position."""

    def __init__(self, token_ids: list[list[int]], seed: int):
        if not token_ids:
            raise ValueError("there are no prompts to train on")
        empty = [i for i, ids in enumerate(token_ids) if not ids]
        if empty:
            raise ValueError(f"prompts {empty[:5]} encode to no tokens; check the tokenizer and the prompt texts")
        self.token_ids = token_ids
        self.seed = seed
        self.position = 0  # prompts handed out so far

    def next_batch(self, size: int) -> tuple[list[list[int]], list[int]]:
        """`size` prompts and their global draw numbers (unique ids for GRPO groups)."""
        draws = range(self.position, self.position + size)
        self.position += size
        return [self.token_ids[self._index(d)] for d in draws], list(draws)

    def _index(self, draw: int) -> int:
        epoch, offset = divmod(draw, len(self.token_ids))
        order = list(range(len(self.token_ids)))
        random.Random(self.seed * 100_003 + epoch).shuffle(order)
        return order[offset]


def encode_prompts(tokenizer, texts: Iterable[str]) -> list[list[int]]:
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


class PromptLengthError(ValueError):
    """Prompts that do not fit the model's context with the response after them."""


def fit_to_context(token_ids: list[list[int]], context: int | None, max_new_tokens: int, long_prompts: str,
                   source: Any = "prompts") -> list[list[int]]:
    """The prompts, each short enough that `max_new_tokens` fit after it in `context`.

    A longer prompt would train silently on positions the model never learnt (or fail
    inside the rollout engine). `long_prompts` (train.long_prompts) says what happens to
    them: "refuse" (an error with their count and the longest), "truncate" (keep each one's
    last tokens: the end of a prompt is where the question and the answer cue are) or "drop".
    """
    if context is None:
        return token_ids
    name = str(source) if isinstance(source, (str, os.PathLike)) else "prompts"
    budget = context - max_new_tokens
    if budget < 1:
        raise PromptLengthError(f"train.max_new_tokens: {max_new_tokens} leaves no room for a prompt in the model's "
                                f"context of {context} tokens. Fix: use max_new_tokens below {context}.")
    long = [i for i, ids in enumerate(token_ids) if len(ids) > budget]
    if not long:
        return token_ids
    longest = max(long, key=lambda i: len(token_ids[i]))
    what = (f"{len(long)} of {len(token_ids)} prompts are longer than {budget} tokens (the model's context of "
            f"{context} minus train.max_new_tokens {max_new_tokens}); the longest, prompt {longest}, has "
            f"{len(token_ids[longest])}")
    kept = [ids for ids in token_ids if len(ids) <= budget]
    if long_prompts == "refuse" or long_prompts == "drop" and not kept:
        raise PromptLengthError(f"{name}: {what}. Fix: shorten them, lower train.max_new_tokens, or set "
                                f"train.long_prompts: truncate (keep each one's last {budget} tokens)"
                                + ("" if long_prompts == "drop" else " or drop (leave them out)") + ".")
    logger.warning("dask-rl: %s: %s; %s (train.long_prompts: %s)", name, what,
                   f"kept their last {budget} tokens" if long_prompts == "truncate" else "left them out",
                   long_prompts)
    return [ids[-budget:] for ids in token_ids] if long_prompts == "truncate" else kept
