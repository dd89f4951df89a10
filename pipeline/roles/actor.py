"""The actor role: the policy being trained, one rank per actor worker."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass

import torch
from distributed import get_worker

from pipeline import weights
from pipeline.algorithms import aggregate_loss, importance_weights, kl_loss, masked_sum
from pipeline.packing import computed_tokens
from pipeline.policy_losses import POLICY_LOSSES
from pipeline.metrics import sum_stats
from pipeline.records import Experience, on_device
from pipeline.roles.forward import (
    choose_packing, in_row_chunks, response_logprobs, response_logprobs_and_entropy, warm_up_batch,
)
from pipeline.roles.host import resolve_device, role_state, settle_heap
from pipeline.roles.training import GroupInfo, Trainable
from resources.allocator import rows_per_micro_batch

logger = logging.getLogger("dask_rl")


@dataclass(frozen=True)
class PolicyStep:
    """Hyperparameters of one policy update, passed as plain values."""

    clip_ratio: float
    kl_coef_in_loss: float           # GRPO puts KL in the loss; PPO puts it in the reward (0 here)
    temperature: float
    micro_batch_size: int | str      # rows per micro-batch, or "auto" (training.Trainable.optimizer_step)
    epochs: int
    is_cap: float                    # truncation of the behaviour->proximal importance weight
    normalizers: tuple[float, ...]   # global valid-token count of each mini-batch
    next_version: int                # the version the updated weights are published as
    snapshot_dir: str
    transport: str = "shm"           # how rank 0 publishes: "shm", "cuda_ipc" or "dask" (see weights.py)
    keep_versions: int = 3           # published versions kept readable (batches in flight may still need them)
    recovery_path: str | None = None  # where rank 0 saves the state after this update (None: not this step)
    # Algorithm options (README "Algorithm options"); the defaults give the plain PPO loss.
    clip_ratio_high: float | None = None  # upper clip eps (None: clip_ratio, which is the lower one)
    clip_ratio_c: float | None = None     # dual-clip bound for negative advantages (None: off)
    policy_loss: str = "ppo"              # a key of policy_losses.POLICY_LOSSES
    loss_agg_mode: str = "token-mean"     # a key of algorithms.LOSS_AGGREGATIONS
    sequence_counts: tuple[float, ...] = ()  # global count of rows with a response token, per mini-batch
    horizon: float | None = None          # seq-mean-token-sum-norm's constant (max_new_tokens)
    entropy_coef: float = 0.0             # weight of the entropy bonus (the entropy is measured anyway)
    lr: float | None = None               # learning rate of this update (None: leave the optimizer's)
    pack_sequences: bool = True           # forwards over the rows' real tokens, packed (pipeline/packing.py)
    share_prompts: bool = False           # and a group's prompt computed once (forward.choose_packing)


class ActorRole:
    def __init__(self, model_dir: str, *, device: str = "auto", lr: float, strategy: str,
                 grad_clip: float = 1.0, dtype: str = "float32", gradient_checkpointing: bool = False,
                 compile_model: bool = False, recovery_path: str | None = None, weight_decay: float = 0.0):
        device = resolve_device(device)
        from pipeline.models import load_causal_lm

        build = functools.partial(load_causal_lm, model_dir, dtype=getattr(torch, dtype))
        self.trainer = Trainable(build, lr=lr, strategy=strategy, device=device, grad_clip=grad_clip,
                                 weight_decay=weight_decay, gradient_checkpointing=gradient_checkpointing,
                                 compile_model=compile_model, role_name="actor", recovery_path=recovery_path)
        self.device = device

    def close(self) -> None:
        self.trainer.close()

    def packing(self, pack_sequences: bool, share_prompts: bool) -> bool | str:
        """The packing of this actor's forwards (forward.choose_packing; a sharded model packs rows)."""
        if self.trainer.sharded:
            return pack_sequences
        return choose_packing(self.trainer.model, pack_sequences, share_prompts)

    def warm_up(self, temperature: float, entropy_grad: bool, pack: bool, proximal: bool,
                share_prompts: bool = False) -> float | None:
        """Compile a compiled actor's update now, on a made-up batch (forward.warm_up_batch),
        so that the first update does not: the trainer asks for it at start, while the first
        batch generates. Weights and optimizer state are left as they were. Returns the
        seconds it took (None: nothing to compile)."""
        if not self.trainer.compile_model:
            return None
        start = time.perf_counter()
        pack = self.packing(pack, share_prompts)
        model = self.trainer.model
        ids, mask, prompt = warm_up_batch(model.config.vocab_size)

        def loss(model):   # the forward of _loss; the graphs compile for its inputs' shapes and modes
            logp, entropy = response_logprobs_and_entropy(model, ids, mask, prompt, temperature,
                                                          entropy_grad=entropy_grad, pack=pack)
            return logp.sum() + (entropy.sum() if entropy_grad else 0.0)

        self.trainer.warm_up(loss)
        if proximal:   # updates of several optimizer steps score the proximal policy first (_logprobs)
            with torch.no_grad():
                response_logprobs(model.eval(), ids, mask, prompt, temperature, pack=pack)
        settle_heap(thaw=False)   # the compiled graphs and their guards live as long as the model
        seconds = time.perf_counter() - start
        logger.info("dask-rl: actor compiled its update in %.1f s, before its first batch", seconds)
        return seconds

    def update(self, mini_batches: list[Experience], group: GroupInfo,
               step: PolicyStep) -> tuple[dict[str, float], weights.WeightHandle | None]:
        """Decoupled PPO on this rank's rows; rank 0 then publishes the new weights.

        Exactly once: a redo of an update this group already applied (the other role failed,
        or a rank was lost after the step) returns the first result and publishes nothing new.
        """
        self.trainer.join(group)
        if self.trainer.applied(step.next_version):
            return self.trainer.last_result
        if step.lr is not None:  # the schedule's rate for this update (pipeline/schedules.py)
            self.trainer.set_learning_rate(step.lr)
        # The proximal policy is the one before this update (the "old" policy of PPO's
        # clip); the rollout's own logprobs (the behaviour policy) enter through the
        # truncated importance weight, which corrects for staleness. With one optimizer step
        # the proximal policy is the model of the loss's own forward: its detached logprobs
        # are the proximal ones (None below), and a whole forward pass is saved.
        one_step = step.epochs * len(mini_batches) == 1
        pack = self.packing(step.pack_sequences, step.share_prompts)
        proximal = [None] * len(mini_batches) if one_step else [self._logprobs(b, step, pack) for b in mini_batches]
        per_step = []
        sequences = step.sequence_counts or (None,) * len(mini_batches)
        for _ in range(step.epochs):
            for batch, prox, normalizer, seqs in zip(mini_batches, proximal, step.normalizers, sequences):
                def take(rows, batch=batch, prox=prox):
                    return batch.select(rows), None if prox is None else prox[rows]

                loss = lambda model, c: self._loss(model, c, step, normalizer, seqs, pack)  # noqa: E731
                per_step.append(self.trainer.optimizer_step(take, len(batch), loss, max_rows=step.micro_batch_size,
                                                            tokens_per_row=batch.input_ids.shape[1],
                                                            row_tokens=computed_tokens(batch, pack)))
        totals = sum_stats(per_step)
        if totals.get("refused_steps", 0) == len(per_step):  # no step applied: the published version stands
            return totals, None
        # Collective under FSDP: every rank calls it.
        state = self.trainer.full_state_dict(on_device=step.transport in weights.ON_DEVICE)
        handle = None if state is None else weights.publish(state, step.next_version, step.snapshot_dir,
                                                            keep=step.keep_versions, transport=step.transport)
        return self.trainer.record(step.next_version, (totals, handle), step.recovery_path)

    def _logprobs(self, batch: Experience, step: PolicyStep, pack: bool | str) -> torch.Tensor:
        model = self.trainer.model.eval()
        if not self.trainer.sharded:
            return in_row_chunks(response_logprobs, model, batch, step.micro_batch_size, self.device,
                                 step.temperature, what="proximal logprobs", pack=pack)
        ids, mask = batch.input_ids, batch.attention_mask   # the forward sends them to the device
        return self.trainer.sharded_forward(
            lambda rows: response_logprobs(model, ids[rows], mask[rows], batch.prompt_length, step.temperature,
                                           pack=pack).float(),
            len(batch), rows_per_micro_batch(step.micro_batch_size), what="proximal logprobs")

    def _loss(self, model, chunk, step: PolicyStep, normalizer: float, sequences: float | None, pack: bool | str):
        batch, proximal = chunk
        mask = on_device(batch.response_mask, self.device)
        logp, entropy = response_logprobs_and_entropy(   # the rows go to the device packed
            model, batch.input_ids, batch.attention_mask, batch.prompt_length,
            step.temperature, entropy_grad=step.entropy_coef > 0, pack=pack)
        proximal = logp.detach() if proximal is None else proximal
        is_weights = importance_weights(proximal, on_device(batch.behavior_logprobs, self.device), mask, step.is_cap)
        # One aggregation for every term, with the global counts: splitting never changes the sum.
        agg = dict(loss_agg_mode=step.loss_agg_mode, sequences=sequences, horizon=step.horizon)
        loss, stats = POLICY_LOSSES[step.policy_loss](
            logp, proximal, on_device(batch.advantages, self.device), mask, step.clip_ratio, normalizer=normalizer,
            is_weights=is_weights, clip_ratio_high=step.clip_ratio_high, clip_ratio_c=step.clip_ratio_c, **agg)
        if step.kl_coef_in_loss:
            loss = loss + step.kl_coef_in_loss * kl_loss(logp, on_device(batch.ref_logprobs, self.device), mask,
                                                         normalizer=normalizer, **agg)
        if step.entropy_coef:  # a bonus: higher entropy lowers the loss
            loss = loss - step.entropy_coef * aggregate_loss(entropy, mask, step.loss_agg_mode, normalizer,
                                                             sequences, step.horizon)
        tokens = mask.sum()
        # Token-weighted sums, left on the device (optimizer_step reads them once, after the
        # last micro-batch); the driver divides by the step's token count.
        return loss, {"policy_loss": loss.detach(), "clip_tokens": stats["clip_frac"].detach() * tokens,
                      "clip_lower_tokens": stats["clip_frac_lower"].detach() * tokens,
                      "entropy_sum": masked_sum(entropy.detach(), mask),
                      "tokens": tokens, "is_weight_sum": (is_weights.detach() * mask).sum()}


