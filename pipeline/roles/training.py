"""What the two trainable roles (actor, critic) share: a torch.distributed group across the
role's workers, the data-parallel strategy, exactly-once updates and their saved states,
and the optimizer step over micro-batches (optimizer_step.py).

Ranks sum their gradients: every loss is divided by the *global* token count of its
mini-batch (computed by the driver), so the summed gradient is exactly the one-rank
gradient of the whole mini-batch, whatever the number of ranks.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from pipeline.roles.forward import compile_for_training
from pipeline.roles.host import settle_heap
from pipeline.roles.optimizer_step import MicroBatchedSteps
from pipeline.roles.saved_state import Recovery, load_state, recover, save_state
from resources.allocator import MicroBatchAllocator

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


class Trainable(MicroBatchedSteps):
    """A model, its optimizer and its data-parallel group on one worker."""

    def __init__(self, build_model: Callable[[], nn.Module], *, lr: float, strategy: str, device: str,
                 grad_clip: float = 1.0, weight_decay: float = 0.0, gradient_checkpointing: bool = False,
                 compile_model: bool = False, role_name: str = "trainable", recovery_path: str | None = None):
        self.build_model = build_model   # kept: a resize rebuilds an unsharded model
        self.role_name = role_name       # for messages
        self.device = device
        self.gradient_checkpointing = gradient_checkpointing
        # Compiled on GPUs only: on a CPU (tests, laptops) a compile costs more than it saves.
        # Not under FSDP, which shards the blocks after they are built: compiling before
        # sharding is a combination no test here has run.
        self.compile_model = compile_model and torch.device(device).type == "cuda" and strategy != "fsdp"
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
            enable_checkpointing(model)
        if self.compile_model:
            compile_for_training(model)
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
            settle_heap()   # the replaced model and optimizer were frozen with the worker's heap
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

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded over several ranks (FSDP): every forward is collective."""
        return self.strategy == "fsdp" and self.world_size > 1

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


def enable_checkpointing(model: nn.Module) -> None:
    """Keep only each transformer block's input for the backward pass and recompute the
    rest: activation memory of a micro-batch drops from O(layers x hidden x intermediate) to
    O(layers x hidden) per token, for about a third more compute."""
    blocks = _blocks(model)
    # transformers renamed it (5.2x); the older name warns there and is gone in 6.
    enable = getattr(blocks, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        blocks.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _blocks(model: nn.Module) -> nn.Module:
    """The transformers model inside `model` (the critic wraps one in a value head)."""
    for module in model.modules():
        if hasattr(module, "gradient_checkpointing_enable") or hasattr(module, "activation_checkpointing_enable"):
            return module
    raise TypeError(f"gradient_checkpointing needs a transformers model; {type(model).__name__} holds none: "
                    "set train.gradient_checkpointing: false")

