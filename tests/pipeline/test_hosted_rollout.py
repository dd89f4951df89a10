"""A rollout hosted by the actor (`rollout: {hosted_by: actor}`) on real worker processes:
one process per actor device runs both roles, its engine reads the actor's own tensors, no
weights are published, and training is exactly what it is with rollout workers of their own."""

from __future__ import annotations

import pytest

from pipeline.rewards import digit_fraction
from pipeline.roles.host import role_state
from pipeline.trainer import HybridTrainer
from resources import load_resource_config
from tests.conftest import published_snapshots, role_cluster

# On-policy (each batch generates after the update before it), seeded, and the same engine
# on both sides, unfused (a hosted engine never fuses: the fused tensors would be copies).
RUN = dict(algorithm="grpo", prompts_per_step=4, samples_per_prompt=4, max_new_tokens=8, actor_lr=1e-3,
           kl_coef=0.0, max_staleness=0, seed=3, show_progress=False)
ENGINE = {"strategy": "cuda_graph", "cuda_graph_args": {"fuse_projections": False}}
HOSTED = {"actor": {"device_type": "cpu", "workers": 1}, "reward": {"device_type": "cpu", "workers": 1},
          "rollout": {"hosted_by": "actor", **ENGINE}, "timeout_seconds": 120}
APART = {**HOSTED, "rollout": {"device_type": "cpu", "workers": 1, **ENGINE}}


def _engine_reads_the_actors_tensors(dask_worker=None) -> dict:
    """On an actor worker: whether every parameter of the hosted engine's module is the
    actor's own tensor object, and which processes hold each role."""
    import os

    actor, rollout = role_state("actor", dask_worker), role_state("rollout", dask_worker)
    trained = dict(actor.trainer.model.named_parameters(remove_duplicate=False))
    engine_model = rollout._engine.model
    served = dict(engine_model.named_parameters(remove_duplicate=False))
    return {"same_objects": served.keys() == trained.keys() and all(served[n] is trained[n] for n in served),
            "engine_attention": engine_model.config._attn_implementation,
            "actor_attention": actor.trainer.model.config._attn_implementation,
            "pid": os.getpid(), "version": rollout.version}


def _worker_table(dask_scheduler=None) -> list[tuple[str, str]]:
    """The RL page's worker table: (role, name) of each row."""
    from pipeline.monitor import NAME

    return [(row["role"], row["name"]) for row in dask_scheduler.plugins[NAME].workers()]


def _run(layout, tiny_model, prompts, steps=3):
    config = load_resource_config(layout)
    with role_cluster(config) as cluster:
        trainer = HybridTrainer(tiny_model, digit_fraction, config, prompts=prompts, cluster=cluster, **RUN)
        records = trainer.train(steps)
        found = dict(workers={w["name"]: dict(w) for w in cluster.workers_of("rollout")},
                     handle=trainer.weights, snapshots=published_snapshots(trainer.fleet.snapshot_dir))
        if layout["rollout"].get("hosted_by"):
            found["engine"] = cluster.client.run(_engine_reads_the_actors_tensors,
                                                 workers=[w["address"] for w in cluster.workers_of("actor")])
            found["table"] = cluster.client.run_on_scheduler(_worker_table)
        trainer.close()
    return records, found


@pytest.fixture(scope="module")
def runs(tiny_model, prompts):
    return _run(HOSTED, tiny_model, prompts), _run(APART, tiny_model, prompts)


def test_a_hosted_rollout_trains_exactly_as_rollout_workers_of_their_own_do(runs):
    (hosted, _), (apart, found_apart) = runs
    assert [r.policy_version for r in hosted] == [1, 2, 3] and [r.staleness for r in hosted] == [0.0, 0.0, 0.0]
    # The same samples (rewards, tokens) and the same updates (losses, gradient norms), step by step.
    for mine, theirs in zip(hosted, apart, strict=True):
        assert (mine.reward_mean, mine.tokens) == (theirs.reward_mean, theirs.tokens)
        for key in ("policy_loss", "grad_norm", "entropy"):
            assert mine.losses[key] == pytest.approx(theirs.losses[key], rel=1e-5, abs=1e-7), key
    assert found_apart["snapshots"] and found_apart["handle"].transport == "shm"   # apart: weights are sent


