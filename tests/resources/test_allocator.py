"""Micro-batch sizing and out-of-memory backoff: the arithmetic, that a step redone with
smaller micro-batches after an out-of-memory error gives the very same update, that chunked
work halves and keeps what it finished, and that two real ranks (gloo) agree on one size and
back off together when one of them runs out of memory."""

from __future__ import annotations

import functools
import sys

import cloudpickle
import pytest
import torch

from pipeline.fleet.groups import free_port
from pipeline.fleet.tasks import submit
from pipeline.roles.training import GroupInfo, Trainable
from resources import allocator
from resources.allocator import MicroBatchAllocator, OutOfMemoryAtOneRow, in_chunks
from resources.cluster import live_workers

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the rank task below runs on the workers


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


def test_an_out_of_memory_error_keeps_the_next_plan_below_the_size_that_failed():
    allocator = MicroBatchAllocator(headroom=0.8)
    # 8 rows x 10 tokens did not fit in 1000 bytes: more than 1000 / 80 = 12.5 bytes a token.
    allocator.observe_out_of_memory(free_bytes=1000, tokens=80)
    assert allocator.bytes_per_token == 12.5
    assert allocator.rows(16, 10, free_bytes=1000) == 6         # 0.8 * 1000 / (12.5 * 10) = 6.4
    assert allocator.rows(16, 10, free_bytes=4000) == 16        # more memory free later: larger again
    allocator.observe_out_of_memory(free_bytes=None, tokens=80)  # no reading (CPU): nothing learnt
    assert allocator.bytes_per_token == 12.5


def test_free_bytes_is_none_off_cuda():
    assert allocator.free_bytes("cpu") is None


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
    stats = trainable.optimizer_step(inputs.__getitem__, len(inputs),
                                     functools.partial(_loss, total_rows=len(inputs), limit=limit),
                                     max_rows=max_rows, tokens_per_row=1)
    return trainable, stats


