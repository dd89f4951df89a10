"""The training loop on real worker processes (the shared CPU cluster from conftest)."""

from __future__ import annotations

import time

import pytest
import torch
from distributed.diagnostics.plugin import SchedulerPlugin

from pipeline.records import GenerationRequest
from pipeline.rewards import digit_fraction
from pipeline.roles import rollout
from pipeline.roles.host import load_times, worker_identity
from pipeline.fleet.tasks import submit
from pipeline.trainer import HybridTrainer

SMALL = dict(prompts_per_step=8, max_new_tokens=8, actor_lr=1e-3, critic_lr=1e-3, micro_batch_size=8,
             show_progress=False)


class RestrictionLog(SchedulerPlugin):
    """Records, on the scheduler, the resource restriction of every task as it starts."""

    name = "restriction-log"

    async def start(self, scheduler):
        self.scheduler, self.seen = scheduler, {}

    def transition(self, key, start, finish, *args, **kwargs):
        if finish == "processing":
            self.seen[str(key)] = dict(self.scheduler.tasks[key].resource_restrictions or {})


def _logged_restrictions(dask_scheduler):
    return dask_scheduler.plugins[RestrictionLog.name].seen


def test_ppo_steps_tag_every_task_with_its_role_and_advance_the_version(shared_cluster, shared_config,
                                                                        tiny_model, prompts):
    shared_cluster.client.register_plugin(RestrictionLog())
    trainer = HybridTrainer(tiny_model, digit_fraction, shared_config, algorithm="ppo", prompts=prompts,
                            cluster=shared_cluster, steps=2, **SMALL)
    records = trainer.train()
    assert [r.policy_version for r in records] == [1, 2]
    assert [r.rows for r in records] == [8, 8]   # prompts_per_step 8, one sample each
    assert all(r.tokens > 0 and 0.0 <= r.reward_mean <= 1.0 for r in records)
    assert all(r.response_length == pytest.approx(r.tokens / r.rows) for r in records)
    assert {"policy_loss", "value_loss", "grad_norm", "critic_grad_norm", "clip_frac"} <= set(records[-1].losses)
    # Every task that ran carries exactly its role's resource, and its key names the role.
    restrictions = shared_cluster.client.run_on_scheduler(_logged_restrictions)
    role_keys = {k: r for k, r in restrictions.items() if k.split("-")[0] in shared_config.roles}
    assert {k.split("-")[0] for k in role_keys} >= {"rollout", "reward", "reference", "critic", "actor"}
    for key, resources in role_keys.items():
        assert resources == {key.split("-")[0]: 1}, key
    # On-policy: each batch was generated with the weights of the update before it, and both
    # rollout workers generated the second batch with version 1 (they load a version lazily,
    # before their next generation).
    assert [r.staleness for r in records] == [0.0, 0.0]
    versions = [submit(shared_cluster.client, "rollout", rollout.policy_version, workers=[w["address"]]).result()
                for w in shared_cluster.workers_of("rollout")]
    assert versions == [1, 1]


def test_role_tasks_run_only_on_workers_carrying_the_role(shared_cluster):
    for role in ("rollout", "reward", "reference", "critic", "actor"):
        futures = [submit(shared_cluster.client, role, worker_identity, tag=str(i)) for i in range(4)]
        for identity in shared_cluster.client.gather(futures):
            assert identity["resources"] == {role: 1}
            assert identity["name"].startswith(f"{role}-")
            assert identity["cuda_visible_devices"] == ""  # CPU roles see no GPU


def test_generation_changes_after_updates(shared_cluster, shared_config, tiny_model, prompts):
    trainer = HybridTrainer(tiny_model, digit_fraction, shared_config, algorithm="grpo", prompts=prompts,
                            cluster=shared_cluster, steps=3, samples_per_prompt=4, **SMALL)
    request = GenerationRequest(prompt_ids=[trainer.prompts.token_ids[0]] * 4, group_ids=[0, 1, 2, 3],
                                samples_per_prompt=4, max_new_tokens=8, temperature=1.0, seed=123)
    client = shared_cluster.client
    before = submit(client, "rollout", rollout.generate, request, None).result()
    trainer.train()
    after = submit(client, "rollout", rollout.generate, request, trainer.weights).result()
    assert before.policy_version == 0 and after.policy_version == 3
    # Same prompts, same sampling seed: different weights give different samples...
    assert not torch.equal(before.responses, after.responses)
    # ...and the probability of the digits the reward asks for went up.
    digits = torch.tensor(trainer.tokenizer.convert_tokens_to_ids(list("0123456789")))
    share = lambda r: torch.isin(r.responses, digits)[r.response_mask.bool()].float().mean()  # noqa: E731
    assert share(after) > share(before)


