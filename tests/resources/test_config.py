"""The resource file contract: the four-GPU example file loads as written; every bad file gets one
error naming the file, the key path, the value and the fix."""

import copy
import os
import pickle

import pytest
import yaml

from resources import devices
from resources.config import ROLES, AdaptiveBounds, ResourceConfigError, RoleSpec
from resources.validate import load_resource_config, parse_resource_config, with_role
from resources.devices import GpuInfo, GpuProcess

DESIGN_FILE = """\
actor:   {device_type: cuda, device_ids: [0, 1], strategy: fsdp}
reward:  {device_type: cuda, device_ids: [2], strategy: none}
rollout:
  device_type: cuda
  device_ids: [3]
  strategy: vllm
  vllm_args: {tensor_parallel_size: 1, gpu_memory_utilization: 0.85, enforce_eager: false}
comm_backend: nccl
timeout_seconds: 180
"""
DESIGN = yaml.safe_load(DESIGN_FILE)
GiB = 1 << 30


def idle(index: int) -> GpuInfo:
    return GpuInfo(index, "H200", 140 * GiB, 140 * GiB, 0, 0, 0)


GPUS = [idle(i) for i in range(5)]
CPU_FILE = """\
actor:   {device_type: cpu, device_ids: [], workers: 2, strategy: ddp}
reward:  {device_type: cpu}
rollout: {device_type: cpu, workers: 3}
timeout_seconds: 30.5
"""


def write(tmp_path, text: str):
    path = tmp_path / "resource_config.yaml"
    path.write_text(text)
    return path


def test_design_file_loads_exactly_as_written(tmp_path):
    config = load_resource_config(write(tmp_path, DESIGN_FILE), gpus=GPUS)
    assert list(config.roles) == list(ROLES)
    assert config.role("actor") == RoleSpec("actor", "cuda", (0, 1), 2, "fsdp")
    assert config.role("reward") == RoleSpec("reward", "cuda", (2,), 1, "none")
    rollout = config.role("rollout")
    assert (rollout.device_ids, rollout.workers, rollout.strategy) == ((3,), 1, "vllm")
    assert rollout.vllm_kwargs == {"tensor_parallel_size": 1, "gpu_memory_utilization": 0.85,
                                   "enforce_eager": False}
    assert config.comm_backend == config.resolved_comm_backend == "nccl"
    assert config.timeout_seconds == 180.0
    assert not config.allow_shared_devices and not config.allow_busy_devices
    assert config.uses_cuda and config.gpu_ids == (0, 1, 2, 3)
    assert config.adaptive == {}


def test_critic_and_reference_default_to_the_actor(tmp_path):
    config = load_resource_config(write(tmp_path, DESIGN_FILE), gpus=GPUS)
    assert config.role("critic") == RoleSpec("critic", "cuda", (0, 1), 2, "fsdp",
                                             placed_with="actor")
    # Two reference workers split the batch; "none" would mean one idle replica.
    assert config.role("reference") == RoleSpec("reference", "cuda", (0, 1), 2, "data_parallel",
                                                placed_with="actor")


def test_single_gpu_actor_defaults():
    data = {"actor": {"device_type": "cuda", "device_ids": [0]},
            "reward": {"device_type": "cpu"}, "rollout": {"device_type": "cpu"}}
    config = parse_resource_config(data, gpus=GPUS)
    assert config.role("actor").strategy == "none"
    assert config.role("critic").strategy == "none"
    assert config.role("reference").strategy == "none"
    assert config.role("rollout").strategy == "hf"
    assert config.comm_backend == "auto" and config.resolved_comm_backend == "nccl"


def test_cpu_file_needs_no_nvml(tmp_path, monkeypatch):
    def no_probe():
        raise AssertionError("a CPU-only file must not probe NVML")

    monkeypatch.setattr(devices, "get_gpu_usage", no_probe)
    config = load_resource_config(str(write(tmp_path, CPU_FILE)))
    assert not config.uses_cuda and config.gpu_ids == ()
    assert config.role("actor") == RoleSpec("actor", "cpu", (), 2, "ddp")
    assert config.role("reward") == RoleSpec("reward", "cpu", (), 1, "none")
    assert config.role("rollout") == RoleSpec("rollout", "cpu", (), 3, "hf")
    assert config.role("critic").workers == 2 and config.role("critic").placed_with == "actor"
    assert config.resolved_comm_backend == "gloo"
    assert config.timeout_seconds == 30.5


