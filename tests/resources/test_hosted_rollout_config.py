"""`rollout: {hosted_by: actor}`: the file's checks, the plan (the actor's workers carry the
rollout resource, the rollout has none of its own) and the changes a run refuses; and a
role's `max_gpu_memory_gib`, which caps the process a hosted rollout shares."""

import pytest

from pipeline.fleet.reconcile import ResourceRequest, requested_config
from resources.config import ResourceConfigError
from resources.devices import GpuInfo
from resources.plan import plan_change, plan_workers
from resources.validate import parse_resource_config, with_changes

GPUS = [GpuInfo(i, "H200", 100 * 2**30, 100 * 2**30, 0, 0, 0) for i in range(4)]
HOSTED = {"actor": {"device_type": "cuda", "device_ids": [0, 1], "strategy": "ddp"},
          "reward": {"device_type": "cpu"}, "rollout": {"hosted_by": "actor"}}


def parse(data):
    return parse_resource_config(data, gpus=GPUS)


def test_a_hosted_rollout_takes_the_actors_devices_and_its_workers_carry_it():
    config = parse(HOSTED)
    rollout = config.role("rollout")
    assert (rollout.hosted_by, rollout.device_type, rollout.device_ids, rollout.workers) == ("actor", "cuda", (0, 1), 2)
    assert rollout.strategy == "cuda_graph" and rollout.moves_with == "actor"
    assert config.hosted_roles("actor") == ("rollout",) and config.hosted_roles("rollout") == ()
    workers = plan_workers(config)
    assert [(w.name, w.resources, w.device_id) for w in workers if w.role in ("actor", "rollout")] == [
        ("actor-0", {"actor": 1, "rollout": 1}, 0), ("actor-1", {"actor": 1, "rollout": 1}, 1)]
    # Defaulted critic/reference still get workers of their own on the actor's GPUs.
    assert {w.role for w in workers} == {"actor", "critic", "reference", "reward"}
    # One process: generation and updates take turns, MPS or not.
    assert parse({**HOSTED, "gpu_sharing": "time_slice"}).take_turns("rollout", "actor")


