"""The critic role (PPO only): values for GAE, and its own clipped value-loss update."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.algorithms import value_loss
from pipeline.metrics import sum_stats
from pipeline.packing import computed_tokens
from pipeline.records import Experience, Rollout, on_device
from pipeline.roles.forward import in_row_chunks, response_values
from pipeline.roles.host import resolve_device, role_state
from pipeline.roles.training import GroupInfo, Trainable


@dataclass(frozen=True)
class CriticStep:
    """Hyperparameters of one critic update, passed as plain values."""

    clip_range: float
    micro_batch_size: int | str      # rows per micro-batch, or "auto" (training.Trainable.optimizer_step)
    epochs: int
    normalizers: tuple[float, ...]   # global valid-token count of each mini-batch
    next_version: int                # the policy version this update goes with (exactly once per version)
    recovery_path: str | None = None  # where rank 0 saves the state after this update (None: not this step)
    lr: float | None = None          # learning rate of this update (None: leave the optimizer's)
    pack_sequences: bool = True      # forwards over the rows' real tokens, packed (pipeline/packing.py)


class CriticRole:
    def __init__(self, model_dir: str, *, device: str = "auto", lr: float, strategy: str, grad_clip: float = 1.0,
                 gradient_checkpointing: bool = False, compile_model: bool = False, recovery_path: str | None = None,
                 weight_decay: float = 0.0):
        device = resolve_device(device)
        from pipeline.models import ValueModel

        self.trainer = Trainable(lambda: ValueModel(model_dir), lr=lr, strategy=strategy, device=device,
                                 grad_clip=grad_clip, weight_decay=weight_decay,
                                 gradient_checkpointing=gradient_checkpointing, compile_model=compile_model,
                                 role_name="critic", recovery_path=recovery_path)
        self.device = device

    def values(self, rollout: Rollout, micro_batch_size: int | str, pack_sequences: bool = True) -> torch.Tensor:
        """(B, R) V(s_t) for each response token, 0 on padding."""
        return in_row_chunks(response_values, self.trainer.model.eval(), rollout, micro_batch_size,
                             self.device, what="critic values", pack=pack_sequences).cpu() * rollout.response_mask

    def close(self) -> None:
        self.trainer.close()

    def update(self, mini_batches: list[Experience], group: GroupInfo, step: CriticStep) -> dict[str, float]:
        self.trainer.join(group)
        if self.trainer.applied(step.next_version):  # a redo: the update is in already
            return self.trainer.last_result
        if step.lr is not None:  # the schedule's rate for this update (pipeline/schedules.py)
            self.trainer.set_learning_rate(step.lr)
        per_step = []
        for _ in range(step.epochs):
            for batch, normalizer in zip(mini_batches, step.normalizers):
                loss = lambda model, b: self._loss(model, b, step, normalizer)  # noqa: E731
                per_step.append(self.trainer.optimizer_step(batch.select, len(batch), loss,
                                                            max_rows=step.micro_batch_size,
                                                            tokens_per_row=batch.input_ids.shape[1],
                                                            row_tokens=computed_tokens(batch, step.pack_sequences)))
        return self.trainer.record(step.next_version, sum_stats(per_step), step.recovery_path)

    def _loss(self, model, batch: Experience, step: CriticStep, normalizer: float):
        to = lambda t: on_device(t, self.device)  # noqa: E731
        values = response_values(model, batch.input_ids, batch.attention_mask, batch.prompt_length,  # sent packed
                                 pack=step.pack_sequences)
        loss, stats = value_loss(values, to(batch.old_values), to(batch.returns), to(batch.response_mask),
                                 step.clip_range, normalizer=normalizer)
        tokens = to(batch.response_mask).sum()
        return loss, {"value_loss": loss.detach(), "value_clip_tokens": stats["value_clip_frac"].detach() * tokens}


def values(rollout: Rollout, micro_batch_size: int | str, pack_sequences: bool = True) -> torch.Tensor:
    """Task: (B, R) critic values for one rollout shard."""
    return role_state("critic").values(rollout, micro_batch_size, pack_sequences)


def update(mini_batches: list[Experience], group: GroupInfo, step: CriticStep) -> dict[str, float]:
    """Task: one rank's part of a critic update."""
    return role_state("critic").update(mini_batches, group, step)


def export_state(path: str) -> str | None:
    """Task: every critic rank saves its part; rank 0 writes the full state to `path`."""
    return role_state("critic").trainer.export_state(path)


def save_pretrained(path: str) -> str | None:
    """Task: the critic under `path`: its transformer body in Hugging Face format plus the
    value head (ValueModel(path) loads both back)."""
    return role_state("critic").trainer.save_pretrained(path, lambda model, where: model.save_pretrained(where))