def test_a_hosted_rollout_reads_the_actors_tensors_in_its_process_and_nothing_is_published(runs):
    (_, found), _ = runs
    [(name, worker)] = found["workers"].items()
    assert name == "actor-0" and worker  # the only worker carrying the rollout is the actor's
    [engine] = found["engine"].values()
    assert engine["same_objects"] and engine["version"] == 2   # the third batch generated after update 2
    # The engine's module switched to the slot attention; the trained one kept its own.
    assert engine["engine_attention"] != engine["actor_attention"]
    assert found["handle"].transport == "in_process" and found["handle"].nbytes == 0
    assert found["snapshots"] == []
    # The RL page's worker table shows the one process with both roles, first among the roles.
    assert found["table"][0] == ("actor+rollout", "actor-0")
    assert [role for role, _ in found["table"]].count("rollout") == 0


def test_the_twin_shares_every_tensor_and_leaves_the_trained_module_alone(tiny_model):
    import torch

    from pipeline.models import load_causal_lm, sharing_twin
    from pipeline.roles.training import enable_checkpointing

    model = load_causal_lm(tiny_model)
    enable_checkpointing(model)
    twin = sharing_twin(model)
    ids = torch.tensor([[5, 9, 2, 7, 1]])
    assert all(a is b for a, b in zip(twin.parameters(), model.parameters()))
    if model.config.tie_word_embeddings:
        assert twin.get_output_embeddings().weight is twin.get_input_embeddings().weight
    with torch.no_grad():
        before = model.eval()(ids).logits
        assert torch.equal(twin.eval()(ids).logits, before)
        model.get_input_embeddings().weight.mul_(1.5)   # an optimizer step writes in place
        assert torch.equal(twin(ids).logits, model(ids).logits) and not torch.equal(twin(ids).logits, before)
    twin.set_attn_implementation("eager")
    assert model.config._attn_implementation != "eager" and model.model.layers[0].gradient_checkpointing
    assert not twin.model.layers[0].gradient_checkpointing


@pytest.mark.slow
def test_growing_the_actor_grows_the_hosted_rollout_and_rebinds_its_engine(tiny_model, prompts):
    """A second actor worker joins mid-run: it hosts the rollout too, the first worker's actor
    rebuilds its model from the exported state, and each engine then reads its own process's
    new tensors; training goes on through the change."""
    config = load_resource_config(HOSTED)
    with role_cluster(config) as cluster:
        trainer = HybridTrainer(tiny_model, digit_fraction, config, prompts=prompts, cluster=cluster, **RUN)
        trainer.train(2)
        trainer.update_resource("actor", workers=2, strategy="ddp")
        records = trainer.train(2)
        actors = [w["address"] for w in cluster.workers_of("actor")]
        hosting = {w["address"] for w in cluster.workers_of("rollout")}
        engines = cluster.client.run(_engine_reads_the_actors_tensors, workers=actors)
        trainer.close()
    assert [r.policy_version for r in records] == [3, 4] and len(actors) == 2 and hosting == set(actors)
    assert trainer.resources.role("rollout").workers == 2
    # Every engine that served a batch reads its own process's current tensors.
    served = [e for e in engines.values() if e["version"] > 0]
    assert served and all(e["same_objects"] for e in served) and len({e["pid"] for e in engines.values()}) == 2