@pytest.mark.parametrize("mode", ["broadcast", "dask"])
def test_weights_reach_rollout_workers_by_broadcast_and_by_the_dask_fallback(mode, shared_cluster, shared_config,
                                                                             tiny_model, prompts):
    shared_cluster.client.register_plugin(RestrictionLog())
    trainer = HybridTrainer(tiny_model, digit_fraction, shared_config, algorithm="grpo", prompts=prompts,
                            cluster=shared_cluster, steps=2, samples_per_prompt=2, weight_sync=mode, **SMALL)
    records = trainer.train()
    assert [r.staleness for r in records] == [0.0, 0.0]
    client = shared_cluster.client
    held = [submit(client, "rollout", rollout.policy_version, workers=[w["address"]]).result()
            for w in shared_cluster.workers_of("rollout")]
    # A broadcast loads every rollout worker right after each update; the fallback loads
    # lazily, at the next generation (the second batch was generated with version 1).
    assert held == ([2, 2] if mode == "broadcast" else [1, 1])
    # The path really taken, from the scheduler's record of the tasks that ran.
    keys = list(client.run_on_scheduler(_logged_restrictions))
    started = lambda prefix: any(k.startswith(prefix) for k in keys)  # noqa: E731
    if mode == "broadcast":
        assert started("actor-send-weights-v1") and started("rollout-receive-weights-v1-r2")
    else:
        assert started("actor-fetch-snapshot-v1")


def test_a_built_transformers_model_object_is_accepted_as_the_policy(shared_cluster, shared_config, tiny_model,
                                                                     prompts, tmp_path):
    from pipeline.models import load_causal_lm, load_tokenizer

    model, tokenizer = load_causal_lm(tiny_model), load_tokenizer(tiny_model)
    trainer = HybridTrainer(model, digit_fraction, shared_config, algorithm="grpo", prompts=prompts,
                            tokenizer=tokenizer, output_dir=str(tmp_path), cluster=shared_cluster, steps=1,
                            samples_per_prompt=2, **SMALL)
    # The object was saved once for the workers to load; it did not travel through Dask.
    assert (tmp_path / "actor-init" / "config.json").exists()
    (record,) = trainer.train()
    assert record.policy_version == 1 and record.tokens > 0


