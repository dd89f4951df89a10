"""Workers from "another host": `dask-rl scheduler` and `dask-rl worker` as separate
processes on 127.0.0.1, a trainer that joins them with scheduler_address=, and a worker
that joins a trainer's own scheduler. Every process started here is stopped in teardown."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.rewards import digit_fraction
from pipeline.roles.host import role_ready, worker_identity
from pipeline.fleet.tasks import submit
from resources.cluster import RoleCluster, live_workers
from resources import load_resource_config
from resources.devices import nvml_status, pin_to_device
from resources.plan import WorkerSpec
from resources.worker import role_worker_specs

ROOT = Path(__file__).resolve().parents[2]
GRPO_ROLES = ("rollout", "reward", "reference", "actor")
LAYOUT = {role: {"device_type": "cpu", "workers": 1} for role in GRPO_ROLES} | {"timeout_seconds": 120}
GRPO = dict(algorithm="grpo", samples_per_prompt=2, prompts_per_step=4, max_new_tokens=6, steps=2,
            show_progress=False)
HOST = socket.gethostname().split(".")[0]


class Processes:
    """`python -m pipeline.cli ...` subprocesses, each in its own session so that teardown
    can stop its worker children too; output goes to a file the test can wait on."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.started: list[tuple[subprocess.Popen, Path]] = []

    def start(self, *args: str) -> tuple[subprocess.Popen, Path]:
        log = self.log_dir / f"proc-{len(self.started)}.log"
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT, stdout=log.open("w"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.started.append((proc, log))
        return proc, log

    @staticmethod
    def wait_for(proc: subprocess.Popen, log: Path, pattern: str, count: int = 1, timeout: float = 120) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.findall(pattern, log.read_text())
            if len(found) >= count:
                return found
            assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}:\n{log.read_text()}"
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} x{count} from {proc.args} in {timeout}s:\n{log.read_text()}")

    def worker(self, address: str, role: str, *extra: str) -> tuple[subprocess.Popen, str]:
        """Start `dask-rl worker`; returns the process and the address its worker joined as."""
        proc, log = self.start("worker", address, "--role", role, *extra)
        (joined,) = self.wait_for(proc, log, rf"joined \S+ as (tcp://\S+)")
        return proc, joined

    def close(self) -> None:
        """Kill every process group (each a session of its own): a graceful shutdown of four
        workers and a scheduler took 8 s of the suite and is not what these tests check."""
        for proc, _ in reversed(self.started):  # workers before the scheduler they belong to
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for proc, _ in self.started:
            proc.wait(15)


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    procs = Processes(tmp_path_factory.mktemp("remote-logs"))
    yield procs
    procs.close()


@pytest.fixture(scope="module")
def remote(processes):
    """A `dask-rl scheduler` and one `dask-rl worker` per GRPO role, all separate processes."""
    proc, log = processes.start("scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address", ":0")
    (address,) = processes.wait_for(proc, log, r"scheduler at (tcp://\S+)", timeout=60)
    # Started together, then awaited: on 2 cores each one's start is mostly importing torch.
    started = {role: processes.start("worker", address, "--role", role) for role in GRPO_ROLES}
    workers = {role: (worker, processes.wait_for(worker, log, rf"joined \S+ as (tcp://\S+)")[0])
               for role, (worker, log) in started.items()}
    return {"address": address, "scheduler": proc, "workers": workers}