def test_a_gpu_process_hosting_the_rollout_gets_expandable_segments_unless_the_user_chose(monkeypatch):
    """No weights leave a hosting process by CUDA IPC, so its allocator maps memory into
    growing segments; separate rollout and actor processes (IPC between them) keep torch's
    default, and a PYTORCH_CUDA_ALLOC_CONF the user exported is inherited as it is."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    conf = {w.name: w.env_dict.get("PYTORCH_CUDA_ALLOC_CONF") for w in plan_workers(parse(HOSTED))}
    assert conf == {"actor-0": "expandable_segments:True", "actor-1": "expandable_segments:True",
                    "critic-0": None, "critic-1": None, "reference-0": None, "reference-1": None, "reward-0": None}
    apart = {**HOSTED, "rollout": {"device_type": "cuda", "device_ids": [2], "strategy": "cuda_graph"}}
    assert all("PYTORCH_CUDA_ALLOC_CONF" not in w.env_dict for w in plan_workers(parse(apart)))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert all("PYTORCH_CUDA_ALLOC_CONF" not in w.env_dict for w in plan_workers(parse(HOSTED)))


def test_a_hosted_rollout_on_cpu_defaults_to_generate_and_round_trips_through_the_file():
    config = parse({"actor": {"device_type": "cpu"}, "reward": {"device_type": "cpu"},
                    "rollout": {"hosted_by": "actor"}})
    assert config.role("rollout").strategy == "hf" and config.role("rollout").workers == 1
    assert config.to_dict()["rollout"] == {"hosted_by": "actor", "strategy": "hf"}
    assert parse(config.to_dict()) == config
    # A change of the actor's devices carries the rollout with it.
    moved = with_changes(parse(HOSTED), {"actor": {"device_type": "cuda", "device_ids": [2, 3]}}, source="test",
                         gpus=GPUS)
    assert moved.role("rollout").device_ids == (2, 3) and moved.role("rollout").hosted_by == "actor"


@pytest.mark.parametrize("rollout, key, words", [
    ({"hosted_by": "reward"}, "rollout.hosted_by", "only by the actor"),
    ({"hosted_by": "actor", "device_ids": [2]}, "rollout.device_ids", "runs on the actor's workers"),
    ({"hosted_by": "actor", "workers": 2}, "rollout.workers", "remove workers"),
    ({"hosted_by": "actor", "strategy": "vllm"}, "rollout.strategy", "only cuda_graph and hf can"),
    ({"hosted_by": "actor", "cuda_graph_args": {"fuse_projections": True}},
     "rollout.cuda_graph_args.fuse_projections", "never reach"),
    ({"hosted_by": "actor", "max_batch": 3}, "rollout.max_batch", "unknown key"),
])
def test_bad_hosted_rollouts_are_refused_naming_the_key_and_the_fix(rollout, key, words):
    with pytest.raises(ResourceConfigError, match="Fix: ") as caught:
        parse({**HOSTED, "rollout": rollout})
    assert caught.value.path == key and words in str(caught.value)


def test_a_hosted_rollout_needs_an_actor_whose_weights_are_whole():
    with pytest.raises(ResourceConfigError, match="fsdp shards the weights") as caught:
        parse({**HOSTED, "actor": {"device_type": "cuda", "device_ids": [0, 1], "strategy": "fsdp"}})
    assert caught.value.path == "rollout.hosted_by" and "strategy: ddp" in caught.value.fix


def test_a_hosted_rollout_is_not_scaled_on_its_own():
    with pytest.raises(ResourceConfigError, match="grows and shrinks with them") as caught:
        parse({**HOSTED, "adaptive": {"rollout": {"min": 1, "max": 2}}})
    assert caught.value.path == "adaptive.rollout"
    config = parse({"actor": {"device_type": "cpu"}, "reward": {"device_type": "cpu"},
                    "rollout": {"hosted_by": "actor"}})
    with pytest.raises(ValueError, match=r"rollout runs in the actor's workers .*Fix: change the actor's devices"):
        requested_config(config, ResourceRequest("rollout", workers=2))
    # Growing the actor plans a new worker that hosts the rollout too; the rollout plans none.
    grown = requested_config(config, ResourceRequest("actor", workers=2, strategy="ddp"))
    current = [w for w in plan_workers(config) if w.role == "actor"]
    start, retire = plan_change(current, grown.role("actor"), 1, hosts=grown.hosted_roles("actor"))
    assert [(w.name, w.resources) for w in start] == [("actor-1", {"actor": 1, "rollout": 1})]
    assert retire == [] and plan_change(current, grown.role("rollout"), 0) == ([], [])
    assert grown.role("rollout").workers == 2


def test_a_gpu_memory_cap_is_read_checked_and_written_back():
    config = parse({**HOSTED, "actor": {**HOSTED["actor"], "max_gpu_memory_gib": 9}})
    assert config.role("actor").max_gpu_memory_gib == 9.0 and config.role("reward").max_gpu_memory_gib is None
    assert config.to_dict()["actor"]["max_gpu_memory_gib"] == 9.0 and parse(config.to_dict()) == config


@pytest.mark.parametrize("data, key, words", [
    ({"actor": {"device_type": "cuda", "device_ids": [0], "max_gpu_memory_gib": 0}}, "actor.max_gpu_memory_gib",
     "expected a number of GiB > 0"),
    ({"actor": {"device_type": "cuda", "device_ids": [0], "max_gpu_memory_gib": True}}, "actor.max_gpu_memory_gib",
     "expected a number of GiB"),
    ({"actor": {"device_type": "cuda", "device_ids": [0], "max_gpu_memory_gib": float("inf")}},
     "actor.max_gpu_memory_gib", "expected a number of GiB"),
    ({"actor": {"device_type": "cuda", "device_ids": [0], "max_gpu_memory_gib": 101}}, "actor.max_gpu_memory_gib",
     "GPU 0 has 100.0 GiB"),
    ({"reward": {"device_type": "cpu", "max_gpu_memory_gib": 4}}, "reward.max_gpu_memory_gib", "CPU workers"),
    ({"rollout": {"hosted_by": "actor", "max_gpu_memory_gib": 4}}, "rollout.max_gpu_memory_gib",
     "set actor.max_gpu_memory_gib for both"),
])
def test_bad_gpu_memory_caps_are_refused_naming_the_key_and_the_fix(data, key, words):
    with pytest.raises(ResourceConfigError, match="Fix: ") as caught:
        parse({**HOSTED, **data})
    assert caught.value.path == key and words in str(caught.value)


def test_the_role_host_carries_the_cap_to_the_worker():
    import pickle

    from pipeline.roles.host import RoleHost

    arrived = pickle.loads(pickle.dumps(RoleHost("actor", dict, gpu_memory_gib=9.0)))
    assert arrived.gpu_memory_gib == 9.0 and arrived._build(None) == {}   # no GPU here: nothing capped


def test_the_engine_s_decode_slots_are_a_setting_of_its_own():
    config = parse({**HOSTED, "rollout": {"hosted_by": "actor", "cuda_graph_args": {"max_batch_size": 64}}})
    assert config.role("rollout").engine_kwargs == {"max_batch_size": 64}
    assert parse(config.to_dict()) == config
    for bad in (0, 5000, 12.5, True):
        with pytest.raises(ResourceConfigError, match="decode slots from 1 to 4096") as caught:
            parse({**HOSTED, "rollout": {"hosted_by": "actor", "cuda_graph_args": {"max_batch_size": bad}}})
        assert caught.value.path == "rollout.cuda_graph_args.max_batch_size" and "128" in caught.value.fix
    with pytest.raises(ResourceConfigError, match="did you mean 'max_batch_size'"):
        parse({**HOSTED, "rollout": {"hosted_by": "actor", "cuda_graph_args": {"max_batch_sise": 64}}})