def test_grpo_without_kl_runs_no_reference_and_samples_with_the_cuda_graph_engine(shared_cluster, shared_config,
                                                                                  tiny_model, prompts):
    """kl_coef 0: no reference model is loaded and no reference task runs; the rollout role's
    cuda_graph strategy (its loop runs eagerly on CPU workers) drives a real GRPO run, with
    the options its `cuda_graph_args` give."""
    from dataclasses import replace

    from resources.validate import with_role

    shared_cluster.client.register_plugin(RestrictionLog())
    config = with_role(shared_config, replace(shared_config.role("rollout"), strategy="cuda_graph",
                                              cuda_graph_args=(("decode_attention", "sdpa"),)))
    trainer = HybridTrainer(tiny_model, digit_fraction, config, algorithm="grpo", prompts=prompts,
                            cluster=shared_cluster, steps=2, samples_per_prompt=2, kl_coef=0.0, **SMALL)
    assert "reference" not in trainer.roles
    records = trainer.train()
    assert [r.policy_version for r in records] == [1, 2]
    assert all(r.kl_mean == 0.0 and r.tokens > 0 for r in records)
    roles_run = {k.split("-")[0] for k in shared_cluster.client.run_on_scheduler(_logged_restrictions)}
    assert "reference" not in roles_run and {"rollout", "reward", "actor"} <= roles_run
    engines = shared_cluster.client.run(_engine_name, workers=[w["address"] for w in shared_cluster.workers_of("rollout")])
    assert set(engines.values()) == {"CudaGraphEngine"}
    # SDPA as the file says; the projections fused, the default it leaves as it is.
    options = shared_cluster.client.run(_engine_options, workers=list(engines))
    assert set(options.values()) == {(False, True)}
    # Each worker says how long building its role took (the GPU benchmark prints it).
    built = {role: times for roles in shared_cluster.client.run(load_times).values() for role, times in roles.items()}
    assert {"rollout", "reward", "actor"} <= set(built)
    assert all(0 < seconds < 600 and started < time.time() and 0 <= waited <= seconds
               for started, seconds, waited in built.values())
    # Every worker imported torch and transformers in the background from its start.
    assert set(shared_cluster.client.run(_background_imports).values()) == {True}
    # Each role worker froze what its build (and the rollout's first decode shapes) left
    # alive: later full garbage collections walk far fewer objects than it holds.
    built_on = [w["address"] for role in ("rollout", "reward", "actor") for w in shared_cluster.workers_of(role)]
    for address, (frozen, tracked) in shared_cluster.client.run(_heap_counts, workers=built_on).items():
        print(f"{address}: {frozen} objects frozen, {tracked} tracked by the collector")
        assert frozen > 10_000 and tracked < frozen


def test_settling_the_heap_again_frees_a_frozen_cycle_dropped_since():
    """host.settle_heap freezes what is alive; a cycle frozen there and dropped later (a
    replaced compiled model is one) survives plain collections, and the next settle frees it."""
    import gc
    import weakref

    from pipeline.roles.host import settle_heap

    class Node:
        pass

    node = Node()
    node.itself = node   # a reference cycle: only the garbage collector frees it
    alive = weakref.ref(node)
    try:
        settle_heap()
        del node
        gc.collect()
        assert alive() is not None, "frozen: out of reach of collections"
        settle_heap()
        assert alive() is None
    finally:
        gc.unfreeze()


def test_settling_without_thawing_freezes_only_what_is_new():
    """settle_heap(thaw=False), after a new compiled graph: new garbage is collected and the
    new survivors frozen, and the heap frozen before is neither walked nor freed (a cycle
    frozen there and dropped since stays until a thawing settle)."""
    import gc
    import weakref

    from pipeline.roles.host import settle_heap

    class Node:
        pass

    old = Node()
    old.itself = old     # reference cycles: only the garbage collector frees them
    alive_old = weakref.ref(old)
    try:
        settle_heap()
        del old
        new, garbage = Node(), Node()
        new.itself, garbage.itself = new, garbage
        alive_garbage = weakref.ref(garbage)
        del garbage
        settle_heap(thaw=False)
        assert alive_garbage() is None                   # new garbage: collected
        assert alive_old() is not None                   # frozen before: left alone
        # The new survivors: frozen (out of the collected generations). Not read from the
        # freeze count: other threads of this process (earlier tests' clients) free frozen
        # objects by reference counting meanwhile, so the count can fall.
        assert not any(obj is new for obj in gc.get_objects())
        settle_heap()
        assert alive_old() is None
    finally:
        gc.unfreeze()


def _heap_counts(dask_worker=None) -> tuple[int, int]:
    import gc

    return gc.get_freeze_count(), len(gc.get_objects())


def _background_imports(dask_worker=None):
    import sys

    from pipeline.roles.host import WORKER_IMPORTS

    plugin = dask_worker.plugins["dask-rl-imports"]
    return plugin.done.is_set() and all(module in sys.modules for module in WORKER_IMPORTS)


def _engine_name(dask_worker=None):
    return type(dask_worker.plugins["dask-rl-rollout"].state.engine).__name__


def _engine_options(dask_worker=None):
    from pipeline.engines.fused_projections import FusedMember

    engine = dask_worker.plugins["dask-rl-rollout"].state.engine
    return engine.attention_kernel, any(isinstance(m, FusedMember) for m in engine.model.modules())
