"""Prompt sources: a Python list, a local JSONL or Parquet file, or a `datasets` dataset.

A source yields rows: the prompt (text, or a list of chat messages) and the row's other
fields (an answer, a solution, a data-source tag...), which travel with the row's samples to
the reward functions and into samples.jsonl.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping


from resources.config import shorten

logger = logging.getLogger("dask_rl")
# A JSONL line past this is not a prompt (1M characters is far past any model's context):
# most likely a binary or one-line file, which must not be read into memory whole.
MAX_LINE_BYTES = 4 << 20
FIX_COLUMN = "set prompt_column to the field that holds the prompt text"
Messages = list  # [{"role": "user", "content": "..."}, ...]


class PromptColumnError(KeyError, ValueError):
    """A prompt source without the prompt column. A KeyError (a key is missing, as before)
    and a ValueError (bad input: the CLI reports it in one line, no traceback)."""

    def __str__(self) -> str:  # KeyError's str() quotes its message; this reads as written
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class PromptRow:
    """One row of a prompt source: its prompt and every other field, renamed as
    train.columns says (field name -> the column it is read from)."""

    prompt: str | Messages
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, list)


def read_rows(source: Any, column: str = "prompt", columns: Mapping[str, str] | None = None) -> list[PromptRow]:
    """Every row of `source`: a list of strings or dicts, a .jsonl/.json or .parquet path, or
    anything with `column_names` and `to_list()` like a `datasets.Dataset`.

    `column` holds the prompt; `columns` maps a field name the rewards see to the column it
    is read from ({"answer": "solution"}); every other column keeps its own name.
    """
    columns = dict(columns or {})
    if isinstance(source, (str, os.PathLike)):
        return _read_file(Path(source), column, columns)
    if isinstance(source, (list, tuple)):
        return [_row(item, column, columns, f"prompt {i}") for i, item in enumerate(source)]
    if hasattr(source, "column_names"):  # datasets.Dataset
        _require_columns(source.column_names, column, columns, "the dataset")
        return [_row(item, column, columns, f"dataset row {i}") for i, item in enumerate(source.to_list())]
    raise TypeError(f"prompts must be a list, a .jsonl/.parquet path or a datasets.Dataset, not {type(source).__name__}")


def read_prompts(source: Any, column: str = "prompt") -> list[str | Messages]:
    """The prompts of `source` alone (see read_rows)."""
    return [row.prompt for row in read_rows(source, column)]


def _require_columns(names: list[str], column: str, columns: dict[str, str], where: str) -> None:
    if column not in names:
        raise PromptColumnError(f"{where} has no column {column!r} (it has {shorten(str(list(names)))}). "
                                f"Fix: {FIX_COLUMN}.")
    for name, source_column in columns.items():
        if source_column not in names:
            raise PromptColumnError(f"{where} has no column {source_column!r} (it has {shorten(str(list(names)))}), "
                                    f"which train.columns reads {name!r} from. Fix: name an existing column in "
                                    f"train.columns.")


def _read_file(path: Path, column: str, columns: dict[str, str]) -> list[PromptRow]:
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist. Fix: check the path (in a run file it "
                                f"is relative to the run file).")
    if path.suffix == ".parquet":
        rows = _read_parquet(path, column, columns)
    elif path.suffix in (".jsonl", ".json"):
        rows = _read_jsonl(path, column, columns)
    else:
        raise ValueError(f"{path}: unknown prompt file type {path.suffix!r}. Fix: use .jsonl or .parquet.")
    if not rows:
        raise ValueError(f"{path}: the file holds no prompts. Fix: add one row per prompt.")
    return rows


def _read_parquet(path: Path, column: str, columns: dict[str, str]) -> list[PromptRow]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pyarrow.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: not a readable Parquet file ({shorten(str(exc))}). "
                         f"Fix: check the path, or write the file again.") from None
    _require_columns(table.column_names, column, columns, str(path))
    return [_row(item, column, columns, f"{path} row {i}") for i, item in enumerate(table.to_pylist())]


def _read_jsonl(path: Path, column: str, columns: dict[str, str]) -> list[PromptRow]:
    rows = []
    with path.open("rb") as file:  # line by line: one bad line is named, and a big file streams
        for number, raw in enumerate(iter(lambda: file.readline(MAX_LINE_BYTES + 1), b""), start=1):
            where = f"{path} line {number}"
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError(f"{where}: longer than {MAX_LINE_BYTES >> 20} MiB, too long for a prompt. Fix: "
                                 f"check the path points at a JSONL file (one JSON object per line)")
            if raw.strip():
                rows.append(_row(_parse_line(raw, where, column), column, columns, where))
    return rows


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


def _row(item: Any, column: str, columns: dict[str, str], where: str) -> PromptRow:
    if isinstance(item, PromptRow):  # read before (the CLI checks the file first)
        return item
    if isinstance(item, str):
        if columns:
            raise PromptColumnError(f"{where}: a plain string has no column {next(iter(columns.values()))!r} "
                                    f"for train.columns. Fix: give rows as objects with that field.")
        return PromptRow(item)
    if not (isinstance(item, dict) and column in item):
        found = f"its fields are {shorten(str(list(item)))}" if isinstance(item, dict) else f"it is {shorten(repr(item))}"
        raise PromptColumnError(f"{where}: no {column!r} field ({found}). Fix: {FIX_COLUMN}.")
    renamed = {source: name for name, source in columns.items()}
    for name, source in columns.items():
        if source not in item:
            raise PromptColumnError(f"{where}: no {source!r} field (its fields are {shorten(str(list(item)))}), "
                                    f"which train.columns reads {name!r} from. Fix: name an existing field in "
                                    f"train.columns.")
    fields = {renamed.get(key, key): value for key, value in item.items() if key != column}
    return PromptRow(_prompt(item[column], where, column), fields)


def _prompt(value: Any, where: str, column: str) -> str | Messages:
    """Text, or a list of {"role", "content"} messages (the conversational format)."""
    if isinstance(value, list):
        for i, message in enumerate(value):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise ValueError(f"{where}: {column!r} is a list, but its item {i} is no chat message "
                                 f"({shorten(repr(message))}). Fix: write chat prompts as "
                                 f'[{{"role": "user", "content": "..."}}], or the prompt as text.')
        if not value:
            raise ValueError(f"{where}: {column!r} is an empty list of messages. Fix: give at least one message.")
        return value
    if isinstance(value, (dict, tuple)) or value is None:
        raise ValueError(f"{where}: {column!r} is {shorten(repr(value))}, neither text nor a list of chat "
                         f"messages. Fix: write the prompt as text or as [{{\"role\": \"user\", \"content\": \"...\"}}].")
    return str(value)


class PromptStream:
    """Endless shuffled epochs over the prompts, tokenised once; resumable by position.

    `rows` (parallel to `token_ids`) keep each prompt's original form and fields: a
    checkpoint's position names the same rows again."""

    def __init__(self, token_ids: list[list[int]], seed: int, rows: list[PromptRow] | None = None):
        if not token_ids:
            raise ValueError("there are no prompts to train on")
        empty = [i for i, ids in enumerate(token_ids) if not ids]
        if empty:
            raise ValueError(f"prompts {empty[:5]} encode to no tokens; check the tokenizer and the prompt texts")
        if rows is not None and len(rows) != len(token_ids):
            raise ValueError(f"{len(rows)} prompt rows for {len(token_ids)} tokenised prompts")
        self.token_ids = token_ids
        self.rows = rows
        self.seed = seed
        self.position = 0  # prompts handed out so far

    def next_batch(self, size: int) -> tuple[list[list[int]], list[int]]:
        """`size` prompts and their global draw numbers (unique ids for GRPO groups)."""
        draws = range(self.position, self.position + size)
        self.position += size
        return [self.token_ids[self._index(d)] for d in draws], list(draws)

    def row(self, draw: int) -> PromptRow | None:
        """The row behind draw number `draw` (None for a stream built from token ids alone)."""
        return None if self.rows is None else self.rows[self._index(draw)]

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
    kept = _fit(token_ids, context, max_new_tokens, long_prompts, source)
    if len(kept) == len(token_ids) and all(ids is token_ids[i] for i, ids in kept):
        return token_ids  # nothing cut or left out: the same list
    return [ids for _, ids in kept]


