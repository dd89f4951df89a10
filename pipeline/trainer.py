"""HybridTrainer: the driver. It submits role tasks as Dask futures and never touches a GPU.

This file is the step's dataflow and the loop; who runs where (workers, process groups,
weight routes, resizing, adaptive scaling, the timeout) is the Fleet's (pipeline/fleet).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from tqdm.auto import tqdm

from pipeline import events, monitor, weights
from pipeline.config import make_train_config
from pipeline.chat import prompt_stream
from pipeline.engines import vllm as vllm_engine
from pipeline.engines.hf import partial_refusal
from pipeline.evaluation import Evaluation
from pipeline.fleet import Fleet, ResourceChange, ResourceRequest
from pipeline.metrics import PhaseTimer, StepRecord, reward_figures
from pipeline.models import context_length, load_tokenizer, materialize, stop_token_ids
from pipeline.outputs import RunOutputs
from pipeline.recipes import role_recipes
from pipeline.inflight import InFlight, take_trained
from pipeline.records import join_scores, join_shards
from pipeline.screening import SampleScreen, checked_experience, keep_informative_groups, screen_samples
from pipeline.update import PolicyUpdate
from resources.adaptive import RoleAdaptive
from resources.allocator import OUT_OF_MEMORY
from resources.cluster import RoleCluster
from resources.config import ResourceConfig

logger = logging.getLogger("dask_rl")


class HybridTrainer:
    """Trains `actor_model` with PPO or GRPO on role-tagged Dask workers.

    Args:
        actor_model: local path, hub id or a transformers model object (the policy).
        reward_model: a reward function (per sample, `(prompt, response, **fields) -> float | None`,
            or TRL's batched `(prompts, completions, **columns) -> list`), a sequence-classification
            reward model (path, hub id or object), or a list of them (weighted by train.reward_weights).
        config: the ResourceConfig saying which devices each role uses.
        algorithm: "ppo" or "grpo".
        prompts: list of strings or rows, .jsonl/.parquet path, or a datasets.Dataset; a row's
            prompt is text or a list of chat messages, its other fields reach the rewards.
        eval_prompts: held-out prompts in the same forms, evaluated every train.eval_every_n_steps.
        critic_model / reference_model: default to the actor's initial weights.
        tokenizer: the policy's tokenizer, if it is not saved beside `actor_model`.
        cluster: an existing RoleCluster to run on (tests share one); else one is started.
        scheduler_address: join a running scheduler (`dask-rl scheduler`) whose role workers
            were started with `dask-rl worker` instead of starting a local cluster.
        output_dir: where metrics, samples, checkpoints and the models go (pipeline/outputs.py).
        resume: a checkpoint or a directory of them (True: output_dir's) to continue from.
        dashboard_address / host: where the local cluster's dashboard, scheduler and workers
            listen: this machine only unless `host` names an interface ("0.0.0.0": all).
        security: a distributed Security (resources.cluster.tls_security) for TLS.
        **train: any TrainConfig field (steps=..., prompts_per_step=..., ...).
    """

    def __init__(self, actor_model: Any, reward_model: Any, config: ResourceConfig,
                 algorithm: str = "ppo", prompts: Any = None, *, critic_model: Any = None,
                 reference_model: Any = None, tokenizer: Any = None, output_dir: str | None = None,
                 cluster: RoleCluster | None = None, scheduler_address: str | None = None,
                 dashboard_address: str = ":8787", host: str = "127.0.0.1", security: Any = None,
                 show_progress: bool = True, resume: str | bool | None = None, eval_prompts: Any = None,
                 **train: Any):
        self.train_config = tc = make_train_config({"algorithm": algorithm, **train})
        uses_vllm = config.role("rollout").strategy == "vllm"
        if tc.partial_rollouts and config.role("rollout").strategy != "cuda_graph":
            raise ValueError(partial_refusal(config.role("rollout").strategy))
        if uses_vllm and cluster is None and scheduler_address is None:
            # The local workers run this Python: without vllm they would start, load every other
            # role's model and only then fail in the rollout worker. Fail first, with the fix.
            vllm_engine.require_vllm()
        if prompts is None:
            raise ValueError("prompts: give a list of strings, a .jsonl/.parquet path or a datasets.Dataset")
        self.output_dir = Path(output_dir or tempfile.mkdtemp(prefix="dask-rl-"))
        self.actor_dir = materialize(actor_model, self.output_dir / "actor-init", tokenizer)
        self.tokenizer = tokenizer or load_tokenizer(self.actor_dir)
        self.stop_token_ids = stop_token_ids(self.actor_dir, self.tokenizer)  # every EOS the model lists
        context = context_length(self.actor_dir)
        self.prompts = prompt_stream(prompts, self.tokenizer, tc, context, self.actor_dir)
        if (tc.eval_every_n_steps or tc.eval_before_train) and eval_prompts is None:
            raise ValueError("train.eval_every_n_steps / eval_before_train: no eval_prompts to evaluate on. Fix: give "
                             "eval_prompts (the same forms as prompts), or leave evaluation off.")
        eval_stream = None if eval_prompts is None else prompt_stream(eval_prompts, self.tokenizer, tc, context,
                                                                      self.actor_dir)
        self.show_progress = show_progress
        self.history: list[StepRecord] = []
        self.stop_requested = False
        # No critic for GRPO; no reference model when the KL weight is 0 (it would only hold
        # a GPU and compute a term multiplied by 0).
        self.roles = ("rollout", "reward", *(("reference",) if tc.kl_coef > 0 else ()), "actor",
                      *(("critic",) if tc.algorithm == "ppo" else ()))
        self.outputs = RunOutputs(self.output_dir, tc, self.tokenizer, self.roles)
        resume_from = self.outputs.find_checkpoint(resume)  # before any worker starts: a bad one fails first
        self.run_id = run_id = f"{os.getpid()}-{int(time.time())}-{id(self) % 10_000}"
        snapshot_dir = str(weights.default_snapshot_dir(run_id))
        self.fleet = Fleet(config, self.roles, snapshot_dir=snapshot_dir,
                           weight_sync=tc.weight_sync, cluster=cluster, scheduler_address=scheduler_address,
                           dashboard_address=dashboard_address, host=host, security=security)
        monitor.watch(self.fleet.client, run_id, algorithm=tc.algorithm, roles=list(self.roles))
        if uses_vllm and (cluster is not None or scheduler_address is not None):
            # Workers started elsewhere may run another Python: ask them, before any model loads.
            vllm_engine.require_vllm_on(self.fleet.client, self.fleet.addresses("rollout"))
        recipes = role_recipes(tc, config, self.roles, self.actor_dir, self.output_dir, reward_model=reward_model,
                               critic_model=critic_model, reference_model=reference_model,
                               snapshot_dir=snapshot_dir)
        self.fleet.register(recipes, torch_threads=None if config.uses_cuda else 1)  # CPU roles share few cores
        self.batches = InFlight(self.fleet, self.prompts, tc, self.roles, self.stop_token_ids,
                                evaluates=eval_stream is not None)
        self.evaluation = None if eval_stream is None else Evaluation(self.fleet, eval_stream, tc, self.stop_token_ids)
        self.update = PolicyUpdate(self.fleet, tc, self.roles, keep_versions=self.batches.published_versions)
        self.first_step = self.outputs.restore(self.fleet, self.batches, resume_from)  # steps done before
        self.update.warm_up()   # the actor compiles its update while the first batch generates
        link = self.fleet.cluster.dashboard_link
        print(f"dask-rl: scheduler at {self.fleet.client.scheduler.address} (for `dask-rl worker` and "
              f"`dask-rl scale`); dashboard at {link}, RL page {link.rsplit('/', 1)[0]}{monitor.PAGE}", flush=True)
        if self.batches.partial_mode:
            print(f"dask-rl: partial rollouts: {self.batches.partial_mode}", flush=True)

    @property
    def resources(self) -> ResourceConfig:
        """The placement now (it changes with update_resource and adaptive scaling)."""
        return self.fleet.config

    @property
    def version(self) -> int:
        return self.fleet.version

    @property
    def weights(self) -> weights.WeightHandle | None:
        return self.fleet.weights

    # -- the loop --------------------------------------------------------------------------
    def train(self, steps: int | None = None, on_step: Callable[[StepRecord], None] | None = None
              ) -> list[StepRecord]:
        """Run `steps` updates (default: up to train.steps in all, counting the steps before a
        resume) with a progress bar; returns the records.

        `on_step(record)` runs in the training thread after each step: a place to log, to
        checkpoint, or to call update_resource between two steps; request_stop() ends it.
        """
        done = len(self.history)
        if steps is not None:  # the run file's check of `steps`, naming this argument
            steps = make_train_config({"steps": steps}, source="train(steps=...)").steps
        total = steps or max(0, self.train_config.steps - self.first_step - done)
        bar = tqdm(range(total), desc=f"dask-rl {self.train_config.algorithm}", disable=not self.show_progress)
        if self.resources.adaptive and not self.fleet.adapting:  # the file's `adaptive:` section
            self.adapt()
        try:
            with self.fleet.training():
                for _ in bar:
                    record = self.step()
                    bar.set_postfix(record.summary())
                    if on_step is not None:
                        on_step(record)
                    if self.outputs.due(record.step + 1, stopping=self.stop_requested):
                        self.save_checkpoint()
                    if self.stop_requested:
                        break
            if self.evaluation is not None:  # the final weights when due, and every figure still out
                self._evaluate_last()
        finally:
            self.stop_adapting()
        return self.history[done:]

    def step(self) -> StepRecord:
        """One update. Each phase is timed; the dataflow is the sequence of calls below."""
        tc, timer, start = self.train_config, PhaseTimer(), time.perf_counter()
        # 0. Resource changes for the actor and critic happen here, between two updates
        #    (also those asked for from a shell with `dask-rl scale`).
        with timer("resize"):
            self.fleet.at_boundary()
        # 0b. Held-out evaluation of these weights when due: futures beside training, at a
        #     lower priority; figures of evaluations that have finished join this step's record.
        with timer("evaluate"):
            evaluated = self._evaluate()
        # 1. Take the oldest in-flight batch, then keep `max_staleness` newer ones generating
        #    with the current weights while this one is trained on (0 = strictly on-policy).
        with timer("wait_rollout"):
            batch = self.batches.next(self.version, self.weights)
            # DAPO's dynamic sampling: more prompts into this batch until enough groups differ.
            extra_draws = self.batches.fill_informative_groups(batch, self.weights) if tc.filter_groups else 0
            rollouts = self.fleet.wait("rollout", batch.rollouts, "generated rollouts")
        # 2. Rewards, reference log-probs and critic values were computed on the rollout
        #    workers' outputs as soon as each shard finished; the shards join, padded once.
        with timer("wait_scores"):
            scores = join_scores(self.fleet.wait("reward", batch.scores, "rewards"))
            rollout_data, per_token = join_shards(
                rollouts, ref_logprobs=self.fleet.wait("reference", batch.ref_logprobs, "reference logprobs"),
                values=self.fleet.wait("critic", batch.values, "critic values"))
            # Samples with a non-finite reward, logprob or value: dropped or refused (train.reward_errors).
            screen = self._screen()
            rollout_data, scores, per_token, dropped = screen_samples(rollout_data, scores, per_token, screen)
            if tc.partial_rollouts:   # a group this batch carries on is never trained now as well
                rollout_data, scores, per_token = take_trained(batch, rollout_data, scores, per_token)
            uninformative = 0
            if tc.filter_groups:  # the first prompts_per_step groups whose rewards differ
                rollout_data, scores, per_token, uninformative = keep_informative_groups(
                    rollout_data, scores, per_token, tc.prompts_per_step, screen.min_rows)
            rewards = reward_figures(scores.components)  # each reward's mean and std
        # 3. Advantages on the driver: small CPU tensors, pure math. Without a reference
        #    model (kl_coef 0) the behaviour logprobs stand in: the KL is exactly 0.
        with timer("advantages"):
            experience, stats = checked_experience(
                rollout_data, scores.values, per_token.get("ref_logprobs", rollout_data.behavior_logprobs),
                per_token.get("values"), screen, algorithm=tc.algorithm, kl_coef=tc.kl_coef, gamma=tc.gamma,
                lam=tc.lam, group_size=tc.samples_per_prompt, whiten=tc.whiten_advantages,
                advantage=tc.estimator, overlong_filter=tc.overlong_filter)
        # 4. Policy (and critic) update, one task per rank; the actor publishes new weights.
        with timer("update"):
            losses = self.update(experience)
        # Versions between each row's first token and the policy just trained on it.
        ages = (self.version - 1 - rollout_data.born).tolist() or [0]
        record = StepRecord(step=self.first_step + len(self.history), policy_version=self.version,
                            reward_mean=stats["reward_mean"], kl_mean=stats["kl_mean"], response_length=stats["response_length"],
                            tokens=stats["tokens"], rows=len(experience), seconds=time.perf_counter() - start,
                            staleness=sum(ages) / len(ages), staleness_max=max(ages),
                            carried_rows=len(self.batches.carried_out(batch)) if tc.partial_rollouts else 0,
                            losses=losses, phases=timer.seconds,
                            reward_std=stats["reward_std"], clipped_fraction=stats["clipped_fraction"],
                            dropped_samples=dropped + stats["dropped_samples"],
                            samples=self.outputs.samples(rollout_data, scores, self.prompts.row),
                            rewards=rewards, evaluation=evaluated, uninformative_groups=uninformative,
                            extra_draws=extra_draws)
        # 5. What the workers made smaller to fit GPU memory meanwhile (logged there too).
        degraded = self.fleet.degradations()
        record.degradations = [d.line() for d in degraded]
        record.oom_backoffs = sum(d.cause == OUT_OF_MEMORY for d in degraded)
        self.history.append(record)
        self.outputs.log(record)  # metrics.jsonl, samples.jsonl, TensorBoard: flushed now
        # The RL page's and /metrics' figures: one small message per step.
        events.publish_step(self.fleet.client, self.run_id, record.as_dict(), record.samples)
        return record

    def _evaluate(self) -> dict[str, float]:
        """Submit an evaluation when due; the figures of those finished since the last step."""
        if self.evaluation is None:
            return {}
        if self.evaluation.due(self.first_step + len(self.history), first=not self.history):
            self.evaluation.submit(self.first_step + len(self.history), self.version, self.weights)
        *earlier, last = self.evaluation.finished() or [{}]
        for figures in earlier:  # two finished within one step: the older on a line of its own
            self.outputs.log_evaluation(figures)
        return last

    def _evaluate_last(self) -> None:
        """After the last step: evaluate the final weights when an evaluation is due at this step
        count, and write the figures of every evaluation still running, each on its own line."""
        steps_done = self.first_step + len(self.history)
        if self.history and self.evaluation.due(steps_done, first=False):
            self.evaluation.submit(steps_done, self.version, self.weights)
        for figures in self.evaluation.finished(wait=True):
            self.outputs.log_evaluation(figures)

    def _screen(self) -> SampleScreen:
        """This step's rules for bad samples; every rank of the update needs a row of each mini-batch."""
        tc, ranks = self.train_config, max(len(self.fleet.addresses(r)) for r in self.roles if r in ("actor", "critic"))
        return SampleScreen(tc.reward_errors, tc.algorithm == "grpo", tc.mini_batches * ranks, self.tokenizer.decode)

    # -- placement: the fleet applies it ---------------------------------------------------
    def update_resource(self, component: str, device_ids: list[int] | None = None, strategy: str | None = None,
                        *, workers: int | None = None, device_type: str | None = None,
                        jobs: int | None = None) -> list[ResourceChange]:
        """Give `component` these devices (GPU roles), this many workers (CPU roles) or this
        many batch jobs (a role on a job queue: submitted, or drained then cancelled).

        Safe to call from another thread while train() runs. Rollout, reward and reference
        change at once; the actor and critic at the next step boundary (this call waits for
        it). A bad request raises before anything changes. Returns what changed per role.
        """
        return self.fleet.update_resource(ResourceRequest(component, device_ids, strategy, workers, device_type,
                                                          jobs))

    def adapt(self, bounds: dict[str, tuple[int, int]] | None = None, interval: float = 2.0, wait_count: int = 3,
              **policy: Any) -> RoleAdaptive:
        """Move devices/workers from idle roles to starved ones while training runs.

        `bounds`: role -> (min, max) workers; None: the resource file's `adaptive:` section
        (train() starts that by itself). Every `interval` seconds the roles' backlog and busy
        share are measured; once a role was starved and another idle `wait_count` times in a
        row, one device or CPU worker moves between them, logged with its reason and kept in
        `adaptive_decisions`. `policy`: window=, thresholds=, spare= (see RoleAdaptive).
        """
        return self.fleet.adapt(bounds, interval=interval, wait_count=wait_count, **policy)

    @property
    def adaptive_decisions(self) -> list:
        return self.fleet.adaptive_decisions

    def stop_adapting(self) -> None:
        """Stop adaptive scaling; a move in progress finishes first."""
        self.fleet.stop_adapting()

    # -- what the run keeps: pipeline/outputs.py ---------------------------------------------
    def request_stop(self) -> None:
        """Ask train() to end after the step in flight (safe from a signal handler or thread)."""
        self.stop_requested = True

    def save(self, path: str | None = None) -> dict[str, Path]:
        """The actor (and critic) in Hugging Face format with the tokenizer: <path>/actor, ..."""
        return self.outputs.save_models(self.fleet, path)

    def save_checkpoint(self) -> Path:
        """A checkpoint of everything resume needs, under <output_dir>/checkpoints."""
        return self.outputs.save_checkpoint(self.fleet, self.batches, self.first_step + len(self.history))

    def close(self) -> None:
        """Save the models under output_dir (if trained since), drop in-flight batches, close
        the fleet: adaptive scaling stops, snapshots are deleted, a cluster it started closes."""
        try:
            self.outputs.close(self.fleet)
        finally:
            if self.fleet.scheduler_lost() is None:  # a lost scheduler took the batches with it
                self.batches.cancel()
                if self.evaluation is not None:
                    self.evaluation.cancel()
            self.fleet.close()

    def __enter__(self) -> HybridTrainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