def test_optional_sections(tmp_path):
    text = DESIGN_FILE + """\
critic: {device_type: cuda, device_ids: [4], strategy: none}
allow_busy_devices: true
adaptive: {rollout: {min: 1, max: 3}}
train: {anything: [goes, here], it: belongs to the pipeline}
"""
    busy = [idle(i) for i in range(4)] + [GpuInfo(4, "H200", 100, 10, 90, 99, 1)]
    config = load_resource_config(write(tmp_path, text), gpus=busy)
    assert config.role("critic") == RoleSpec("critic", "cuda", (4,), 1, "none")
    assert config.role("reference").device_ids == (0, 1)
    assert config.allow_busy_devices
    assert config.adaptive == {"rollout": AdaptiveBounds(1, 3)}


def test_one_gpu_machine_can_share_on_purpose():
    one = {"device_type": "cuda", "device_ids": [0]}
    data = {"actor": one, "reward": one, "rollout": one, "allow_shared_devices": True}
    config = parse_resource_config(data, gpus=[idle(0)])
    assert {spec.device_ids for spec in config.roles.values()} == {(0,)}


def test_mapping_source_and_pickle():
    config = load_resource_config(DESIGN, gpus=GPUS)
    assert config.source == "<dict>"
    assert pickle.loads(pickle.dumps(config)) == config  # configs travel to Dask workers
    with pytest.raises(TypeError):
        config.roles["actor"] = config.role("reward")  # read-only
    with pytest.raises(KeyError, match="did you mean 'rollout'"):
        config.role("rolout")


def test_cuda_graph_args_reach_the_engine_and_survive_changes_to_other_roles():
    config = load_resource_config(cuda_graph_rollout({"decode_attention": "sdpa", "fuse_projections": False,
                                                      "compile_prefill": True}),
                                  gpus=GPUS)
    assert config.role("rollout").engine_kwargs == {"decode_attention": "sdpa", "fuse_projections": False,
                                                    "compile_prefill": True}
    assert load_resource_config(DESIGN, gpus=GPUS).role("rollout").engine_kwargs == DESIGN["rollout"]["vllm_args"]
    wider = with_role(config, RoleSpec("reward", "cuda", (2, 4), 2, "data_parallel"), gpus=GPUS)
    assert wider.role("rollout") == config.role("rollout")


def test_with_role_revalidates():
    config = load_resource_config(DESIGN, gpus=GPUS)
    wider = with_role(config, RoleSpec("reward", "cuda", (2, 4), 2, "data_parallel"), gpus=GPUS)
    assert wider.role("reward").device_ids == (2, 4)
    assert wider.role("actor") == config.role("actor")
    taken = r"rollout.device_ids: \[2\]: GPU 2 is also used by reward"
    with pytest.raises(ResourceConfigError, match=taken):
        with_role(config, RoleSpec("rollout", "cuda", (2,), 1, "hf"), gpus=GPUS)
    with pytest.raises(ResourceConfigError, match="reward.strategy: 'none'"):
        with_role(config, RoleSpec("reward", "cuda", (2, 4), 2, "none"), gpus=GPUS)


def test_with_role_moves_defaulted_roles_with_the_actor():
    config = load_resource_config(DESIGN, gpus=GPUS)
    moved = with_role(config, RoleSpec("actor", "cuda", (0, 1, 4), 3, "fsdp"), gpus=GPUS)
    assert moved.role("critic").device_ids == moved.role("reference").device_ids == (0, 1, 4)


def test_with_role_does_not_count_our_own_gpus_as_busy():
    config = load_resource_config(DESIGN, gpus=GPUS)
    running = [GpuInfo(i, "H200", 100, 10, 90, 99, 1) for i in range(4)] + [idle(4)]
    wider = with_role(config, RoleSpec("reward", "cuda", (2, 4), 2, "data_parallel"), gpus=running)
    assert wider.role("reward").device_ids == (2, 4)


def test_cuda_file_on_this_machine_without_gpus(tmp_path):
    ok, reason = devices.nvml_status()
    if ok and devices.get_gpu_usage():
        pytest.skip("this machine has NVIDIA GPUs")
    with pytest.raises(ResourceConfigError) as info:
        load_resource_config(write(tmp_path, DESIGN_FILE))
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'resource_config.yaml'}: actor.device_type: 'cuda': "
                              "this machine has no usable NVIDIA GPU")
    assert reason in message
    assert message.endswith("Fix: use device_type: cpu with workers: 2.")


