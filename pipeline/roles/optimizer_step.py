"""One optimizer step of a trainable role, cut into micro-batches that fit the GPU.

Gradients accumulate over micro-batches of rows (train.micro_batch_size rows) or of a
budget of real tokens ("auto" on a GPU); an out-of-memory error shrinks them and redoes the
step from zero gradients. Losses are divided by the mini-batch's *global* token count, so
the step's gradient does not depend on the cut, and the ranks of a group sum theirs.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipeline.packing import micro_batch_count, token_chunks
from pipeline.records import even_chunks
from resources.allocator import (
    AUTO_ROWS, OUT_OF_MEMORY, GroupOutOfMemory, MicroBatchAllocator, first_line, free_bytes, group_any, group_max,
    group_min, release_cached, report, rows_per_micro_batch,
)

logger = logging.getLogger("dask_rl")

# The update's micro-batches a rollout hosted by this role leaves room for (in tokens, at
# the measured peak bytes a token): the KV cache it plans takes the rest, so neither starves
# the other under a cap (max_gpu_memory_gib); more free memory still gives the update more.
HOSTED_UPDATE_TOKENS = 8192


class MicroBatchedSteps:
    """The optimizer step of training.Trainable, which provides: model, optimizer, device,
    grad_clip, gradient_checkpointing, role_name, group, world_size, sharded, and this
    class's state (allocator: a MicroBatchAllocator; micro_batch_rows, micro_batch_tokens:
    what the last step used)."""

    def optimizer_step(self, take: Callable[[slice], Any], num_rows: int,
                       loss_fn: Callable[[nn.Module, Any], tuple[torch.Tensor, dict[str, torch.Tensor | float]]], *,
                       max_rows: int | str, tokens_per_row: int,
                       row_tokens: Sequence[int] | None = None) -> dict[str, float]:
        """Accumulate gradients of `loss_fn` over micro-batches `take(rows)` of this rank's
        `num_rows` rows, reduce across ranks, step.

        `max_rows` rows per micro-batch, or "auto": where this worker can read its free GPU
        memory and `row_tokens` (the real tokens of each row, which a packed forward
        computes) is given, micro-batches of consecutive rows are cut by a budget of real
        tokens (_budgeted_step); else AUTO_ROWS rows.

        Rows: the micro-batch size starts at what free memory allows (at most `max_rows`),
        the smallest any rank allows. An out-of-memory error on any rank halves it on every
        rank and the same step is redone from zero gradients, so the result does not depend
        on it; under FSDP the group cannot do that by itself and the failing rank raises
        GroupOutOfMemory for the driver (see below). `loss_fn` must already divide by the
        global token count (see the module docstring). Returns the summed stats of the
        micro-batches plus the gradient norm.
        """
        self._eval_mode_with_checkpointing()
        if max_rows == "auto" and row_tokens is not None and self._free_bytes() is not None:
            totals = self._budgeted_step(take, [int(n) for n in row_tokens], loss_fn, tokens_per_row)
        else:
            totals = self._rows_step(take, num_rows, loss_fn, rows_per_micro_batch(max_rows), tokens_per_row)
        return self._apply_gradients(totals)

    def update_reserve_bytes(self) -> int:
        """Bytes the next optimizer step allocates beyond what this process holds between
        steps: the gradients, AdamW's two state tensors a parameter where its first step has
        not made them yet, and HOSTED_UPDATE_TOKENS tokens of micro-batch at the measured
        peak bytes a token (nothing before a first measurement). A rollout hosted by this
        role plans its decode slots in what is left."""
        gradients = state = 0
        for parameter in self.model.parameters():
            if not parameter.requires_grad:
                continue
            nbytes = parameter.numel() * parameter.element_size()
            gradients += nbytes if parameter.grad is None else 0
            state += 0 if self.optimizer.state.get(parameter) else 2 * nbytes
        return gradients + state + int((self.allocator.bytes_per_token or 0) * HOSTED_UPDATE_TOKENS)

    def warm_up(self, loss_fn: Callable[[nn.Module], torch.Tensor]) -> None:
        """One backward of `loss_fn(model)` in the mode optimizer_step trains in, the
        gradients then dropped: the weights and the optimizer's state stay as they were."""
        self._eval_mode_with_checkpointing()
        self.optimizer.zero_grad(set_to_none=True)
        try:
            loss_fn(self.model).backward()
        finally:
            self.optimizer.zero_grad(set_to_none=True)

    def _eval_mode_with_checkpointing(self) -> None:
        # Eval mode, i.e. dropout off, while computing gradients: the proximal log-probs and
        # old values come from eval-mode forwards, so with dropout on, on-policy ratios would
        # be != 1 from the first step. Transformers models read `training` only for dropout
        # and gradient checkpointing; gradients flow the same in eval mode. Checkpointing
        # blocks get their own flag back: their submodules (where dropout is) stay in eval.
        self.model.eval()
        if self.gradient_checkpointing:
            for module in self.model.modules():
                if getattr(module, "gradient_checkpointing", False) is True:
                    module.training = True

    def _rows_step(self, take, num_rows: int, loss_fn, max_rows: int, tokens_per_row: int) -> dict[str, float]:
        free = self._free_bytes()
        rows = self.allocator.rows(max_rows, tokens_per_row, free)
        if self.world_size > 1:  # one size for the group: the smallest any rank can fit
            rows = group_min(rows, self.device)
        while True:
            parts = self.micro_batches(num_rows, rows)
            totals, failure = self._try_accumulate(take, parts, loss_fn, [rows * tokens_per_row] * len(parts))
            if failure is not None and self.sharded:
                self._raise_group_out_of_memory("optimizer step", rows, failure, free, rows * tokens_per_row)
            if not self._any_failed(failure):
                break
            smaller = MicroBatchAllocator.backoff(rows)
            if failure is not None:
                self.allocator.observe_out_of_memory(free, rows * tokens_per_row)
                report("optimizer step", rows, smaller, "rows per micro-batch", OUT_OF_MEMORY, failure)
            else:
                logger.info("dask-rl: another rank ran out of memory at %d rows per micro-batch; redoing the "
                            "step with %d", rows, smaller)
            rows, free = smaller, self._free_bytes()
        self.micro_batch_rows, self.micro_batch_tokens = rows, None
        return totals

    def _budgeted_step(self, take, row_tokens: list[int], loss_fn, tokens_per_row: int) -> dict[str, float]:
        """Micro-batches of consecutive rows of at most `budget` real tokens each. The budget
        starts at AUTO_ROWS rows' worth of padded tokens, then follows the measured peak
        bytes per real token and the free memory; ranks run the same number of micro-batches
        (the largest any rank needs: one all_reduce), each rank spreading its rows evenly
        over them. An out-of-memory error halves the budget on every rank and redoes the step
        from zero gradients, as for rows."""
        free = self._free_bytes()
        budget = self.allocator.tokens(AUTO_ROWS * tokens_per_row, free)
        largest_shard = group_max(len(row_tokens), self.device) if self.world_size > 1 else len(row_tokens)
        while True:
            count = micro_batch_count(row_tokens, budget)
            count = group_max(count, self.device) if self.world_size > 1 else count
            parts = token_chunks(row_tokens, count)
            sizes = [sum(row_tokens[part]) for part in parts]
            totals, failure = self._try_accumulate(take, parts, loss_fn, sizes)
            if failure is not None and self.sharded:
                rows = max(part.stop - part.start for part in parts)
                self._raise_group_out_of_memory("optimizer step", rows, failure, free, max(sizes))
            if not self._any_failed(failure):
                break
            if count >= largest_shard:  # every rank agrees: one row per micro-batch already failed
                MicroBatchAllocator.backoff(1)
            smaller = max(1, budget // 2)
            if failure is not None:
                self.allocator.observe_out_of_memory(free, max(sizes))
                report("optimizer step", budget, smaller, "tokens per micro-batch", OUT_OF_MEMORY, failure)
            budget, free = smaller, self._free_bytes()
        self.micro_batch_rows = max(part.stop - part.start for part in parts)
        self.micro_batch_tokens = budget
        return totals

    def _try_accumulate(self, take, parts: list[slice], loss_fn,
                        tokens: list[int]) -> tuple[dict[str, float] | None, str | None]:
        """(summed stats, None), or (None, the out-of-memory error's first line) with the
        gradients zeroed and the cache released."""
        try:
            return self._accumulate([take(part) for part in parts], loss_fn, tokens), None
        except torch.OutOfMemoryError as error:
            failure = first_line(error)
        # Outside the except block, whose traceback held the failed attempt's activations.
        self.optimizer.zero_grad(set_to_none=True)
        release_cached(self.device)
        return None, failure

    def _any_failed(self, failure: str | None) -> bool:
        """Whether any rank failed; every rank learns it, and all redo the step together.
        A rank that did not fail drops its gradients too."""
        failed = group_any(failure is not None, self.device) if self.world_size > 1 else failure is not None
        if failed and failure is None:
            self.optimizer.zero_grad(set_to_none=True)
            release_cached(self.device)
        return failed

    def _apply_gradients(self, totals: dict[str, float]) -> dict[str, float]:
        if self.world_size > 1 and not self.sharded:
            self._all_reduce_grads()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if math.isfinite(norm):
            self.optimizer.step()
            totals["grad_norm"] = norm
        else:
            # A NaN/inf loss or gradient would poison every weight: refuse the step. The norm
            # is computed from the reduced gradients, so every rank refuses the same steps.
            logger.warning("dask-rl: %s refused an optimizer step: gradient norm %s (a non-finite loss or "
                           "gradient); the weights stay as they were", self.role_name, norm)
            totals["grad_norm"], totals["refused_steps"] = 0.0, 1.0
        self.optimizer.zero_grad(set_to_none=True)
        return totals

    def micro_batches(self, num_rows: int, rows: int) -> list[slice]:
        """This rank's `num_rows` rows as near-equal slices of at most `rows` rows, as many
        slices as on every other rank of the group (one collective).

        Ranks may hold a row more or less than others (records.rank_shards), and an FSDP
        rank gathers parameters with the whole group in every forward and backward: a rank
        running one micro-batch fewer would leave the others waiting in a collective.
        """
        largest = group_max(num_rows, self.device) if self.world_size > 1 else num_rows
        return even_chunks(num_rows, max(1, math.ceil(largest / rows)))

    @torch.no_grad()
    def sharded_forward(self, forward: Callable[[slice], torch.Tensor], num_rows: int, max_rows: int,
                        what: str) -> torch.Tensor:
        """`forward(rows)` over this rank's rows of a sharded model, at most `max_rows` rows at a
        time and as many times as on every other rank, concatenated along rows.

        No-grad forwards of a model that is not sharded halve their chunk on an out-of-memory
        error by themselves (forward.in_row_chunks); a sharded rank cannot leave the group's
        collectives to do that, so it raises GroupOutOfMemory like the optimizer step."""
        failure = None
        try:
            return torch.cat([forward(part) for part in self.micro_batches(num_rows, max_rows)])
        except torch.OutOfMemoryError as error:
            failure = first_line(error)
        self._raise_group_out_of_memory(what, max_rows, failure, None, 0)

    def _raise_group_out_of_memory(self, what: str, rows: int, failure: str, free: int | None,
                                   tokens: int) -> None:
        # The other ranks are inside this micro-batch's collectives by now: any collective
        # from here would pair with theirs. The driver frees them and redoes the update.
        self.optimizer.zero_grad(set_to_none=True)
        release_cached(self.device)
        self.allocator.observe_out_of_memory(free, tokens)
        logger.warning("dask-rl: %s rank %d ran out of memory under FSDP in the %s with micro-batches of %d rows "
                       "(%s); the driver redoes the update with smaller ones", self.role_name, self.group.rank,
                       what, rows, failure)
        raise GroupOutOfMemory(self.role_name, rows, what, failure)

    def _accumulate(self, micro_batches: list[Any], loss_fn, tokens: list[int]) -> dict[str, float]:
        """Gradients summed over `micro_batches`; `tokens`: what each one's activation memory
        scales with (rows x padded width, or its real tokens when packed), for the
        allocator's bytes per token."""
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, Any] = {}
        for batch, batch_tokens in zip(micro_batches, tokens):
            measure = torch.cuda.is_available() and str(self.device).startswith("cuda")
            if measure:
                torch.cuda.reset_peak_memory_stats()
                baseline = torch.cuda.memory_allocated()
            loss, stats = loss_fn(self.model, batch)
            # FSDP averages gradients over ranks; scale so that it sums them like DDP here.
            (loss * self.world_size if self.sharded else loss).backward()
            if measure:
                self.allocator.observe(torch.cuda.max_memory_allocated() - baseline, batch_tokens)
            # Summed where they are: reading a GPU value waits for the GPU, and waiting before
            # the next micro-batch is queued would leave the GPU idle meanwhile.
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + (value.detach() if torch.is_tensor(value) else value)
        return {key: float(value) for key, value in totals.items()}

    def _free_bytes(self) -> int | None:
        return free_bytes(self.device)

    def _all_reduce_grads(self) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
            offset += grad.numel()