def update(mini_batches: list[Experience], group: GroupInfo,
           step: PolicyStep) -> tuple[dict[str, float], weights.WeightHandle | None]:
    """Task: one rank's part of a policy update."""
    stats, handle = role_state("actor").update(mini_batches, group, step)
    if handle is not None:  # where readers on other hosts fetch it from (the Dask fallback)
        handle = dataclasses.replace(handle, address=get_worker().address)
    return stats, handle


def warm_up(temperature: float, entropy_grad: bool, pack: bool, proximal: bool,
            share_prompts: bool = False) -> float | None:
    """Task: ActorRole.warm_up. A failure here costs the first update its head start, never
    the run: the update compiles as it would have, and reports any real fault itself."""
    try:
        return role_state("actor").warm_up(temperature, entropy_grad, pack, proximal, share_prompts)
    except Exception as error:  # noqa: BLE001 - see above
        logger.warning("dask-rl: the actor's warm-up failed (%s); its first update compiles instead", error)
        return None


def export_state(path: str) -> str | None:
    """Task: every actor rank saves its part; rank 0 writes the full state to `path`."""
    return role_state("actor").trainer.export_state(path)


def save_pretrained(path: str) -> str | None:
    """Task: the policy in Hugging Face format under `path` (rank 0 writes; every rank runs it)."""
    return role_state("actor").trainer.save_pretrained(path, lambda model, where: model.save_pretrained(where))


def publish_loaded(version: int, snapshot_dir: str, transport: str, keep: int) -> weights.WeightHandle:
    """Task: publish the weights this actor holds as `version` (a resumed run's first
    rollouts must sample from the restored policy, not the initial one)."""
    state = role_state("actor").trainer.full_state_dict(on_device=transport in weights.ON_DEVICE)
    handle = weights.publish(state, version, snapshot_dir, keep=keep, transport=transport)
    return dataclasses.replace(handle, address=get_worker().address)