def fit_rows_to_context(token_ids: list[list[int]], rows: list[PromptRow], context: int | None,
                        max_new_tokens: int, long_prompts: str, source: Any = "prompts"
                        ) -> tuple[list[list[int]], list[PromptRow]]:
    """fit_to_context, with the rows of the prompts it keeps."""
    kept = _fit(token_ids, context, max_new_tokens, long_prompts, source)
    return [ids for _, ids in kept], [rows[i] for i, _ in kept]


def _fit(token_ids: list[list[int]], context: int | None, max_new_tokens: int, long_prompts: str,
         source: Any) -> list[tuple[int, list[int]]]:
    """(index, fitted token ids) of every prompt kept."""
    if context is None:
        return list(enumerate(token_ids))
    name = str(source) if isinstance(source, (str, os.PathLike)) else "prompts"
    budget = context - max_new_tokens
    if budget < 1:
        raise PromptLengthError(f"train.max_new_tokens: {max_new_tokens} leaves no room for a prompt in the model's "
                                f"context of {context} tokens. Fix: use max_new_tokens below {context}.")
    long = [i for i, ids in enumerate(token_ids) if len(ids) > budget]
    if not long:
        return list(enumerate(token_ids))
    longest = max(long, key=lambda i: len(token_ids[i]))
    what = (f"{len(long)} of {len(token_ids)} prompts are longer than {budget} tokens (the model's context of "
            f"{context} minus train.max_new_tokens {max_new_tokens}); the longest, prompt {longest}, has "
            f"{len(token_ids[longest])}")
    kept = [(i, ids) for i, ids in enumerate(token_ids) if len(ids) <= budget]
    if long_prompts == "refuse" or long_prompts == "drop" and not kept:
        raise PromptLengthError(f"{name}: {what}. Fix: shorten them, lower train.max_new_tokens, or set "
                                f"train.long_prompts: truncate (keep each one's last {budget} tokens)"
                                + ("" if long_prompts == "drop" else " or drop (leave them out)") + ".")
    logger.warning("dask-rl: %s: %s; %s (train.long_prompts: %s)", name, what,
                   f"kept their last {budget} tokens" if long_prompts == "truncate" else "left them out",
                   long_prompts)
    return [(i, ids[-budget:]) for i, ids in enumerate(token_ids)] if long_prompts == "truncate" else kept
