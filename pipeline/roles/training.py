"""What the two trainable roles (actor, critic) share: a torch.distributed group across the
role's workers, the data-parallel strategy, and gradient accumulation over micro-batches.

Ranks sum their gradients: every loss is divided by the *global* token count of its
mini-batch (computed by the driver), so the summed gradient is exactly the one-rank
gradient of the whole mini-batch, whatever the number of ranks.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipeline.packing import micro_batch_count, token_chunks
from pipeline.records import even_chunks
from pipeline.roles.saved_state import Recovery, load_state, recover, save_state
from resources.allocator import (
    AUTO_ROWS, OUT_OF_MEMORY, GroupOutOfMemory, MicroBatchAllocator, first_line, free_bytes, group_any, group_max,
    group_min, release_cached, report, rows_per_micro_batch,
)

logger = logging.getLogger("dask_rl")


@dataclass(frozen=True)
class GroupInfo:
    """One rank's place in the role's process group for one update."""

    rank: int
    world_size: int
    init_method: str         # "tcp://host:port" of rank 0
    backend: str             # "gloo" on CPU, "nccl" on GPU
    generation: int          # changes whenever the role's membership changes: rebuild then
    timeout_seconds: float
    strategy: str = "ddp"    # "ddp" | "fsdp" | "none": how the ranks share the work
    # After a membership change every rank rebuilds from a saved state (saved_state.py):
    # the state exported at the step boundary of a resize, or, when a rank was lost, the
    # newest good state `recovery` points at.
    restore_path: str | None = None
    recovery: Recovery | None = None


class Trainable:
    """A model, its optimizer and its data-parallel group on one worker."""

    def __init__(self, build_model: Callable[[], nn.Module], *, lr: float, strategy: str, device: str,
                 grad_clip: float = 1.0, weight_decay: float = 0.0, gradient_checkpointing: bool = False,
                 role_name: str = "trainable", recovery_path: str | None = None):
        self.build_model = build_model   # kept: a resize rebuilds an unsharded model
        self.role_name = role_name       # for messages
        self.device = device
        self.gradient_checkpointing = gradient_checkpointing
        self.model = self._build()
        self.strategy = strategy
        self.grad_clip = grad_clip
        self.lr = lr
        self.weight_decay = weight_decay
        self.group: GroupInfo | None = None
        self.optimizer = self._make_optimizer()
        self.allocator = MicroBatchAllocator()
        self.micro_batch_rows: int | None = None   # what the last step used (after any backoff)
        self.micro_batch_tokens: int | None = None  # the token budget of the last step, when it had one
        # The last update applied (its version) and what it returned: a redo of that update
        # (after a fault elsewhere) returns this instead of training on the batch again.
        self.version = 0
        self.last_result: Any = None
        if recovery_path is not None and os.path.exists(recovery_path):
            # This worker process was restarted mid-run (its Nanny does that after a crash):
            # serve the current weights from the first task on, not the initial ones.
            self._apply_state(load_state(recovery_path))
            logger.warning("dask-rl: %s worker restarted; resumed its recovery state v%d", role_name, self.version)

    def _build(self) -> nn.Module:
        model = self.build_model().to(self.device)
        if self.gradient_checkpointing:
            # Keep only each transformer block's input for the backward pass and recompute
            # the rest: activation memory of a micro-batch drops from O(layers x hidden x
            # intermediate) to O(layers x hidden) per token, for about a third more compute.
            blocks = _blocks(model)
            # transformers renamed it (5.2x); the older name warns there and is gone in 6.
            enable = getattr(blocks, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                blocks.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    def _make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    def set_learning_rate(self, lr: float) -> None:
        """The learning rate of the next optimizer steps (a schedule's value for this update).
        Kept in self.lr too: an optimizer rebuilt after a resize or a recovery starts with it."""
        self.lr = lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # -- process group -------------------------------------------------------------------
    def join(self, group: GroupInfo) -> None:
        """Make sure this worker is rank `group.rank` of the current group generation."""
        if self.group is not None and self.group.generation == group.generation:
            return
        state = (load_state(group.restore_path) if group.restore_path else
                 recover(group.recovery, self.role_name, lambda: self.build_model().state_dict())
                 if group.recovery else None)
        if dist.is_initialized():  # the previous generation, or a group a replaced role object left
            dist.destroy_process_group()
        self.strategy = group.strategy if group.world_size > 1 else self.strategy
        if state is not None:  # start from the saved state, unsharded, then shard anew
            self.model = self._build()
            self._apply_state(state, optimizer=False)
        self.group = group
        if group.world_size > 1:
            dist.init_process_group(
                group.backend, init_method=group.init_method, rank=group.rank,
                world_size=group.world_size, timeout=timedelta(seconds=group.timeout_seconds),
            )
            if self.strategy == "fsdp":
                self._shard()
            elif state is None:  # ddp: every rank starts from rank 0's parameters
                for param in self.model.parameters():
                    dist.broadcast(param.data, src=0)
        if state is not None:
            self._load_optimizer(state)
        logger.info("dask-rl: joined group generation %d as rank %d/%d (%s, %s)", group.generation,
                    group.rank, group.world_size, group.backend, self.strategy)

    def _apply_state(self, state: dict, optimizer: bool = True) -> None:
        """Take a saved state, unsharded (join loads the optimizer's after any sharding)."""
        self.model.load_state_dict(state["model"])
        self.optimizer = self._make_optimizer()
        if optimizer:
            self._load_optimizer(state)
        self.version, self.last_result = state["version"] or 0, state["result"]

    def _load_optimizer(self, state: dict) -> None:
        if state.get("optim") is None:  # published weights only: the moments start afresh
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state["optim"],
                                 options=StateDictOptions(full_state_dict=True))

    def _shard(self) -> None:
        from torch.distributed.fsdp import fully_shard

        # Shard each transformer block, then the rest, so a block's parameters are gathered
        # only while that block runs.
        for module in self.model.modules():
            if type(module).__name__.endswith("DecoderLayer"):
                fully_shard(module)
        fully_shard(self.model)
        self.optimizer = self._make_optimizer()

    @property
    def world_size(self) -> int:
        return 1 if self.group is None else self.group.world_size

    # -- one optimizer step ----------------------------------------------------------------
    def optimizer_step(self, take: Callable[[slice], Any], num_rows: int,
                       loss_fn: Callable[[nn.Module, Any], tuple[torch.Tensor, dict[str, float]]], *,
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
        totals: dict[str, float] = {}
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
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + float(value)
        return totals

    def _free_bytes(self) -> int | None:
        return free_bytes(self.device)

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded over several ranks (FSDP): every forward is collective."""
        return self.strategy == "fsdp" and self.world_size > 1

    def _all_reduce_grads(self) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def full_state_dict(self, on_device: bool = False) -> dict[str, torch.Tensor] | None:
        """The full (unsharded) state dict on rank 0, on the CPU or, with `on_device` and
        without FSDP, where the model lives; None on other ranks.

        Collective under FSDP: every rank must call it.
        """
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = get_model_state_dict(self.model, options=options)
            return state if self.group.rank == 0 else None
        if self.group is not None and self.group.rank != 0:
            return None
        if on_device:  # CUDA IPC copies it into its own buffer: no trip through host memory
            return {name: tensor.detach() for name, tensor in self.model.state_dict().items()}
        return {name: tensor.detach().to("cpu") for name, tensor in self.model.state_dict().items()}

    # -- exactly once -----------------------------------------------------------------------
    def applied(self, version: int) -> bool:
        """Whether the update that produces `version` was applied already (this is a redo)."""
        return self.version >= version

    def record(self, version: int, result: Any, recovery_path: str | None) -> Any:
        """The update to `version` is applied; save the recovery state when one is asked for
        (rank 0 writes; collective under FSDP)."""
        self.version, self.last_result = version, result
        if recovery_path is not None:
            self.export_state(recovery_path)
        return result

    def export_state(self, path: str) -> str | None:
        """Save the full model and optimizer state with its version (rank 0 writes;
        collective under FSDP) so that a group can start from exactly this state."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        if self.group is not None and self.group.rank != 0:
            return None
        save_state(path, model_state, optim_state, self.version, self.last_result)
        return path

    def save_pretrained(self, path: str, save: Callable[[nn.Module, str], None]) -> str | None:
        """Write the model with `save(model, path)` on rank 0 (collective under FSDP).

        Without FSDP the live model is written as it is, so tied tensors stay tied; a
        sharded model is first gathered into an unsharded copy built like the original."""
        if not self.sharded:
            if self.group is not None and self.group.rank != 0:
                return None
            save(self.model, path)
            return path
        state = self.full_state_dict()
        if state is None:
            return None
        model = self.build_model()
        model.load_state_dict(state)
        save(model, path)
        return path

    def load_model_state(self, path: str) -> None:
        """A worker joining the role takes the exported weights before its first task, so the
        values or logprobs it computes before the next update come from the current model."""
        self.model.load_state_dict(load_state(path)["model"])

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _blocks(model: nn.Module) -> nn.Module:
    """The transformers model inside `model` (the critic wraps one in a value head)."""
    for module in model.modules():
        if hasattr(module, "gradient_checkpointing_enable") or hasattr(module, "activation_checkpointing_enable"):
            return module
    raise TypeError(f"gradient_checkpointing needs a transformers model; {type(model).__name__} holds none: "
                    "set train.gradient_checkpointing: false")

