"""Shared fixtures. Worker processes that import torch start slowly on two cores, so one
cluster serves every test that does not kill, add or retire workers."""

from __future__ import annotations

import compileall
import contextlib
import os
import sys
import tracemalloc
from pathlib import Path

import pytest

from resources import load_resource_config

# Where the environment forbids writing bytecode (PYTHONDONTWRITEBYTECODE, as on this
# project's development VM), every worker process the tests start compiled the project's
# sources again on import: about 1.5 s of a 2-core CPU each. Compiled once here, they are read.
if sys.flags.dont_write_bytecode:
    for package in ("pipeline", "resources"):
        compileall.compile_dir(Path(__file__).resolve().parents[1] / package, quiet=1)

# Two rollout and two actor workers, so sharding and the 2-rank process group are exercised.
SHARED_LAYOUT = {
    "actor": {"device_type": "cpu", "workers": 2, "strategy": "ddp"},
    "critic": {"device_type": "cpu", "workers": 1},
    "reference": {"device_type": "cpu", "workers": 1},
    "reward": {"device_type": "cpu", "workers": 1},
    "rollout": {"device_type": "cpu", "workers": 2},
    "timeout_seconds": 120,
}


@pytest.fixture(scope="session", autouse=True)
def temporary_files_under_pytest(tmp_path_factory):
    """Run outputs made without an output_dir (trainers, examples, the CLI) are kept for
    their user under the system's temp directory; in tests they go under pytest's own
    base directory, which pytest prunes, instead of piling up in /tmp."""
    import tempfile

    directory = str(tmp_path_factory.mktemp("tmp"))
    before_dir, before_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir, os.environ["TMPDIR"] = directory, directory
    yield
    tempfile.tempdir = before_dir
    if before_env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before_env


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from pipeline.models import create_tiny_model

    return str(create_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=64, seed=0))


@pytest.fixture(params=[True, False], ids=["separable", "whole-model"])
def policy(request, tiny_model, monkeypatch):
    """The tiny model, loaded fresh, scoring responses in chunks of 4 tokens (several, the last
    short): as its base model's output projected (separable) or through its whole forward."""
    from pipeline.models import load_causal_lm
    from pipeline.roles import forward

    monkeypatch.setattr(forward, "LOGIT_CHUNK_TOKENS", 4)
    model = load_causal_lm(tiny_model).eval()
    if not request.param:
        forward._SEPARABLE[model] = False
    return model


@pytest.fixture(scope="session")
def shared_config():
    return load_resource_config(SHARED_LAYOUT)


def published_snapshots(snapshot_dir) -> list[str]:
    """The weight versions an actor keeps readable under the "shm" transport (a file each)."""
    from pathlib import Path

    return sorted(p.name for p in Path(snapshot_dir).glob("policy-v*"))


def role_cluster(config):
    """A fresh local cluster with one worker per planned role worker (close it after use).

    Its scheduler preloads the RL dashboard and its workers start importing torch and
    transformers as they come up, as the trainer's own cluster does."""
    from pipeline.roles.host import WORKER_IMPORTS
    from resources.cluster import RoleCluster
    from resources.plan import plan_workers

    return RoleCluster(plan_workers(config), dashboard_address=":0", preload=["pipeline.dashboard"],
                       worker_imports=WORKER_IMPORTS)


@pytest.fixture(scope="session")
def shared_cluster(shared_config):
    with role_cluster(shared_config) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A single-node SLURM on this machine (tests/slurm_node.py), for the job-queue tests; its
    client commands find it through SLURM_CONF. Skips with the reason where it cannot start
    (not root, packages missing), unless DASK_RL_REQUIRE_SLURM=1 (CI), where that fails."""
    from slurm_node import LocalSlurm, SlurmUnavailable

    pytest.importorskip("dask_jobqueue", reason="pip install 'dask-rl[slurm]'")
    node = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        node.start()
    except SlurmUnavailable as why:
        node.stop()
        if os.environ.get("DASK_RL_REQUIRE_SLURM") == "1":
            pytest.fail(f"DASK_RL_REQUIRE_SLURM=1 but no local SLURM: {why}")
        pytest.skip(f"no local SLURM: {why}")
    before = os.environ.get("SLURM_CONF")
    os.environ.update(node.env)
    yield node
    node.stop()
    if before is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = before


@pytest.fixture(scope="session")
def prompts() -> list[str]:
    return [f"what is {a} plus {b}? answer: " for a in range(8) for b in range(4)]


# Figures a test measured (e.g. how far vLLM's logprobs are from the actor's), printed in the
# run's summary: the numbers a reviewer asks for, without digging through captured output.
_MEASURED: list[str] = []


@pytest.fixture
def measured():
    return _MEASURED.append


def pytest_terminal_summary(terminalreporter):
    if _MEASURED:
        terminalreporter.section("measured")
        for line in _MEASURED:
            terminalreporter.write_line(line)


@contextlib.contextmanager
def python_peak(limit_bytes: int):
    """Fails if the block's Python allocations peak above `limit_bytes`: how the tests tell a
    bad file refused early (read in bounded pieces, aliases not expanded) from one read whole.
    Memory, not seconds, so the check holds on a loaded machine."""
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit_bytes, f"peaked at {peak / 2**20:.1f} MiB of Python memory (limit {limit_bytes / 2**20:.0f} MiB)"


def cache_keyword(model) -> str:
    """The name of the cache argument of `model.forward`: transformers renamed
    `past_key_values` to `cache` (5.2x) and drops the old name in 5.40."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