def test_empty_gpu_list_means_no_gpu():
    with pytest.raises(ResourceConfigError, match=r"no usable NVIDIA GPU \(none given\)"):
        load_resource_config(DESIGN, gpus=[])


def test_busy_gpu_is_refused_unless_allowed():
    gpus = [idle(i) for i in range(5)]
    gpus[3] = GpuInfo(3, "H200", 100 * GiB, 60 * GiB, 40 * GiB, 80, 2)
    with pytest.raises(ResourceConfigError) as info:
        load_resource_config(DESIGN, gpus=gpus)
    assert str(info.value) == (
        "<dict>: rollout.device_ids: [3]: GPU 3 is busy (2 processes running, 40% of memory "
        "used). Fix: pick a free GPU, stop what runs there, or set allow_busy_devices: true to "
        "share it anyway.")
    assert load_resource_config({**DESIGN, "allow_busy_devices": True}, gpus=gpus)


def test_busy_gpu_refusal_names_the_process_and_its_memory_and_the_threshold_is_a_key():
    gpus = [idle(i) for i in range(5)]
    holder = GpuProcess(4242, "python3", 12 * GiB)
    gpus[2] = GpuInfo(2, "H200", 140 * GiB, 128 * GiB, 12 * GiB, 30, 1, (holder,))
    with pytest.raises(ResourceConfigError) as info:
        load_resource_config(DESIGN, gpus=gpus)
    assert str(info.value).startswith("<dict>: reward.device_ids: [2]: GPU 2 is busy (pid 4242 (python3) uses "
                                      "12.0 GiB, 9% of memory used). Fix: pick a free GPU")
    # 12 of 140 GiB is below a threshold of 10%: the file may say so.
    config = load_resource_config({**DESIGN, "busy_memory_fraction": 0.1}, gpus=gpus)
    assert config.busy_memory_fraction == 0.1 and load_resource_config(config.to_dict(), gpus=gpus) == config
    for bad in (1, 1.5, -0.1, True, "5%", float("nan")):
        with pytest.raises(ResourceConfigError, match="busy_memory_fraction: .*expected a share of GPU memory"):
            load_resource_config({**DESIGN, "busy_memory_fraction": bad}, gpus=gpus)


DELETE = object()


def variant(*changes):
    """The DESIGN file with ("a.b", value) changes applied; DELETE removes a key."""
    data = copy.deepcopy(DESIGN)
    for path, value in changes:
        *parents, last = path.split(".")
        node = data
        for key in parents:
            node = node.setdefault(key, {})
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
    return data


def cuda_graph_rollout(args):
    """The DESIGN file with its rollout on the cuda_graph engine, given `args`."""
    return variant(("rollout.strategy", "cuda_graph"), ("rollout.vllm_args", DELETE), ("rollout.cuda_graph_args", args))