def test_an_out_of_memory_step_is_redone_smaller_with_the_same_result():
    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    reference, reference_stats = _step(inputs, max_rows=8)
    seen = len(allocator.reported())
    backed_off, stats = _step(inputs, max_rows=8, limit=3)         # 8 and 4 rows fail, 2 fit
    lines = [d.line() for d in allocator.reported()[seen:]]
    assert lines == ["local: optimizer step: 8 -> 4 rows per micro-batch (out of memory: injected: micro-batch too large)",
                     "local: optimizer step: 4 -> 2 rows per micro-batch (out of memory: injected: micro-batch too large)"]
    assert backed_off.micro_batch_rows == 2 and reference.micro_batch_rows == 8
    for a, b in zip(reference.model.parameters(), backed_off.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert stats["tokens"] == reference_stats["tokens"] == 8.0     # the failed attempts left no trace


def test_the_room_a_hosted_rollout_leaves_for_the_update_is_counted_by_hand():
    """update_reserve_bytes: gradients, AdamW's state until its first step makes it, and
    HOSTED_UPDATE_TOKENS tokens at the measured bytes a token. Linear(4, 3) in float32:
    15 parameters, 60 bytes; a frozen Linear(2, 2) beside it counts for nothing."""
    from pipeline.roles.optimizer_step import HOSTED_UPDATE_TOKENS

    def build():
        frozen = torch.nn.Linear(2, 2).requires_grad_(False)
        return torch.nn.ModuleDict({"trained": torch.nn.Linear(4, 3), "frozen": frozen})

    trainable = Trainable(build, lr=0.1, strategy="none", device="cpu")
    assert trainable.update_reserve_bytes() == 60 + 2 * 60            # gradients + exp_avg, exp_avg_sq
    inputs = torch.randn(4, 4)
    trainable.optimizer_step(inputs.__getitem__, 4,
                             lambda model, batch: ((model["trained"](batch) ** 2).sum(), {}),
                             max_rows=4, tokens_per_row=1)
    assert trainable.update_reserve_bytes() == 60                      # the state exists now
    trainable.allocator.observe(peak_bytes=1000, tokens=10)            # 100 bytes a token measured
    assert trainable.update_reserve_bytes() == 60 + 100 * HOSTED_UPDATE_TOKENS


def test_one_row_that_does_not_fit_is_a_clear_error():
    inputs = torch.randn(4, 4)
    with pytest.raises(OutOfMemoryAtOneRow):
        _step(inputs, max_rows=4, limit=1)


def _rows_of(limit: int):
    """A chunk function that "runs out of memory" from `limit` rows up; else its rows' squares."""
    values = torch.arange(10.0)

    def run(rows: slice) -> torch.Tensor:
        if rows.stop - rows.start >= limit:
            raise torch.OutOfMemoryError(f"injected: {rows.stop - rows.start} rows")
        return values[rows] ** 2
    return run


def test_in_chunks_halves_the_failed_chunk_and_keeps_the_finished_ones():
    seen, shrunk = len(allocator.reported()), []
    parts, rows = in_chunks(_rows_of(3), 10, 8, what="test pass", on_shrink=shrunk.append)
    assert torch.equal(torch.cat(parts), torch.arange(10.0) ** 2)  # every row once, in order
    assert rows == 2 and shrunk == [4, 2] and [len(p) for p in parts] == [2, 2, 2, 2, 2]
    assert [d.line() for d in allocator.reported()[seen:]] == [
        "local: test pass: 8 -> 4 rows per chunk (out of memory: injected: 8 rows)",
        "local: test pass: 4 -> 2 rows per chunk (out of memory: injected: 4 rows)"]


def test_in_chunks_steps_below_a_short_last_chunk_on_the_halving_ladder():
    # 10 rows by 8: rows 0..8 fit, then the last 2 rows fail: the size steps down the ladder
    # 8, 4, 2, 1 to the first size below the 2 rows that failed, and stays a power of two.
    calls = []

    def run(rows: slice) -> torch.Tensor:
        calls.append(rows.stop - rows.start)
        if rows.start >= 8 and rows.stop - rows.start >= 2:
            raise torch.OutOfMemoryError("injected")
        return torch.zeros(rows.stop - rows.start)

    parts, rows = in_chunks(run, 10, 8, what="test pass")
    assert calls == [8, 2, 1, 1] and rows == 1 and sum(len(p) for p in parts) == 10
    with pytest.raises(OutOfMemoryAtOneRow):
        in_chunks(_rows_of(1), 4, 4, what="test pass")


def _rank_step(rank: int, group: GroupInfo, inputs: torch.Tensor, max_rows: int, limit: int | None,
               total_rows: int) -> dict:
    """Task: one rank of a 2-rank DDP optimizer step on its rows; `limit` injects the OOM."""
    torch.manual_seed(0)
    trainable = Trainable(lambda: torch.nn.Linear(4, 3), lr=0.1, strategy="ddp", device="cpu")
    try:
        trainable.join(group)
        seen = len(allocator.reported())
        stats = trainable.optimizer_step(inputs.__getitem__, len(inputs),
                                         functools.partial(_loss, total_rows=total_rows, limit=limit),
                                         max_rows=max_rows, tokens_per_row=1)
        return {"rows": trainable.micro_batch_rows, "stats": stats,
                "params": [p.detach().clone() for p in trainable.model.parameters()],
                "reported": [d.line() for d in allocator.reported()[seen:]]}
    finally:
        trainable.close()


def _two_ranks(client, workers, inputs, max_rows, limits):
    port = client.run(free_port, workers=[workers[0]])[workers[0]]
    host = live_workers(client)[workers[0]]["host"]
    halves = inputs.tensor_split(2)
    futures = [submit(client, "actor", _rank_step, rank, GroupInfo(rank, 2, f"tcp://{host}:{port}", "gloo", 0, 60),
                      halves[rank], max_rows[rank], limits[rank], len(inputs), workers=[address], tag=f"r{rank}")
               for rank, address in enumerate(workers)]
    return client.gather(futures)


@pytest.mark.parametrize("case", ["agree", "one rank out of memory"])
def test_two_ranks_use_one_size_and_back_off_together(case, shared_cluster):
    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    reference, single = _step(inputs, max_rows=8)               # one rank, all rows, nothing fails
    expected = [p.detach() for p in reference.model.parameters()]
    workers = [w["address"] for w in shared_cluster.workers_of("actor")]
    if case == "agree":   # rank 1 can fit 2 rows, rank 0 all 4: both run 2
        results = _two_ranks(shared_cluster.client, workers, inputs, max_rows=(4, 2), limits=(None, None))
        assert [r["reported"] for r in results] == [[], []]
    else:                 # rank 1 runs out of memory from 3 rows up: it and rank 0 redo the step with 2
        results = _two_ranks(shared_cluster.client, workers, inputs, max_rows=(4, 4), limits=(None, 3))
        assert results[0]["reported"] == []                     # rank 0 followed, it did not fail
        assert results[1]["reported"] == ["actor: optimizer step: 4 -> 2 rows per micro-batch "
                                           "(out of memory: injected: micro-batch too large)"]
    assert [r["rows"] for r in results] == [2, 2]
    for result in results:   # the same update as one rank over all 8 rows
        for got, want in zip(result["params"], expected):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert sum(r["stats"]["tokens"] for r in results) == single["tokens"] == 8.0
