"""The kill drill: kill -9 an actor worker while a step's rollout generates, over and over,
with busy loops competing for the CPU, and count the runs that did not finish.

Each run trains a few GRPO steps on one cluster (two DDP actor ranks); once the first update
is in, an actor rank is killed as soon as a rollout task is running. Its Nanny starts a
replacement, which resumes the recovery state, and the run must end with consecutive
versions. A run that fails is printed with its error; the cluster is then started afresh.

    PYTHONPATH=$PWD python benchmarks/kill_drill.py --runs 20 --busy 2

The Nannies run in this process, so their INFO lines ("Restarting worker", "Closing Nanny")
are printed too: the evidence when a worker does not come back.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import random
import signal
import tempfile
import threading
import time
import traceback

from pipeline.models import create_tiny_model
from pipeline.rewards import digit_fraction
from pipeline.roles.host import worker_identity
from pipeline.fleet.tasks import submit
from pipeline.trainer import HybridTrainer
from resources import load_resource_config
from resources.cluster import RoleCluster
from resources.plan import plan_workers

# GRPO without a reference (kl_coef 0): the actor's two ranks, one rollout and one reward
# worker, so a run is a few seconds and the kill is most of what it measures.
LAYOUT = {
    "actor": {"device_type": "cpu", "workers": 2, "strategy": "ddp"},
    "reward": {"device_type": "cpu", "workers": 1},
    "rollout": {"device_type": "cpu", "workers": 1},
    "timeout_seconds": 60,
}
GRPO = dict(algorithm="grpo", samples_per_prompt=2, prompts_per_step=4, max_new_tokens=16, actor_lr=1e-2,
            kl_coef=0.0, micro_batch_size=4, show_progress=False, seed=3)
PROMPTS = [f"what is {a} plus {b}? answer: " for a in range(8) for b in range(4)]


def busy_loop() -> None:
    """Competing CPU load: a process that never sleeps."""
    while True:
        pass


def actor_pids(cluster: RoleCluster) -> list[int]:
    return [submit(cluster.client, "actor", worker_identity, workers=[w["address"]]).result(60)["pid"]
            for w in cluster.workers_of("actor")]


def kill_during_rollout(cluster: RoleCluster, trainer: HybridTrainer, pid: int) -> threading.Thread:
    """Kill `pid` once v1 is published and a rollout task runs (the next step's generation)."""
    def rollout_of_a_later_step() -> bool:
        if trainer.fleet.version < 1:
            return False
        return any(str(k).startswith("rollout-generate") for keys in cluster.client.processing().values()
                   for k in keys)

    def watch():
        deadline = time.monotonic() + 120
        while not rollout_of_a_later_step():
            if time.monotonic() > deadline:
                return  # the run ended first: one_run reports that the kill never came
            time.sleep(0.01)
        time.sleep(random.uniform(0.0, 0.2))  # anywhere in the generation, or just after it
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=watch, daemon=True, name="kill-drill")
    killer.start()
    return killer


def one_run(cluster: RoleCluster, model: str, steps: int) -> str | None:
    """None when the run ended with consecutive versions; else what went wrong."""
    pid = random.choice(actor_pids(cluster))
    trainer = HybridTrainer(model, digit_fraction, load_resource_config(LAYOUT), prompts=PROMPTS,
                            cluster=cluster, steps=steps, **GRPO)
    try:
        killer = kill_during_rollout(cluster, trainer, pid)
        records = trainer.train()
        killer.join(timeout=1)
        versions = [r.policy_version for r in records]
        if versions != list(range(1, steps + 1)):
            return f"versions {versions}"
        if pid in actor_pids(cluster):
            return "the kill did not come during the run"
        return None
    except Exception as error:  # noqa: BLE001 - counted and printed: the drill goes on
        traceback.print_exc()
        return f"{type(error).__name__}: {error}"
    finally:
        trainer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--busy", type=int, default=2, help="busy-loop processes competing for the CPU")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("distributed.nanny").setLevel(logging.INFO)
    hogs = [multiprocessing.Process(target=busy_loop, daemon=True) for _ in range(args.busy)]
    for hog in hogs:
        hog.start()
    failures = []
    with tempfile.TemporaryDirectory() as scratch:
        model = create_tiny_model(f"{scratch}/tiny")
        cluster = None
        try:
            for run in range(1, args.runs + 1):
                if cluster is None:
                    cluster = RoleCluster(plan_workers(load_resource_config(LAYOUT)), dashboard_address=":0")
                start = time.monotonic()
                problem = one_run(cluster, model, args.steps)
                print(f"run {run}: {'ok' if problem is None else 'FAILED: ' + problem} "
                      f"({time.monotonic() - start:.0f}s, load {os.getloadavg()[0]:.1f})", flush=True)
                if problem is not None:
                    failures.append((run, problem))
                    cluster.close()  # a worker may be gone for good: the next run starts afresh
                    cluster = None
        finally:
            if cluster is not None:
                cluster.close()
            for hog in hogs:
                hog.terminate()
    print(f"{len(failures)} of {args.runs} runs failed" + "".join(f"\n  run {r}: {p}" for r, p in failures))


if __name__ == "__main__":
    main()
