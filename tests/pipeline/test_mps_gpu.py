"""`gpu_sharing: mps` on a real GPU (`pytest -m gpu`, where `nvidia-cuda-mps-control` exists):
under an MPS control daemon of the test's own, the actor and rollout workers on one GPU
become clients of its server, and partial rollouts generate the next batch during the update."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from pipeline import HybridTrainer
from pipeline.models import create_tiny_model
from pipeline.rewards import digit_fraction
from resources import devices, load_resource_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
              pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None,
                                 reason="needs NVIDIA MPS (nvidia-cuda-mps-control)")]


@pytest.fixture
def mps_daemon(tmp_path, monkeypatch):
    """A control daemon listening in a directory of the test's own; the trainer's workers
    inherit the variables that point CUDA there."""
    pipe, log = tmp_path / "mps-pipe", tmp_path / "mps-log"
    pipe.mkdir()
    log.mkdir()
    for name, path in (("CUDA_MPS_PIPE_DIRECTORY", pipe), ("CUDA_MPS_LOG_DIRECTORY", log)):
        monkeypatch.setenv(name, str(path))
    subprocess.run(["nvidia-cuda-mps-control", "-d"], check=True, timeout=30)
    yield pipe
    subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", timeout=60)


def test_roles_on_one_gpu_run_under_mps_and_partial_batches_generate_ahead(mps_daemon, tmp_path):
    assert devices.mps_control_pipe() == mps_daemon / "control" and devices.mps_control_pipe().exists()
    gpu = {"device_type": "cuda", "device_ids": [0]}
    config = load_resource_config({"actor": {**gpu, "strategy": "none"}, "rollout": {**gpu, "strategy": "cuda_graph"},
                                   "reward": {"device_type": "cpu", "workers": 1}, "allow_shared_devices": True,
                                   "gpu_sharing": "mps"})
    model_dir = create_tiny_model(tmp_path / "tiny")
    with HybridTrainer(str(model_dir), digit_fraction, config, algorithm="grpo",
                       prompts=[f"count {i}:" for i in range(64)], samples_per_prompt=4, prompts_per_step=4,
                       max_new_tokens=24, partial_rollouts=True, max_staleness=2, dtype="bfloat16", kl_coef=0.0,
                       actor_lr=1e-3, show_progress=False, dashboard_address=":0",
                       output_dir=str(tmp_path / "run")) as trainer:
        assert trainer.batches.partial_mode.startswith("the next batch generates during the update")
        history = trainer.train(3)
        worker_pids = set(trainer.fleet.client.run(os.getpid).values())
        on_gpu = {process.pid: process.name for info in devices.get_gpu_usage() if info.index == 0
                  for process in info.processes}
    assert [record.policy_version for record in history] == [1, 2, 3]
    # The daemon started a server for the workers: NVML lists it beside them on the GPU.
    assert any("mps-server" in name for name in on_gpu.values()), on_gpu
    assert len(worker_pids & set(on_gpu)) == 2, (worker_pids, on_gpu)   # the actor and the rollout
