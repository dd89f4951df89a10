"""Placement: a validated config -> one worker spec per worker process."""

import ast
from pathlib import Path

import pytest
import yaml

import resources.config
import resources.devices
import resources.engine_args_spec
import resources.file_values
import resources.hosted_spec
import resources.plan
import resources.validate
import resources.yaml_reader
from resources.config import RoleSpec
from resources.devices import GpuInfo
from resources.plan import WorkerSpec, device_roles, plan_role, plan_workers
from resources.validate import parse_resource_config

DESIGN = yaml.safe_load("""\
actor:   {device_type: cuda, device_ids: [0, 1], strategy: fsdp}
reward:  {device_type: cuda, device_ids: [2], strategy: none}
rollout:
  device_type: cuda
  device_ids: [3]
  strategy: vllm
  vllm_args: {tensor_parallel_size: 1, gpu_memory_utilization: 0.85, enforce_eager: false}
comm_backend: nccl
timeout_seconds: 180
""")
GPUS = [GpuInfo(i, "H200", 100, 100, 0, 0, 0) for i in range(5)]
CPU = {"actor": {"device_type": "cpu", "workers": 2, "strategy": "ddp"},
       "reward": {"device_type": "cpu"}, "rollout": {"device_type": "cpu", "workers": 3}}


def test_design_file_plan():
    workers = plan_workers(parse_resource_config(DESIGN, gpus=GPUS))
    placed = [(w.name, w.role, w.device_id, w.env_dict["CUDA_VISIBLE_DEVICES"]) for w in workers]
    assert placed == [
        ("actor-0", "actor", 0, "0"), ("actor-1", "actor", 1, "1"),
        ("critic-0", "critic", 0, "0"), ("critic-1", "critic", 1, "1"),
        ("reference-0", "reference", 0, "0"), ("reference-1", "reference", 1, "1"),
        ("reward-0", "reward", 2, "2"),
        ("rollout-0", "rollout", 3, "3"),
    ]
    for worker in workers:
        assert worker.device_type == "cuda" and worker.nthreads == 1
        assert worker.resources == {worker.role: 1}  # exactly one role tag per worker
        assert worker.env_dict["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_design_file_device_roles():
    workers = plan_workers(parse_resource_config(DESIGN, gpus=GPUS))
    assert device_roles(workers) == {0: ["actor", "critic", "reference"],
                                     1: ["actor", "critic", "reference"],
                                     2: ["reward"], 3: ["rollout"]}


def test_cpu_plan_hides_every_gpu():
    workers = plan_workers(parse_resource_config(CPU))
    counts = {}
    for worker in workers:
        counts[worker.role] = counts.get(worker.role, 0) + 1
        assert worker.device_id is None and worker.device_type == "cpu"
        assert worker.env_dict == {"CUDA_VISIBLE_DEVICES": ""}
    assert counts == {"actor": 2, "critic": 2, "reference": 2, "reward": 1, "rollout": 3}
    rollout = [w.name for w in workers if w.role == "rollout"]
    assert rollout == ["rollout-0", "rollout-1", "rollout-2"]
    assert device_roles(workers) == {}


def test_first_index_numbers_new_workers_after_existing_ones():
    spec = RoleSpec("reward", "cuda", (4, 6), 2, "data_parallel")
    assert plan_role(spec, first_index=3) == [
        WorkerSpec("reward-3", "reward", "cuda", 4,
                   (("CUDA_VISIBLE_DEVICES", "4"), ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"))),
        WorkerSpec("reward-4", "reward", "cuda", 6,
                   (("CUDA_VISIBLE_DEVICES", "6"), ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"))),
    ]
    cpu = plan_role(RoleSpec("rollout", "cpu", (), 2, "hf"), first_index=1)
    assert [w.name for w in cpu] == ["rollout-1", "rollout-2"]


def test_shared_gpu_gets_one_worker_per_role():
    one = {"device_type": "cuda", "device_ids": [0]}
    data = {"actor": one, "reward": one, "rollout": one, "allow_shared_devices": True}
    workers = plan_workers(parse_resource_config(data, gpus=GPUS[:1]))
    assert device_roles(workers) == {0: ["actor", "critic", "reference", "reward", "rollout"]}


def test_worker_spec_is_frozen():
    worker = plan_role(RoleSpec("actor", "cpu", (), 1, "none"))[0]
    with pytest.raises(AttributeError):
        worker.device_id = 3


@pytest.mark.parametrize("module", [resources.config, resources.devices, resources.plan,
                                    resources.validate, resources.yaml_reader, resources.engine_args_spec,
                                    resources.file_values, resources.hosted_spec])
def test_placement_modules_stay_pure(module):
    """No dask, torch or pipeline imports: placement must import on any machine, fast."""
    tree = ast.parse(Path(module.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"dask", "distributed", "torch", "pipeline"}
