"""HybridTrainer: the driver. It submits role tasks as Dask futures and never touches a GPU."""

from __future__ import annotations

import functools
import logging
import queue
import shutil
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm.auto import tqdm

from pipeline import elastic, weights
from pipeline.config import TrainConfig, make_train_config
from pipeline.data import PromptStream, encode_prompts, read_prompts
from pipeline.experience import build_experience
from pipeline.metrics import PhaseTimer, StepRecord, normalise_update_stats, sum_stats
from pipeline.models import load_tokenizer, materialize
from pipeline.records import GenerationRequest, concat_rollouts, rank_shards
from pipeline.roles import actor, critic, reference, reward, rollout
from pipeline.groups import ProcessGroups
from pipeline.roles.host import RoleHost, plugin_name
from pipeline.tasks import submit, wait_role
from pipeline.weight_routes import WeightRoutes
from resources.adaptive import Decision, RoleAdaptive
from resources.cluster import RoleCluster
from resources.config import ResourceConfig
from resources.plan import plan_workers
from resources.validate import with_role

logger = logging.getLogger("dask_rl")


@dataclass
class InFlightBatch:
    """One step's data while it is being generated and scored: futures, one per shard."""

    index: int
    version: int              # policy version the rollouts are generated with
    rollouts: list
    scores: list
    ref_logprobs: list
    values: list              # empty for GRPO