CPU_ROLE = {"device_type": "cpu", "workers": 2, "strategy": "ddp"}
BAD_FILES = {
    "unknown top key": (variant(("rollot", {"device_type": "cpu"})),
                        ["rollot: unknown key (did you mean 'rollout'?)",
                         "Fix: use one of actor,"]),
    "unknown role key": (variant(("reward.devices", [2])),
                         ["reward.devices: unknown key (did you mean 'device_ids'?)", "Fix:"]),
    "missing role": (variant(("rollout", DELETE)), ["rollout: missing", "Fix: add e.g. rollout:"]),
    "role not a mapping": (variant(("reward", "cuda")),
                           ["reward: 'cuda': a role must be a mapping"]),
    "device type gpu": (variant(("actor.device_type", "gpu")),
                        ["actor.device_type: 'gpu': not a device type", "Fix: use cuda."]),
    "device type tpu": (variant(("actor.device_type", "tpu")), ["'tpu'", "Fix: use cuda or cpu."]),
    "device type missing": (variant(("reward.device_type", DELETE)),
                            ["reward.device_type: missing", "Fix: use cuda or cpu"]),
    "ids twice": (variant(("reward.device_ids", [2, 2])),
                  ["reward.device_ids: [2, 2]: GPU 2 is listed twice",
                   "Fix: list each GPU once, e.g. [2, 3]."]),
    "ids not a list": (variant(("reward.device_ids", 2)),
                       ["reward.device_ids: 2: not a list", "Fix: write a list, e.g. [2]"]),
    "ids empty": (variant(("reward.device_ids", [])),
                  ["reward.device_ids: []: no GPUs listed", "device_type: cpu with workers: N"]),
    "ids missing": (variant(("reward.device_ids", DELETE)),
                    ["reward.device_ids: missing", "Fix: add e.g. device_ids: [0]"]),
    "id negative": (variant(("reward.device_ids", [-1])), ["[-1]: -1 is not a GPU id", "Fix:"]),
    "id bool": (variant(("reward.device_ids", [True])), ["[true]: true is not a GPU id"]),
    "cuda workers": (variant(("actor.workers", 3)),
                     ["actor.workers: 3: a cuda role runs one worker per GPU, so workers is 2",
                      "Fix: remove workers"]),
    "cpu with ids": (variant(("reward", {"device_type": "cpu", "device_ids": [2]})),
                     ["reward.device_ids: [2]: a cpu role takes no GPU ids",
                      "Fix: write device_ids: []"]),
    "cpu workers 0": (variant(("reward", {"device_type": "cpu", "workers": 0})),
                      ["reward.workers: 0: not an integer from 1 to 1024", "Fix: set workers: 1 or more, at most 1024"]),
    "cpu workers huge": (variant(("reward", {"device_type": "cpu", "workers": 10**9})),
                         ["reward.workers: 1000000000: not an integer from 1 to 1024 (one process each)"]),
    "bad strategy": (variant(("rollout.strategy", "vlm")),
                     ["rollout.strategy: 'vlm': not a rollout strategy (did you mean 'vllm'?)",
                      "Fix: use one of cuda_graph, hf, vllm."]),
    "reward none x2": (variant(("reward.device_ids", [2, 4])),
                       ["reward.strategy: 'none': 'none' runs one reward worker but 2 are set",
                        "Fix: use strategy: data_parallel"]),
    "actor none x2": (variant(("actor.strategy", "none")),
                      ["actor.strategy: 'none'", "Fix: use strategy: ddp or fsdp"]),
    "vllm args on hf": (variant(("rollout.strategy", "hf")),
                        ["rollout.vllm_args: {tensor_parallel_size: 1",
                         "only apply to strategy vllm",
                         "Fix: remove vllm_args, or set strategy: vllm."]),
    "vllm args not a mapping": (variant(("rollout.vllm_args", "fast")),
                                ["rollout.vllm_args: 'fast': not a mapping", "Fix: write e.g."]),
    "vllm tensor parallel": (variant(("rollout.vllm_args.tensor_parallel_size", 2)),
                             ["rollout.vllm_args.tensor_parallel_size: 2", "Fix: use 1"]),
    "cuda graph args on vllm": (variant(("rollout.cuda_graph_args", {"decode_attention": "sdpa"})),
                                ["rollout.cuda_graph_args: {decode_attention: 'sdpa'}: cuda_graph_args only apply "
                                 "to strategy cuda_graph, not 'vllm'", "Fix: remove cuda_graph_args, or set "
                                 "strategy: cuda_graph."]),
    "cuda graph args misspelt": (cuda_graph_rollout({"decode_atention": "sdpa"}),
                                 ["rollout.cuda_graph_args.decode_atention: not an option of the cuda_graph engine "
                                  "(did you mean 'decode_attention'?)",
                                  "Fix: use decode_attention or fuse_projections or compile_prefill or max_batch_size."]),
    "cuda graph attention": (cuda_graph_rollout({"decode_attention": "flash"}),
                             ["rollout.cuda_graph_args.decode_attention: 'flash': not 'kernel' or 'sdpa'",
                              "Fix: use decode_attention: 'kernel' (the default) or 'sdpa'."]),
    "cuda graph fusion": (cuda_graph_rollout({"fuse_projections": "no"}),
                          ["rollout.cuda_graph_args.fuse_projections: 'no': not true or false",
                           "Fix: use fuse_projections: true (the default) or false."]),
    "cuda graph args not a mapping": (cuda_graph_rollout("sdpa"),
                                      ["rollout.cuda_graph_args: 'sdpa': not a mapping",
                                       "Fix: write e.g. cuda_graph_args: {decode_attention: sdpa}."]),
    "timeout text": (variant(("timeout_seconds", "abc")),
                     ["timeout_seconds: 'abc': expected a number of seconds > 0",
                      "Fix: use e.g. timeout_seconds: 180."]),
    "timeout zero": (variant(("timeout_seconds", 0)), ["timeout_seconds: 0: expected a number"]),
    "timeout inf": (variant(("timeout_seconds", float("inf"))), ["timeout_seconds: inf:"]),
    "timeout nan": (variant(("timeout_seconds", float("nan"))),
                    ["timeout_seconds: nan: expected a number of seconds > 0", "not inf or nan"]),
    "timeout negative": (variant(("timeout_seconds", -5)), ["timeout_seconds: -5: expected"]),
    # Finite, but past what timedelta (~8.6e13 s) and Event.wait (~9.2e9 s) take.
    "timeout 1e14": (variant(("timeout_seconds", 1e14)),
                     ["timeout_seconds: 100000000000000.0: expected a number of seconds > 0 and at most 10000000",
                      "Fix: use e.g. timeout_seconds: 180."]),
    "timeout 400 digits": (variant(("timeout_seconds", 10 ** 400)),  # overflows a float
                           ["timeout_seconds: 1000000000", "...: expected a number"]),
    "backend": (variant(("comm_backend", "mpi")),
                ["comm_backend: 'mpi': not a backend", "Fix: use nccl, gloo or auto."]),
    "nccl on cpu": (variant(("actor", CPU_ROLE)),
                    ["comm_backend: 'nccl': NCCL needs GPUs but actor runs on cpu",
                     "Fix: use comm_backend: gloo"]),
    "overlap": (variant(("reward.device_ids", [1])),
                ["reward.device_ids: [1]: GPU 1 is also used by actor",
                 "set allow_shared_devices: true to co-locate them on purpose (one-GPU machines)"]),
    "explicit critic overlap": (variant(("critic", {"device_type": "cuda", "device_ids": [0, 1]})),
                                ["critic.device_ids: [0, 1]: GPU 0 is also used by actor",
                                 "allow_shared_devices: true"]),
    "no such gpu": (variant(("rollout.device_ids", [7])),
                    ["rollout.device_ids: [7]: GPU 7 does not exist; this machine has GPUs "
                     "[0, 1, 2, 3, 4]", "Fix: use ids from that list"]),
    "flag text": (variant(("allow_shared_devices", "yes")),
                  ["allow_shared_devices: 'yes': expected true or false", "Fix: write"]),
    "adaptive order": (variant(("adaptive", {"rollout": {"min": 3, "max": 1}})),
                       ["adaptive.rollout: {min: 3, max: 1}: need integers with 1 <= min <= max",
                        "Fix: write e.g. rollout: {min: 1, max: 3}"]),
    "adaptive past the limit": (variant(("adaptive", {"rollout": {"min": 1, "max": 5000}})),
                                ["adaptive.rollout: {min: 1, max: 5000}: need integers with 1 <= min <= max <= 1024"]),
    "adaptive keys": (variant(("adaptive", {"rollout": {"min": 1}})),
                      ["adaptive.rollout: {min: 1}: bounds need exactly min and max"]),
    "adaptive role": (variant(("adaptive", {"rolout": {"min": 1, "max": 2}})),
                      ["adaptive.rolout: not a role (did you mean 'rollout'?)", "Fix: use one of"]),
    "adaptive defaulted": (variant(("adaptive", {"critic": {"min": 1, "max": 2}})),
                           ["adaptive.critic", "placed with the actor",
                            "Fix: add a critic section"]),
    "adaptive not a mapping": (variant(("adaptive", 3)), ["adaptive: 3: expected a mapping"]),
}