def test_worker_names_follow_role_host_and_device():
    assert [w.name for w in role_worker_specs("reward", [4, 5], hostname="b")] == ["reward-b-gpu4", "reward-b-gpu5"]
    gpu = role_worker_specs("reward", [4], hostname="b")[0]
    assert gpu.env_dict == {"CUDA_VISIBLE_DEVICES": "4", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert gpu.resources == {"reward": 1} and gpu.nthreads == 1
    cpu = role_worker_specs("rollout", workers=2, hostname="b", taken={"rollout-b-0", "rollout-b-2"})
    assert [w.name for w in cpu] == ["rollout-b-1", "rollout-b-3"]
    assert cpu[0].env_dict == {"CUDA_VISIBLE_DEVICES": ""}
    assert [w.name for w in role_worker_specs("actor", name="trainer-x")] == ["trainer-x"]


def test_unknown_role_exits_2_with_one_line_listing_roles():
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", "worker", "tcp://127.0.0.1:1", "--role", "judge"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "'judge'" in lines[0] and "actor, critic, reference, reward, rollout" in lines[0]


@pytest.mark.skipif(nvml_status()[0], reason="this machine has a GPU driver")
def test_device_ids_without_a_gpu_exit_with_a_clear_message():
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", "worker", "tcp://127.0.0.1:1", "--role", "reward",
                             "--device-ids", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "no usable NVIDIA GPU" in result.stderr and "leave out --device-ids" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_workers_register_with_their_role_resource_and_name(remote):
    with RoleCluster.connect(remote["address"], GRPO_ROLES, timeout=60) as cluster:
        table = live_workers(cluster.client)
        for role, (_, address) in remote["workers"].items():
            assert table[address]["resources"] == {role: 1}
            assert table[address]["name"] == f"{role}-{HOST}-0"
            assert [w["address"] for w in cluster.workers_of(role)] == [address]
        # CPU workers never see a GPU, and run one thread each
        env = cluster.client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"))
        assert set(env.values()) == {""}
        assert set(cluster.client.nthreads().values()) == {1}


def test_dask_rl_worker_imports_torch_and_transformers_in_the_background(remote, measured):
    """As the trainer's own workers do: the imports start with the process, not at the first task."""
    from pipeline.roles.host import WORKER_IMPORTS

    def background_imports(dask_worker=None) -> dict:  # defined here: sent by value to the remote workers
        """Waits (bounded) for the worker's background imports; what they imported, and how long it took."""
        import sys

        plugin = dask_worker.plugins.get("dask-rl-imports")
        done = plugin is not None and plugin.done.wait(120)
        return {"done": done, "seconds": plugin.seconds if done else None,
                "imported": [m for m in WORKER_IMPORTS if m in sys.modules]}

    with RoleCluster.connect(remote["address"], GRPO_ROLES, timeout=60) as cluster:
        addresses = [address for _, address in remote["workers"].values()]
        found = cluster.client.run(background_imports, workers=addresses)
    assert set(found) == set(addresses)
    for address, report in found.items():
        assert report["done"] and report["imported"] == list(WORKER_IMPORTS), (address, report)
    slowest = max(report["seconds"] for report in found.values())
    measured(f"dask-rl worker: torch + transformers imported in the background in {slowest:.1f} s "
             f"(slowest of {len(found)} workers starting together)")


def test_connect_names_the_missing_role_and_the_command(remote):
    with pytest.raises(TimeoutError) as error:
        RoleCluster.connect(remote["address"], ("reward", "critic"), timeout=1)
    message = str(error.value)
    assert "['critic']" in message and f"dask-rl worker {remote['address']} --role critic" in message


def test_connect_to_no_scheduler_says_so():
    with pytest.raises(ConnectionError, match="dask-rl scheduler"):
        RoleCluster.connect("tcp://127.0.0.1:9", timeout=1)


@pytest.mark.slow  # a long end-to-end drill: CI runs it in the slow suite
def test_grpo_trains_on_remote_workers_and_a_late_worker_takes_reward_tasks(remote, processes, tiny_model,
                                                                            prompts):
    from pipeline.trainer import HybridTrainer

    trainer = HybridTrainer(tiny_model, digit_fraction, load_resource_config(LAYOUT), prompts=prompts,
                            scheduler_address=remote["address"], **GRPO)
    try:
        records = trainer.train()
        assert [r.step for r in records] == [0, 1] and trainer.version == 2
        assert all(r.tokens > 0 for r in records)

        late, address = processes.worker(remote["address"], "reward")  # joins while the trainer is connected
        info = live_workers(trainer.fleet.client)[address]
        assert info["name"] == f"reward-{HOST}-1" and info["resources"] == {"reward": 1}
        where = submit(trainer.fleet.client, "reward", worker_identity, tag="late", workers=[address]).result(60)
        assert where["address"] == address and where["resources"] == {"reward": 1}
        assert submit(trainer.fleet.client, "reward", role_ready, "reward", workers=[address]).result(120)["name"] == \
            info["name"]  # it loaded the reward model from the trainer's plugin
        trainer.train(1)  # still trains with two reward workers
        # workers=N counts the workers this trainer runs, besides the two joined from elsewhere.
        (change,) = trainer.update_resource("reward", workers=1)
        assert len(change.added) == 1 and change.managed == change.added and len(change.workers) == 3
        assert "1 CPU workers managed by this trainer, 3 in all (2 joined from elsewhere" in str(change)

        trainer.fleet.cluster.retire([address])  # its Nanny must close, not restart it: the command exits
        assert late.wait(30) == 0
        assert address not in live_workers(trainer.fleet.client)
    finally:
        trainer.close()
    # the trainer leaves the scheduler and the remote workers running
    assert remote["scheduler"].poll() is None
    assert all(proc.poll() is None for proc, _ in remote["workers"].values())


@pytest.mark.slow  # a long end-to-end drill: CI runs it in the slow suite
def test_connected_cluster_starts_local_workers_and_closes_only_those(remote):
    cluster = RoleCluster.connect(remote["address"], ("reward",), timeout=60)
    first = cluster.next_index("reward")
    specs = [WorkerSpec(f"reward-{first + k}", "reward", "cpu", None, tuple(pin_to_device(None).items()))
             for k in range(2)]
    added = cluster.add_workers(specs, timeout=120)
    assert {w["name"] for w in cluster.workers_of("reward")} >= set(added)
    retired, kept = added[specs[0].name], added[specs[1].name]
    cluster.drain([retired], "reward", timeout=30)
    cluster.retire([retired])
    assert specs[0].name not in cluster.specs and retired not in live_workers(cluster.client)
    cluster.close()
    with RoleCluster.connect(remote["address"], GRPO_ROLES, timeout=30) as again:  # the scheduler lives on
        table = live_workers(again.client)
        assert kept not in table
        assert {w["name"] for w in table.values()} == {f"{role}-{HOST}-0" for role in GRPO_ROLES}


@pytest.mark.slow  # a long end-to-end drill: CI runs it in the slow suite
def test_a_worker_joins_the_trainers_own_scheduler(processes, tiny_model, prompts):
    from distributed import get_task_stream

    from pipeline.trainer import HybridTrainer

    trainer = HybridTrainer(tiny_model, digit_fraction, load_resource_config(LAYOUT), prompts=prompts,
                            dashboard_address=":0", **GRPO)
    try:
        proc, address = processes.worker(trainer.fleet.client.scheduler.address, "rollout")
        assert live_workers(trainer.fleet.client)[address]["resources"] == {"rollout": 1}
        assert len(trainer.fleet.cluster.workers_of("rollout")) == 2
        with get_task_stream(trainer.fleet.client) as stream:
            trainer.train(1)  # two rollout workers: the step's generation is split in two shards
        generated = [t for t in stream.data if t["key"].startswith("rollout-generate")]
        # Which worker takes which shard is Dask's choice: what is guaranteed is the split, that
        # only rollout workers generate, and that the joined one loaded the model and serves.
        assert len(generated) == 2 and {t["worker"] for t in generated} <= set(trainer.fleet.addresses("rollout"))
        assert submit(trainer.fleet.client, "rollout", role_ready, "rollout", workers=[address]).result(120)[
            "name"] == live_workers(trainer.fleet.client)[address]["name"]
    finally:
        trainer.close()
    assert proc.wait(30) == 0  # the scheduler closed, so the worker command ends


@pytest.mark.slow  # its own scheduler and three worker processes: a minute or two on CPU
def test_a_scheduler_killed_mid_step_ends_training_with_one_error_naming_it_and_close_returns(
        processes, tiny_model, prompts, tmp_path, caplog):
    """The scheduler process is killed by the reward worker while it scores the second step:
    train() ends at once with SchedulerLost naming the address and the fix (not after
    timeout_seconds with CommClosedError), and close() returns, logging what it could not save."""
    from pipeline.fleet.tasks import SchedulerLost
    from pipeline.trainer import HybridTrainer

    proc, log = processes.start("scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address", ":0")
    (address,) = processes.wait_for(proc, log, r"scheduler at (tcp://\S+)", timeout=60)
    for role in ("rollout", "reward", "actor"):
        processes.worker(address, role)
    flag, scheduler_pid = tmp_path / "kill-now", proc.pid

    def reward(prompt: str, response: str) -> float:  # runs on the reward worker, sent by value
        if flag.exists():
            os.kill(scheduler_pid, signal.SIGKILL)
        return float(len(response))

    layout = {role: {"device_type": "cpu", "workers": 1} for role in ("actor", "reward", "rollout")}
    trainer = HybridTrainer(tiny_model, reward, load_resource_config({**layout, "timeout_seconds": 300}),
                            prompts=prompts, scheduler_address=address, output_dir=str(tmp_path / "out"),
                            **{**GRPO, "kl_coef": 0.0, "steps": 3})
    started = time.monotonic()
    with pytest.raises(SchedulerLost) as lost:
        trainer.train(on_step=lambda record: flag.touch())
    seconds = time.monotonic() - started
    assert proc.wait(10) == -signal.SIGKILL and len(trainer.history) == 1
    message = str(lost.value)
    assert f"the Dask scheduler at {address} is gone" in message and "Fix: restart it (`dask-rl scheduler`)" in message
    assert seconds < 120, f"train() took {seconds:.0f}s to notice (timeout_seconds is 300)"
    with caplog.at_level(logging.WARNING, logger="dask_rl"):
        trainer.close()  # returns: nothing to save through, nothing to raise
    assert "the models of policy version 1 were not saved" in caplog.text
    assert not (tmp_path / "out" / "actor").exists()


@pytest.mark.parametrize("ending", ["returns", "raises a closed connection"])
def test_leaving_training_just_after_the_scheduler_died_raises_scheduler_lost(processes, tmp_path, ending):
    """The scheduler dies as the training loop ends: whether the loop returned (leaving still
    answers queued resource changes, through the scheduler) or failed on a closed connection
    before the client noticed the loss, the caller gets SchedulerLost naming the scheduler,
    not the connection error, and not silence."""
    from distributed.comm import CommClosedError

    from pipeline.fleet import Fleet
    from pipeline.fleet.tasks import SchedulerLost

    proc, log = processes.start("scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address", ":0")
    (address,) = processes.wait_for(proc, log, r"scheduler at (tcp://\S+)", timeout=60)
    fleet = Fleet(load_resource_config(LAYOUT), (), snapshot_dir=str(tmp_path), scheduler_address=address)
    try:
        with pytest.raises(SchedulerLost) as lost:
            with fleet.training():
                os.kill(proc.pid, signal.SIGKILL)
                if ending != "returns":   # at once, as a fetch that met the closed stream does
                    raise CommClosedError("in <TCP ConnectionPool.gather>: Stream is closed")
                assert proc.wait(10) == -signal.SIGKILL   # the client may have seen it go by now
        assert f"the Dask scheduler at {address} is gone" in str(lost.value)
        if ending != "returns":
            assert isinstance(lost.value.__cause__, CommClosedError)
    finally:
        fleet.close()