class HybridTrainer:
    """Trains `actor_model` with PPO or GRPO on role-tagged Dask workers.

    Args:
        actor_model: local path, hub id or a transformers model object (the policy).
        reward_model: a function (prompt, response) -> float, or a sequence-classification
            reward model (path, hub id or object).
        config: the ResourceConfig saying which devices each role uses.
        algorithm: "ppo" or "grpo".
        prompts: list of strings, .jsonl/.parquet path, or a datasets.Dataset.
        critic_model / reference_model: default to the actor's initial weights.
        tokenizer: the policy's tokenizer, if it is not saved beside `actor_model`.
        cluster: an existing RoleCluster to run on (tests share one); else one is started.
        scheduler_address: join a running scheduler (`dask-rl scheduler`) whose role workers
            were started with `dask-rl worker` instead of starting a local cluster.
        **train: any TrainConfig field (steps=..., prompts_per_step=..., ...).
    """

    def __init__(self, actor_model: Any, reward_model: Any, config: ResourceConfig,
                 algorithm: str = "ppo", prompts: Any = None, *, critic_model: Any = None,
                 reference_model: Any = None, tokenizer: Any = None, output_dir: str | None = None,
                 cluster: RoleCluster | None = None, scheduler_address: str | None = None,
                 dashboard_address: str = ":8787",
                 show_progress: bool = True, **train: Any):
        self.train_config: TrainConfig = make_train_config({"algorithm": algorithm, **train})
        self.resources = config
        self.output_dir = Path(output_dir or tempfile.mkdtemp(prefix="dask-rl-"))
        self.run_id = f"{int(time.time())}-{id(self) % 10_000}"
        self.snapshot_dir = str(weights.default_snapshot_dir(self.run_id))
        self.actor_dir = materialize(actor_model, self.output_dir / "actor-init", tokenizer)
        self.tokenizer = tokenizer or load_tokenizer(self.actor_dir)
        if prompts is None:
            raise ValueError("prompts: give a list of strings, a .jsonl/.parquet path or a datasets.Dataset")
        texts = read_prompts(prompts, self.train_config.prompt_column)
        self.prompts = PromptStream(encode_prompts(self.tokenizer, texts), seed=self.train_config.seed)
        self.show_progress = show_progress
        self.history: list[StepRecord] = []
        self.weights: weights.WeightHandle | None = None   # None: the initial weights (version 0)
        self.version = 0
        self._pending: deque[InFlightBatch] = deque()
        self._batches_submitted = 0
        self._boundary: queue.Queue = queue.Queue()   # resource changes waiting for a step boundary
        self._elastic_lock = threading.Lock()
        self._training = False
        self._train_thread: threading.Thread | None = None
        self._adaptive: RoleAdaptive | None = None           # adaptive scaling, see adapt()
        self.adaptive_decisions: list[Decision] = []         # every adaptive decision, in order
        self.roles = roles = self._roles()
        workers = [w for w in plan_workers(config) if w.role in roles]
        if cluster is None and scheduler_address is not None:
            cluster = RoleCluster.connect(scheduler_address, self.roles, timeout=config.timeout_seconds)
        self._owns_cluster = cluster is None   # a cluster passed in is the caller's to close
        self.cluster = cluster or RoleCluster(workers, dashboard_address=dashboard_address)
        self.client = self.cluster.client
        self.groups = ProcessGroups(self.client)
        self.routes = WeightRoutes(self.cluster, self.train_config.weight_sync, config.timeout_seconds)
        self._register_roles(roles, reward_model, critic_model, reference_model)
        print(f"dask-rl: dashboard at {self.cluster.dashboard_link}", flush=True)

    # -- set-up ----------------------------------------------------------------------------
    def _roles(self) -> tuple[str, ...]:
        """The roles this run needs: no critic for GRPO, no reference model when the KL
        weight is 0 (it would only hold a GPU and compute a term multiplied by 0)."""
        tc = self.train_config
        return ("rollout", "reward", *(("reference",) if tc.kl_coef > 0 else ()), "actor",
                *(("critic",) if tc.algorithm == "ppo" else ()))

    def _register_roles(self, roles, reward_model, critic_model, reference_model) -> None:
        """One RoleHost plugin per role: workers carrying the role load its model once."""
        tc = self.train_config
        rollout_spec = self.resources.role("rollout")
        recipes: dict[str, Callable] = {
            "rollout": functools.partial(rollout.RolloutRole, self.actor_dir,
                                         engine=rollout_spec.strategy, dtype=tc.dtype,
                                         engine_args=rollout_spec.vllm_kwargs),
            "actor": functools.partial(actor.ActorRole, self.actor_dir, lr=tc.actor_lr,
                                       strategy=self.resources.role("actor").strategy, grad_clip=tc.grad_clip,
                                       dtype=tc.dtype, gradient_checkpointing=tc.gradient_checkpointing),
            "reward": self._reward_recipe(reward_model),
        }
        if "reference" in roles:
            recipes["reference"] = functools.partial(
                reference.ReferenceRole, self._model_dir(reference_model, "reference"), dtype=tc.dtype,
                micro_batch_size=tc.micro_batch_size)
        if "critic" in roles:
            recipes["critic"] = functools.partial(
                critic.CriticRole, self._model_dir(critic_model, "critic"),
                lr=tc.critic_lr, strategy=self.resources.role("critic").strategy, grad_clip=tc.grad_clip,
                gradient_checkpointing=tc.gradient_checkpointing)
        threads = None if self.resources.uses_cuda else 1  # CPU roles share few cores: one each
        # Registering a plugin returns once every worker has run its setup, i.e. loaded the
        # role's model: one thread per role lets the roles load their models side by side.
        with ThreadPoolExecutor(len(roles)) as pool:
            list(pool.map(lambda role: self.client.register_plugin(
                RoleHost(role, recipes[role], torch_threads=threads), name=plugin_name(role)), roles))

    def _model_dir(self, model: Any, role: str) -> str:
        return self.actor_dir if model is None else materialize(model, self.output_dir / f"{role}-init")

    def _reward_recipe(self, reward_model: Any) -> Callable:
        if callable(reward_model) and not hasattr(reward_model, "save_pretrained"):
            return functools.partial(reward.RewardRole, self.actor_dir, function=reward_model)
        model_dir = materialize(reward_model, self.output_dir / "reward-init")
        return functools.partial(reward.RewardRole, self.actor_dir, model_dir=model_dir)

    # -- the loop --------------------------------------------------------------------------
    def train(self, steps: int | None = None, on_step: Callable[[StepRecord], None] | None = None
              ) -> list[StepRecord]:
        """Run `steps` (default: train.steps) updates with a progress bar; returns the records.

        `on_step(record)` runs in the training thread after each step: a place to log, to
        checkpoint, or to call update_resource between two steps.
        """
        total = steps or self.train_config.steps
        bar = tqdm(range(total), desc=f"dask-rl {self.train_config.algorithm}", disable=not self.show_progress)
        if self.resources.adaptive and self._adaptive is None:  # the file's `adaptive:` section
            self.adapt()
        self._training = True
        try:
            for _ in bar:
                record = self.step()
                bar.set_postfix(record.summary())
                if on_step is not None:
                    on_step(record)
        finally:
            self._training = False
            self._apply_boundary_changes()  # a request that raced the last step is not left waiting
            self.stop_adapting()
        return self.history[-total:]

    def update_resource(self, component: str, device_ids: list[int] | None = None, strategy: str | None = None,
                        *, workers: int | None = None, device_type: str | None = None
                        ) -> list[elastic.ResourceChange]:
        """Give `component` these devices (GPU roles) or this many workers (CPU roles).

        Safe to call from another thread while train() runs. Rollout, reward and reference
        change at once; the actor and critic at the next step boundary (this call waits for
        it). A bad request raises before anything changes. Returns what changed per role.
        """
        request = elastic.BoundaryRequest(component, device_ids, strategy, workers, device_type)
        self._new_config(request)  # validate now: errors reach the caller, nothing changes
        touches_trainable = component in elastic.TRAINABLE or component == "actor"
        if touches_trainable and self._training and threading.current_thread() is not self._train_thread:
            self._boundary.put(request)
            return request.wait(self.resources.timeout_seconds + 600)
        return self._apply(request)

    def _apply(self, request: elastic.BoundaryRequest) -> list[elastic.ResourceChange]:
        with self._elastic_lock:
            return elastic.apply_config(self, self._new_config(request))

    def _new_config(self, request: elastic.BoundaryRequest) -> ResourceConfig:
        spec = elastic.requested_spec(self.resources, request.component, request.device_ids, request.strategy,
                                      request.workers, request.device_type)
        return with_role(self.resources, spec)

    def _apply_boundary_changes(self) -> None:
        while not self._boundary.empty():
            request = self._boundary.get()
            try:
                request.finish(self._apply(request))
            except BaseException as error:  # handed to the caller's thread, which re-raises it
                request.fail(error)

    def step(self) -> StepRecord:
        """One update. Each phase is timed; the dataflow is the sequence of calls below."""
        tc, timer, start = self.train_config, PhaseTimer(), time.perf_counter()
        self._train_thread = threading.current_thread()
        # 0. Resource changes for the actor and critic happen here, between two updates
        #    (also those asked for from a shell with `dask-rl scale`).
        with timer("resize"):
            elastic.poll_remote_requests(self)
            self._apply_boundary_changes()
        # 1. Take the oldest in-flight batch, then keep `max_staleness` newer ones generating
        #    with the current weights while this one is trained on (0 = strictly on-policy).
        with timer("wait_rollout"):
            batch = self._pending.popleft() if self._pending else self._submit_batch()
            while self.version - batch.version > tc.max_staleness:  # never train on older samples
                logger.warning("dask-rl: dropping a batch of version %d (now %d, max_staleness %d)",
                               batch.version, self.version, tc.max_staleness)
                batch = self._pending.popleft() if self._pending else self._submit_batch()
            while len(self._pending) < tc.max_staleness:
                self._pending.append(self._submit_batch())
            rollout_data = concat_rollouts(self._wait("rollout", batch.rollouts, "generated rollouts"))
        # 2. Rewards, reference log-probs and critic values were computed on the rollout
        #    workers' outputs as soon as each shard finished.
        with timer("wait_scores"):
            scores = torch.cat(self._wait("reward", batch.scores, "rewards"))
            # Without a reference model (kl_coef 0) the behaviour logprobs stand in: KL is exactly 0.
            ref_logprobs = (self._cat_padded(self._wait("reference", batch.ref_logprobs, "reference logprobs"))
                            if batch.ref_logprobs else rollout_data.behavior_logprobs)
            values = self._cat_padded(self._wait("critic", batch.values, "critic values")) if batch.values else None
        # 3. Advantages on the driver: small CPU tensors, pure math.
        with timer("advantages"):
            experience, stats = build_experience(
                rollout_data, scores, ref_logprobs, values, algorithm=tc.algorithm, kl_coef=tc.kl_coef,
                gamma=tc.gamma, lam=tc.lam, group_size=tc.samples_per_prompt, whiten=tc.whiten_advantages)
        # 4. Policy (and critic) update, one task per rank; the actor publishes new weights.
        with timer("update"):
            losses = self._update(experience)
        record = StepRecord(step=len(self.history), policy_version=self.version, reward_mean=stats["reward_mean"],
                            kl_mean=stats["kl_mean"], response_length=stats["response_length"],
                            tokens=stats["tokens"], seconds=time.perf_counter() - start,
                            staleness=float(self.version - 1 - batch.version), losses=losses, phases=timer.seconds)
        self.history.append(record)
        return record

    def _submit_batch(self) -> InFlightBatch:
        """Submit generation for one step's prompts, and scoring that starts as each shard lands."""
        tc = self.train_config
        prompts, draws = self.prompts.next_batch(tc.prompts_per_step)
        n_shards = max(1, min(len(self.cluster.workers_of("rollout")), len(prompts)))
        index, self._batches_submitted = self._batches_submitted, self._batches_submitted + 1
        batch = InFlightBatch(index, self.version, [], [], [], [])
        for shard in range(n_shards):
            request = GenerationRequest(prompt_ids=prompts[shard::n_shards], group_ids=draws[shard::n_shards],
                                        samples_per_prompt=tc.samples_per_prompt, max_new_tokens=tc.max_new_tokens,
                                        temperature=tc.temperature, seed=tc.seed * 1_000_003 + index * 1009 + shard)
            tag = f"{index}-{shard}"
            generated = submit(self.client, "rollout", rollout.generate, request, self.weights, tag=tag)
            batch.rollouts.append(generated)
            batch.scores.append(submit(self.client, "reward", reward.score, generated, tag=tag))
            if "reference" in self.roles:
                batch.ref_logprobs.append(submit(self.client, "reference", reference.ref_logprobs, generated,
                                                 tc.temperature, tag=tag))
            if tc.algorithm == "ppo":
                batch.values.append(submit(self.client, "critic", critic.values, generated, tc.micro_batch_size,
                                           tag=tag))
        return batch

    def _update(self, experience) -> dict[str, float]:
        """The update, redone once on the surviving ranks if a rank's worker died during it."""
        try:
            return self._update_once(experience)
        except Exception as error:
            lost = [role for role in ("actor", "critic") if self._lost_member(role)]
            if not lost:
                raise
            logger.warning("dask-rl: %s lost a worker during the update (%r); redoing it on the survivors",
                           ", ".join(lost), error)
            return self._update_once(experience)

    def _lost_member(self, role: str) -> bool:
        members = self.group_members(role)
        return members is not None and not set(members) <= set(self._role_addresses(role))

    def _update_once(self, experience) -> dict[str, float]:
        tc = self.train_config
        actor_workers = self._role_addresses("actor")
        rows = rank_shards(len(experience), len(actor_workers), tc.mini_batches)
        blocks = torch.arange(len(experience)).tensor_split(tc.mini_batches)
        normalizers = tuple(float(experience.response_mask[b].sum()) for b in blocks)
        policy_step = actor.PolicyStep(
            clip_ratio=tc.clip_ratio, kl_coef_in_loss=tc.kl_coef if tc.algorithm == "grpo" else 0.0,
            temperature=tc.temperature, micro_batch_size=tc.micro_batch_size, epochs=tc.ppo_epochs,
            is_cap=tc.is_cap, normalizers=normalizers, next_version=self.version + 1, snapshot_dir=self.snapshot_dir,
            transport=self.routes.publish_transport(),
            # A batch submitted at version v may start generating after v+N is out: keep v.
            keep_versions=tc.max_staleness + 2)
        futures = self._rank_tasks("actor", actor.update, experience, rows, actor_workers, policy_step)
        if tc.algorithm == "ppo":
            critic_workers = self._role_addresses("critic")
            critic_rows = rank_shards(len(experience), len(critic_workers), tc.mini_batches)
            critic_step = critic.CriticStep(clip_range=tc.value_clip, micro_batch_size=tc.micro_batch_size,
                                            epochs=tc.ppo_epochs, normalizers=normalizers)
            critic_futures = self._rank_tasks("critic", critic.update, experience, critic_rows, critic_workers,
                                              critic_step)
        results = self._wait("actor", futures, "the policy update")
        losses = sum_stats(stats for stats, _ in results)
        losses["grad_norm"] /= len(actor_workers)  # the same norm is reported by every rank
        if tc.algorithm == "ppo":
            critic_losses = sum_stats(self._wait("critic", critic_futures, "the critic update"))
            critic_losses["critic_grad_norm"] = critic_losses.pop("grad_norm") / len(critic_workers)
            losses.update(critic_losses)
        self.weights = results[0][1]
        self.version = self.weights.version
        self.routes.after_publish(self.weights, actor_workers[0])
        return normalise_update_stats(losses, tc.ppo_epochs * tc.mini_batches)

    def _rank_tasks(self, role, fn, experience, rows, workers, step) -> list:
        """One task per rank, pinned to its worker (ranks must run at the same time)."""
        backend = self.resources.comm_backend
        if backend == "auto":
            backend = "nccl" if self.resources.role(role).device_type == "cuda" else "gloo"
        # A lost actor rank with nothing exported: restart from the last published weights.
        fallback = self.weights.path if role == "actor" and self.weights is not None else None
        groups = self.groups.ranks(role, workers, strategy=self.resources.role(role).strategy, backend=backend,
                                   timeout_seconds=self.resources.timeout_seconds, fallback_restore=fallback)
        return [submit(self.client, role, fn, [experience.select(r) for r in rows[rank]], groups[rank], step,
                       tag=f"{self.version}-r{rank}", workers=[address])
                for rank, address in enumerate(workers)]

    def group_members(self, role: str) -> tuple[str, ...] | None:
        """The workers of the role's current process group, rank order."""
        return self.groups.members(role)

    def _role_addresses(self, role: str) -> list[str]:
        return [w["address"] for w in self.cluster.workers_of(role)]

    def _wait(self, role: str, futures: list, what: str) -> list:
        return wait_role(self.client, futures, role, what, self.resources.timeout_seconds)

    @staticmethod
    def _cat_padded(parts: list[torch.Tensor]) -> torch.Tensor:
        width = max(p.shape[1] for p in parts)
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])

    # -- adaptive scaling: resources.adaptive decides, update_resource applies (elastic.py) --
    def adapt(self, bounds: dict[str, tuple[int, int]] | None = None, interval: float = 2.0, wait_count: int = 3,
              **policy: Any) -> RoleAdaptive:
        """Move devices/workers from idle roles to starved ones while training runs.

        `bounds`: role -> (min, max) workers; None: the resource file's `adaptive:` section
        (train() starts that by itself). Every `interval` seconds each bounded role's backlog
        and busy share are measured on the scheduler; once a role has been starved and
        another idle `wait_count` times in a row, one device (GPU roles) or worker (CPU
        roles) moves between them. Each decision is logged with its reason and appended to
        `adaptive_decisions`. `policy`: window=, thresholds=, spare= (see RoleAdaptive).
        Runs until stop_adapting(), the end of train() or close().
        """
        self.stop_adapting()
        self._adaptive = elastic.start_adaptive(self, bounds, interval=interval, wait_count=wait_count, **policy)
        return self._adaptive

    def stop_adapting(self) -> None:
        """Stop adaptive scaling; a move in progress finishes first."""
        adaptive, self._adaptive = self._adaptive, None
        if adaptive is not None:
            elastic.stop_adaptive(self, adaptive)

    def close(self) -> None:
        """Stop adapting, drop in-flight batches, delete the weight snapshots and close the
        cluster this trainer started (a cluster passed in with `cluster=` stays up)."""
        self.stop_adapting()
        for batch in self._pending:
            self.client.cancel(batch.rollouts + batch.scores + batch.ref_logprobs + batch.values)
        self._pending.clear()
        for address in self._role_addresses("actor"):  # snapshots live on the actor's host
            self.client.run(shutil.rmtree, self.snapshot_dir, True, workers=[address])
        shutil.rmtree(self.snapshot_dir, ignore_errors=True)
        if self._owns_cluster:
            self.cluster.close()

    def __enter__(self) -> HybridTrainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