@pytest.mark.parametrize("data, fragments", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_bad_file_gets_one_clear_error(tmp_path, data, fragments):
    path = write(tmp_path, yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ResourceConfigError) as info:
        load_resource_config(path, gpus=GPUS)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert ". Fix: " in message
    for fragment in fragments:
        assert fragment in message


BAD_YAML = {
    "syntax": ("actor: {device_type: cuda\nreward: x\n",
               ["line 2", "invalid YAML", "Fix: correct"]),
    "duplicate key": (DESIGN_FILE + "reward: {device_type: cpu}\n",
                      ["line 10, column 1: invalid YAML (duplicate key 'reward')",
                       "Fix: write each key once."]),
    "a list": ("- actor\n- reward\n", ["['actor', 'reward']: the file must map roles to settings"]),
    "empty": ("", ["null: the file must map roles to settings"]),
}


@pytest.mark.parametrize("text, fragments", BAD_YAML.values(), ids=BAD_YAML.keys())
def test_bad_yaml(tmp_path, text, fragments):
    with pytest.raises(ResourceConfigError) as info:
        load_resource_config(write(tmp_path, text), gpus=GPUS)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ResourceConfigError, match="nope.yaml: file not found. Fix: check the path"):
        load_resource_config(tmp_path / "nope.yaml")


