"""Phase 4 of a step, the update: one task per actor (and critic) rank, pinned to its worker.

Each role applies an update exactly once, by version (the worker side remembers what it
applied, roles/training.py); a rank lost during the update costs one redo, as soon as the
loss is seen, on a group rebuilt from the role's last good state (roles/saved_state.py).
An out-of-memory error on one rank of a sharded (FSDP) group costs a redo the same way, with
that role's micro-batches halved from then on.
"""

from __future__ import annotations

import logging

import torch

from pipeline.config import TrainConfig
from pipeline.fleet import Fleet
from pipeline.fleet.tasks import WorkerLost
from pipeline.metrics import normalise_update_stats, sum_stats
from pipeline.records import Experience, rank_shards
from pipeline.schedules import lr_factor
from pipeline.roles import actor, critic
from resources.allocator import OUT_OF_MEMORY, GroupOutOfMemory, MicroBatchAllocator, OutOfMemoryAtOneRow

logger = logging.getLogger("dask_rl")


class PolicyUpdate:
    """`update(experience)` -> the step's losses; the actor's new weights are published."""

    def __init__(self, fleet: Fleet, train_config: TrainConfig, roles: tuple[str, ...], keep_versions: int):
        self.fleet = fleet
        self.train_config = train_config
        self.roles = roles
        self.keep_versions = keep_versions   # published versions the actor keeps (InFlight.published_versions)
        self._warming: list = []             # the actor ranks' warm-ups, until the first update
        # role -> rows per micro-batch after an out-of-memory error on a sharded rank, kept
        # here for the rest of the run: the ranks restarted to free the group forget it.
        self.micro_batch_caps: dict[str, int] = {}

    def warm_up(self) -> None:
        """Each actor rank compiles its update now, while the first batch generates, instead
        of in the first update (actor.warm_up; nothing to do unless train.compile_model applies).
        The first update queues behind it on each worker."""
        tc = self.train_config
        self._warming = [self.fleet.submit("actor", actor.warm_up, tc.temperature, tc.entropy_coef > 0,
                                           tc.pack_sequences, tc.ppo_epochs * tc.mini_batches > 1, tc.share_prompts,
                                           tag="warm-up", workers=[address])
                         for address in self.fleet.addresses("actor")]

    def __call__(self, experience: Experience) -> dict[str, float]:
        """The update, redone once if a rank's worker died during it, and with halved
        micro-batches each time a sharded rank ran out of memory. Each role applies an
        update exactly once (by version): in a redo a role that had finished returns its
        first result, and a group that lost or freed a rank rebuilds from its last good state."""
        redone_loss = False
        while True:
            try:  # a rank lost since the last update is awaited as the ranks are chosen (_rank_tasks)
                return self._once(experience)
            except GroupOutOfMemory as error:
                self._cap_micro_batches(error)
                self.fleet.free_survivors(error.role)
                self.fleet.await_replacements(error.role)
            except Exception as error:
                # A member that died as its group formed (or as its rows were sent) was never a
                # member the fleet lists, and a loss a wait saw first may not be listed yet.
                forming = [error.role] if isinstance(error, WorkerLost) and error.role else []
                lost = self._lost_roles() or forming
                if redone_loss or not lost:
                    raise
                redone_loss = True
                # The text, not the exception: a handler that keeps its records (a test's log
                # capture) would keep the traceback's frames, and with them this step's futures.
                logger.warning("dask-rl: %s lost a worker during the update (%s); redoing it", ", ".join(lost),
                               str(error))
                for role in lost:
                    self.fleet.free_survivors(role)
                for role in forming:  # not among _lost_roles(): wait for its replacement here
                    self.fleet.await_replacements(role)

    def _cap_micro_batches(self, error: GroupOutOfMemory) -> None:
        """Halve `error.role`'s micro-batches below the size that failed (bounded: one row
        that does not fit is an error)."""
        if error.rows <= 1:
            raise OutOfMemoryAtOneRow(
                f"{error}: a micro-batch of one row does not fit, and train.micro_batch_size cannot go lower. "
                f"Fix: set train.gradient_checkpointing: true, shard the {error.role} over more GPUs (device_ids), "
                f"or shorten prompts / max_new_tokens") from error
        cap = MicroBatchAllocator.backoff(error.rows)
        self.micro_batch_caps[error.role] = cap
        self.fleet.degraded(error.role, error.what, error.rows, cap, "rows per micro-batch", OUT_OF_MEMORY,
                            f"{error.detail}; the update is redone, the smaller size kept for the run")

    def _micro_batch_size(self, role: str) -> int | str:
        # A cap is below what failed: rows, also where the configured size was "auto".
        return self.micro_batch_caps.get(role, self.train_config.micro_batch_size)

    def _lost_roles(self) -> list[str]:
        return [role for role in ("actor", "critic") if role in self.roles and self.fleet.lost_member(role)]

    def _once(self, experience: Experience) -> dict[str, float]:
        tc, fleet = self.train_config, self.fleet
        blocks = torch.arange(len(experience)).tensor_split(tc.mini_batches)
        # At least 1: a mini-batch with no token in the loss (train.overlong_filter took every
        # response out) then adds a loss of exactly 0 instead of dividing by 0.
        normalizers = tuple(max(1.0, float(experience.response_mask[b].sum())) for b in blocks)
        sequences = tuple(max(1.0, float((experience.response_mask[b].sum(-1) > 0).sum())) for b in blocks)
        # The schedule's position is the number of updates applied (the policy version), which
        # checkpoints hold: a resumed run continues it exactly.
        factor = lr_factor(self.fleet.version, tc.steps, tc.lr_warmup_steps, tc.lr_schedule, tc.lr_min_ratio)
        policy_step = actor.PolicyStep(
            clip_ratio=tc.clip_ratio if tc.clip_ratio_low is None else tc.clip_ratio_low,
            kl_coef_in_loss=tc.kl_coef if tc.algorithm == "grpo" else 0.0,
            temperature=tc.temperature, micro_batch_size=self._micro_batch_size("actor"), epochs=tc.ppo_epochs,
            is_cap=tc.is_cap, normalizers=normalizers, next_version=self.fleet.version + 1,
            snapshot_dir=fleet.snapshot_dir, transport=fleet.publish_transport(),
            keep_versions=self.keep_versions, recovery_path=self._recovery_path("actor"),
            clip_ratio_high=tc.clip_ratio_high, clip_ratio_c=tc.clip_ratio_c, policy_loss=tc.policy_loss,
            loss_agg_mode=tc.loss_agg_mode, sequence_counts=sequences, horizon=float(tc.max_new_tokens),
            entropy_coef=tc.entropy_coef, lr=tc.actor_lr * factor, pack_sequences=tc.pack_sequences,
            share_prompts=tc.share_prompts)
        actor_workers, actor_futures = self._rank_tasks("actor", actor.update, experience, policy_step)
        if "critic" in self.roles:
            critic_step = critic.CriticStep(clip_range=tc.value_clip,
                                            micro_batch_size=self._micro_batch_size("critic"),
                                            epochs=tc.ppo_epochs, normalizers=normalizers,
                                            next_version=self.fleet.version + 1,
                                            recovery_path=self._recovery_path("critic"), lr=tc.critic_lr * factor,
                                            pack_sequences=tc.pack_sequences)
            critic_workers, critic_futures = self._rank_tasks("critic", critic.update, experience, critic_step)
        warming, self._warming = self._warming, []
        fleet.wait("actor", warming, "the actor's warm-up")   # done by now, or the update waits for it anyway
        results = fleet.wait("actor", actor_futures, "the policy update")
        losses = sum_stats(stats for stats, _ in results)
        for key in ("grad_norm", "refused_steps"):  # the same on every rank
            losses[key] = losses.get(key, 0.0) / len(actor_workers)
        if "critic" in self.roles:
            critic_losses = sum_stats(fleet.wait("critic", critic_futures, "the critic update"))
            critic_losses["critic_grad_norm"] = critic_losses.pop("grad_norm") / len(critic_workers)
            critic_losses["critic_refused_steps"] = critic_losses.pop("refused_steps", 0.0) / len(critic_workers)
            losses.update(critic_losses)
        handle = results[0][1]
        if handle is not None:
            fleet.published(handle, actor_workers[0])
        else:  # every optimizer step was refused (non-finite gradients): the last good version stays
            logger.warning("dask-rl: the policy update applied no step; v%d stays published", self.fleet.version)
        losses = normalise_update_stats(losses, tc.ppo_epochs * tc.mini_batches)
        losses["actor_lr"] = policy_step.lr
        if "critic" in self.roles:
            losses["critic_lr"] = critic_step.lr
        return losses

    def _recovery_path(self, role: str) -> str | None:
        """Where `role` saves its state after this update, when one is due (None: not now)."""
        every = self.train_config.recovery_every_n_steps
        if every is None:  # auto: cheap on CPU; on a GPU it copies the model and optimizer out
            every = 1 if self.fleet.config.role(role).device_type == "cpu" else 0
        return self.fleet.recovery_path(role) if every and (self.fleet.version + 1) % every == 0 else None

    def _rank_tasks(self, role: str, fn, experience, step) -> tuple[list[str], list]:
        """One task per rank, pinned to its worker (ranks must run at the same time)."""
        workers = self.fleet.rank_workers(role)
        rows = rank_shards(len(experience), len(workers), self.train_config.mini_batches, role)
        groups = self.fleet.rank_groups(role, workers)
        futures = []
        for rank, address in enumerate(workers):
            tag = f"{self.fleet.version}-r{rank}"
            shards = self.fleet.place(role, fn, [experience.select(r) for r in rows[rank]], address, tag=tag)
            futures.append(self.fleet.submit(role, fn, shards, groups[rank], step, tag=tag, workers=[address]))
        return workers, futures
