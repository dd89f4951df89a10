"""Prompt sources: a Python list, a local JSONL or Parquet file, or a `datasets` dataset."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any, Iterable


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
            raise KeyError(f"the dataset has no column {column!r} (it has {source.column_names}); "
                           f"set prompt_column to the column that holds the prompts")
        return [str(text) for text in source[column]]
    raise TypeError(f"prompts must be a list, a .jsonl/.parquet path or a datasets.Dataset, not {type(source).__name__}")


def _read_file(path: Path, column: str) -> list[str]:
    if not path.exists():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if column not in table.column_names:
            raise KeyError(f"{path} has no column {column!r} (it has {table.column_names}); set prompt_column")
        return [str(text) for text in table.column(column).to_pylist()]
    if path.suffix in (".jsonl", ".json"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [_text(row, column, f"{path} line {i + 1}") for i, row in enumerate(rows)]
    raise ValueError(f"{path}: unknown prompt file type {path.suffix!r}; use .jsonl or .parquet")


def _text(item: Any, column: str, where: str) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and column in item:
        return str(item[column])
    raise KeyError(f"{where}: no {column!r} field in {item!r}; set prompt_column to the field holding the prompt")


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