@pytest.mark.slow
def test_a_resumed_hosted_run_repeats_the_uninterrupted_run_step_for_step(tiny_model, prompts, tmp_path):
    """The resumed actor loads the checkpoint into a model the engine has not seen: the
    engine rebinds to it, and the run goes on exactly as the uninterrupted one."""
    config = load_resource_config(HOSTED)
    with role_cluster(config) as cluster:
        def trainer(out, **more):
            return HybridTrainer(tiny_model, digit_fraction, config, prompts=prompts, cluster=cluster,
                                 output_dir=str(tmp_path / out), **RUN, **more)

        with trainer("straight", steps=4) as run:
            straight = run.train()
        with trainer("cut", steps=2, checkpoint={"every_n_steps": 2}) as run:
            first = run.train()
        with trainer("cut", steps=4, resume=True) as run:
            assert run.version == 2
            rest = run.train()
            [engine] = cluster.client.run(_engine_reads_the_actors_tensors,
                                          workers=[w["address"] for w in cluster.workers_of("actor")]).values()
    assert [r.step for r in rest] == [2, 3]
    for mine, theirs in zip(first + rest, straight, strict=True):
        assert (mine.reward_mean, mine.tokens) == (theirs.reward_mean, theirs.tokens)
        assert mine.losses["policy_loss"] == pytest.approx(theirs.losses["policy_loss"], rel=1e-6, abs=1e-9)
    assert engine["same_objects"] and engine["version"] == 3


def test_runs_a_hosted_rollout_cannot_serve_are_refused_before_any_model_loads(tiny_model, prompts, shared_cluster):
    config = load_resource_config(HOSTED)
    common = dict(prompts=prompts, show_progress=False, algorithm="grpo", samples_per_prompt=2, kl_coef=0.0)
    with pytest.raises(ValueError, match=r"train.weight_sync: shm: the rollout is hosted by the actor.*Fix: remove"):
        HybridTrainer(tiny_model, digit_fraction, config, weight_sync="shm", **common)
    with pytest.raises(ValueError, match=r"rollout.hosted_by: actor: a run that joins a scheduler.*Fix: give the "
                                         r"rollout workers of its own"):
        HybridTrainer(tiny_model, digit_fraction, config, scheduler_address="tcp://127.0.0.1:1", **common)
    # The shared cluster's rollout workers are processes of their own: not this placement.
    with pytest.raises(ValueError, match=r"the cluster given has rollout workers of their own \(rollout-0, "
                                         r"rollout-1\)"):
        HybridTrainer(tiny_model, digit_fraction, config, cluster=shared_cluster, **common)


@pytest.mark.slow
def test_partial_rollouts_carry_rows_in_the_actors_process(tiny_model, prompts):
    """Partial rollouts hosted by the actor: no batch generates ahead (one process), rows
    left unfinished continue in the next step within max_staleness."""
    config = load_resource_config(HOSTED)
    partial = {**RUN, "max_staleness": 2, "partial_rollouts": True, "stop": ["a", "e", "1", "3"], "max_new_tokens": 24}
    with role_cluster(config) as cluster:
        with HybridTrainer(tiny_model, digit_fraction, config, prompts=prompts, cluster=cluster, **partial) as trainer:
            assert trainer.batches.ahead == 0 and "runs in the actor's processes" in trainer.batches.partial_mode
            records = trainer.train(5)
    assert any(r.carried_rows for r in records) and max(r.staleness_max for r in records) <= 2
    assert any(r.staleness > 0 for r in records)   # carried rows were trained a version later


@pytest.mark.slow
def test_a_hosted_rollout_one_version_behind_stays_within_the_bound(tiny_model, prompts):
    """max_staleness 1: each batch is submitted before the update it overlaps apart, and in
    one process may run before or after it. Either way a row is at most one version old and
    the record names the version the engine sampled from (never an older one)."""
    config = load_resource_config(HOSTED)
    with role_cluster(config) as cluster:
        with HybridTrainer(tiny_model, digit_fraction, config, prompts=prompts, cluster=cluster,
                           **{**RUN, "max_staleness": 1}) as trainer:
            records = trainer.train(4)
            [engine] = cluster.client.run(_engine_reads_the_actors_tensors,
                                          workers=[w["address"] for w in cluster.workers_of("actor")]).values()
    assert [r.policy_version for r in records] == [1, 2, 3, 4]
    assert all(0 <= r.staleness_max <= 1 for r in records) and engine["same_objects"]
    assert engine["version"] >= 3   # the last batch sampled after update 3 at the earliest