def test_error_is_a_value_error_and_pickles():
    with pytest.raises(ValueError) as info:
        parse_resource_config(variant(("reward.device_ids", [2, 2])), gpus=GPUS)
    error = info.value
    assert (error.path, error.value, error.problem) == ("reward.device_ids", "[2, 2]",
                                                        "GPU 2 is listed twice")
    assert str(pickle.loads(pickle.dumps(error))) == str(error)


def test_imports_run_one_way():
    """resources.config holds the types only: it imports neither the parser nor the reader,
    which import it (no circle, no imports hidden inside functions)."""
    import ast
    from pathlib import Path

    import resources.config

    tree = ast.parse(Path(resources.config.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
    assert not imported & {"resources.validate", "resources.yaml_reader", "resources"}


def test_roles_share_a_gpu_only_when_their_device_ids_meet():
    own = parse_resource_config(DESIGN, gpus=GPUS)       # rollout on GPU 3, actor on 0 and 1
    assert not own.share_gpus("rollout", "actor") and own.share_gpus("critic", "actor")
    one = parse_resource_config({"actor": {"device_type": "cuda", "device_ids": [0]},
                                 "rollout": {"device_type": "cuda", "device_ids": [0]},
                                 "reward": {"device_type": "cpu"}, "allow_shared_devices": True}, gpus=GPUS)
    assert one.share_gpus("rollout", "actor")
    cpu = parse_resource_config({"actor": {"device_type": "cpu"}, "rollout": {"device_type": "cpu"},
                                 "reward": {"device_type": "cpu"}}, gpus=[])
    assert not cpu.share_gpus("rollout", "actor")        # separate processes, no GPU


ONE_GPU = {"actor": {"device_type": "cuda", "device_ids": [0]}, "rollout": {"device_type": "cuda", "device_ids": [0]},
           "reward": {"device_type": "cpu"}, "allow_shared_devices": True}


def test_roles_on_one_gpu_take_turns_unless_it_runs_under_mps(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    turns = parse_resource_config(ONE_GPU, gpus=GPUS)
    assert turns.gpu_sharing == "time_slice" and turns.take_turns("rollout", "actor")
    # No daemon listens in that directory: refused, naming the key and both ways out.
    with pytest.raises(ResourceConfigError) as refused:
        parse_resource_config({**ONE_GPU, "gpu_sharing": "mps"}, gpus=GPUS)
    message = str(refused.value)
    assert "gpu_sharing" in message and f"no NVIDIA MPS control daemon listens at {tmp_path}/control" in message
    assert "nvidia-cuda-mps-control -d" in message and "remove gpu_sharing" in message
    os.mkfifo(tmp_path / "control")   # what a control daemon listens on
    mps = parse_resource_config({**ONE_GPU, "gpu_sharing": "mps"}, gpus=GPUS)
    assert mps.share_gpus("rollout", "actor") and not mps.take_turns("rollout", "actor")
    assert parse_resource_config(mps.to_dict(), gpus=GPUS) == mps
    # A CPU-only file never looks for a daemon; a role on GPUs of its own never takes turns.
    cpu = {role: {"device_type": "cpu"} for role in ("actor", "rollout", "reward")}
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "none"))
    assert not parse_resource_config({**cpu, "gpu_sharing": "mps"}, gpus=[]).take_turns("rollout", "actor")
    assert not parse_resource_config(DESIGN, gpus=GPUS).take_turns("rollout", "actor")


def test_gpu_sharing_names_its_values():
    with pytest.raises(ResourceConfigError) as refused:
        parse_resource_config({**ONE_GPU, "gpu_sharing": "MPS"}, gpus=GPUS)
    assert "gpu_sharing" in str(refused.value) and "use time_slice (the default) or mps" in str(refused.value)
