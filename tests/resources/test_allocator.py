"""Micro-batch sizing and out-of-memory backoff: the arithmetic, and that a step redone with
smaller micro-batches after an out-of-memory error gives the very same update."""

from __future__ import annotations

import functools

import pytest
import torch

from pipeline.records import row_chunks
from pipeline.roles.training import Trainable
from resources.allocator import MicroBatchAllocator, OutOfMemoryAtOneRow


def test_rows_follow_free_memory_and_measured_bytes_per_token():
    allocator = MicroBatchAllocator(headroom=0.5)
    assert allocator.rows(16, 100, free_bytes=None) == 16          # CPU: no reading, the configured size
    assert allocator.rows(16, 100, free_bytes=10**9) == 16         # nothing measured yet
    allocator.observe(peak_bytes=8_000_000, tokens=4 * 100)        # 20 kB per token
    # 0.5 * 10 MB / (20 kB * 100 tokens) = 2.5 -> 2 rows
    assert allocator.rows(16, 100, free_bytes=10_000_000) == 2
    assert allocator.rows(16, 100, free_bytes=1_000) == 1          # never below one row
    allocator.observe(peak_bytes=1_000, tokens=100)                # a smaller peak keeps the worst case
    assert allocator.bytes_per_token == 20_000


def test_backoff_halves_and_gives_up_at_one_row():
    assert [MicroBatchAllocator.backoff(r) for r in (16, 5, 2)] == [8, 2, 1]
    with pytest.raises(OutOfMemoryAtOneRow, match="one row"):
        MicroBatchAllocator.backoff(1)


def _loss(model, batch, *, total_rows, limit=None):
    """Sum of squares over the global row count (the normaliser rule of roles/training.py).
    `limit`: this many rows or more per micro-batch "do not fit" (an injected OOM)."""
    if limit is not None and len(batch) >= limit:
        raise torch.OutOfMemoryError("injected: micro-batch too large")
    loss = (model(batch) ** 2).sum() / total_rows
    return loss, {"tokens": float(len(batch))}


def _step(inputs, max_rows, limit=None):
    torch.manual_seed(0)
    trainable = Trainable(lambda: torch.nn.Linear(4, 3), lr=0.1, strategy="none", device="cpu")
    split = lambda size: [inputs[r] for r in row_chunks(len(inputs), size)]  # noqa: E731
    stats = trainable.optimizer_step(split, functools.partial(_loss, total_rows=len(inputs), limit=limit),
                                     max_rows=max_rows, tokens_per_row=1)
    return trainable, stats


def test_an_out_of_memory_step_is_redone_smaller_with_the_same_result():
    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    reference, reference_stats = _step(inputs, max_rows=8)
    backed_off, stats = _step(inputs, max_rows=8, limit=3)         # 8 and 4 rows fail, 2 fit
    assert backed_off.micro_batch_rows == 2 and reference.micro_batch_rows == 8
    for a, b in zip(reference.model.parameters(), backed_off.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert stats["tokens"] == reference_stats["tokens"] == 8.0     # the failed attempts left no trace


def test_one_row_that_does_not_fit_is_a_clear_error():
    inputs = torch.randn(4, 4)
    with pytest.raises(OutOfMemoryAtOneRow):
        _step(inputs, max_rows=4, limit=1)
