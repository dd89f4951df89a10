"""Step time, tokens/s and each role's idle fraction with and without pipelining.

The same PPO work (the quickstart layout: one CPU worker per role) runs with
`max_staleness` 0 (synchronous: generate, score, then update), 1 and 2 (the next one or
two batches generate and are scored while the actor updates). One JSON line per run, then
one summary line per setting over the repeats, then the synchronous phase times and the
target: with overlap the step time should approach max(rollout, update), not their sum.

    PYTHONPATH=$PWD python benchmarks/pipeline_overlap.py                 # ~5 min on 2 cores
    PYTHONPATH=$PWD python benchmarks/pipeline_overlap.py --steps 4 --repeats 1 --hidden 64

Idle fraction of a role = 1 - (compute seconds of the role's tasks inside the measured
window) / (window seconds x the role's worker count), from the scheduler's task stream;
the key prefix of a task ("rollout-", "reward-", "reference-", "critic-", "actor-") names
its role. The first `--warmup` steps of each setting are not measured (model load on the
workers, filling the pipeline). One cluster serves every setting.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROLES = ("rollout", "reward", "reference", "critic", "actor")
ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-file", default=str(ROOT / "examples" / "quickstart.yaml"),
                        help="layout and hyperparameters (default: the quickstart)")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=6, help="measured steps per setting")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps per setting")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each setting (timings are noisy)")
    parser.add_argument("--hidden", type=int, default=128, help="tiny model hidden size")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--prompts-per-step", type=int, default=64)
    parser.add_argument("--ppo-epochs", type=int, help="default: the run file's")
    parser.add_argument("--micro-batch-size", type=int, help="default: the run file's")
    return parser.parse_args(argv)


def role_busy(client, start: float, stop: float) -> dict[str, float]:
    """Compute seconds per role inside [start, stop], from the scheduler's task stream."""
    busy = dict.fromkeys(ROLES, 0.0)
    for task in client.get_task_stream(start=start - 600):
        role = str(task["key"]).split("-", 1)[0]
        if role not in busy:
            continue
        for part in task.get("startstops", ()):
            if part["action"] == "compute":
                busy[role] += max(0.0, min(part["stop"], stop) - max(part["start"], start))
    return busy


def _cpu_seconds() -> float:
    """Runs on a worker: CPU seconds its process has used (user + system)."""
    import psutil

    times = psutil.Process().cpu_times()
    return times.user + times.system


def role_cpu(cluster) -> dict[str, float]:
    """CPU seconds used so far by each role's worker processes (contention does not inflate it)."""
    used = cluster.client.run(_cpu_seconds)
    return {role: sum(used.get(w["address"], 0.0) for w in cluster.workers_of(role)) for role in ROLES}


def wait_idle(client, timeout: float = 300.0) -> None:
    """Until no worker runs or holds a task (the previous setting's leftovers end)."""
    deadline = time.monotonic() + timeout
    while any(client.processing().values()) and time.monotonic() < deadline:
        time.sleep(0.2)


def run_setting(cluster, run, model_dir: str, reward_fn, train: dict, staleness: int, args) -> dict:
    from pipeline.trainer import HybridTrainer

    client = cluster.client
    wait_idle(client)
    with tempfile.TemporaryDirectory(prefix="dask-rl-overlap-") as out:
        trainer = HybridTrainer(model_dir, reward_fn, run.resources, algorithm=run.train.algorithm,
                                prompts=run.inputs["prompts"], cluster=cluster, output_dir=out,
                                show_progress=False, **{**train, "max_staleness": staleness})
        try:
            for _ in range(args.warmup):
                trainer.step()
            cpu_before, load_before = role_cpu(cluster), os.getloadavg()[0]
            start = time.time()
            records = [trainer.step() for _ in range(args.steps)]
            stop = time.time()
            cpu_after, load_after = role_cpu(cluster), os.getloadavg()[0]
        finally:
            trainer.close()   # drops the batches still in flight; the shared cluster stays up
    wall = stop - start
    workers = {role: max(1, len(cluster.workers_of(role))) for role in ROLES}
    busy = role_busy(client, start, stop)
    phases = {name: statistics.fmean(r.phases.get(name, 0.0) for r in records)
              for name in ("wait_rollout", "wait_scores", "advantages", "update")}
    del trainer
    gc.collect()
    return {
        "max_staleness": staleness,
        "step_s": wall / len(records),
        "tokens_per_s": sum(r.tokens for r in records) / wall,
        "idle": {role: 1.0 - busy[role] / (wall * workers[role]) for role in ROLES},
        "busy_per_step_s": {role: busy[role] / len(records) for role in ROLES},
        # CPU seconds per step of each role's processes: the work itself, whatever else runs.
        "cpu_per_step_s": {role: (cpu_after[role] - cpu_before[role]) / len(records) for role in ROLES},
        "loadavg_1min": [load_before, load_after],
        "phases_s": phases,
        "staleness_seen": sorted({r.staleness for r in records}),
        "reward_mean": statistics.fmean(r.reward_mean for r in records),
    }


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def main(argv=None) -> int:
    args = parse_args(argv)
    from pipeline.run_file import load_run_file
    from pipeline.models import create_tiny_model
    from pipeline.rewards import resolve_reward_function
    from resources.cluster import RoleCluster
    from resources.plan import plan_workers

    run = load_run_file(args.run_file)
    train = {k: v for k, v in vars(run.train).items() if k not in ("algorithm", "max_staleness")}
    train.update(max_new_tokens=args.max_new_tokens, prompts_per_step=args.prompts_per_step)
    if args.ppo_epochs:
        train["ppo_epochs"] = args.ppo_epochs
    if args.micro_batch_size:
        train["micro_batch_size"] = args.micro_batch_size
    reward_fn = resolve_reward_function(run.inputs["reward_function"])
    model_root = Path(tempfile.mkdtemp(prefix="dask-rl-overlap-model-"))
    model_dir = str(create_tiny_model(model_root / "model", hidden_size=args.hidden, layers=args.layers,
                                      seed=run.train.seed))
    print(json.dumps({"config": {"run_file": args.run_file, "hidden": args.hidden, "layers": args.layers,
                                 "max_new_tokens": args.max_new_tokens, "prompts_per_step": args.prompts_per_step,
                                 "ppo_epochs": train["ppo_epochs"], "micro_batch_size": train["micro_batch_size"],
                                 "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats}}), flush=True)
    results: dict[int, list[dict]] = {s: [] for s in args.staleness}
    cluster = RoleCluster(plan_workers(run.resources), dashboard_address=":0")
    try:
        cluster.client.get_task_stream(start=time.time())   # starts the scheduler's task-stream record
        for repeat in range(args.repeats):
            for staleness in args.staleness:   # interleaved, so drifting load hits every setting alike
                result = run_setting(cluster, run, model_dir, reward_fn, train, staleness, args)
                results[staleness].append(result)
                print(json.dumps({"repeat": repeat, **_rounded(result)}), flush=True)
    finally:
        cluster.close()
        shutil.rmtree(model_root, ignore_errors=True)

    for staleness, runs in results.items():
        print(json.dumps(_rounded({
            "summary": staleness, "step_s": spread([r["step_s"] for r in runs]),
            "tokens_per_s": spread([r["tokens_per_s"] for r in runs]),
            "cpu_per_step_s": spread([sum(r["cpu_per_step_s"].values()) for r in runs]),
            "idle": {role: spread([r["idle"][role] for r in runs]) for role in ROLES}})), flush=True)
    if 0 in results:
        # The synchronous step, phase by phase: the rollout side (generate, then score) and the
        # update side can overlap; the ideal pipelined step is the larger of the two.
        sync = results[0]
        generate = statistics.fmean(r["phases_s"]["wait_rollout"] for r in sync)
        score = statistics.fmean(r["phases_s"]["wait_scores"] for r in sync)
        update = statistics.fmean(r["phases_s"]["update"] for r in sync)
        step = statistics.fmean(r["step_s"] for r in sync)
        cpu = statistics.fmean(sum(r["cpu_per_step_s"].values()) for r in sync)
        line = {"sync_phases": {"rollout_s": generate, "scoring_s": score, "update_s": update, "step_s": step},
                "ideal_max_rollout_update_s": max(generate, update),
                "ideal_max_rollout_plus_scoring_update_s": max(generate + score, update),
                "sum_s": generate + score + update,
                # With fewer cores than busy roles, overlap cannot beat the CPU work / cores.
                "cpu_work_per_step_s": cpu, "cores": os.cpu_count(),
                "cpu_bound_s": cpu / (os.cpu_count() or 1)}
        for staleness, runs in results.items():
            if staleness:
                line[f"staleness_{staleness}_step_s"] = statistics.fmean(r["step_s"] for r in runs)
        print(json.dumps(_rounded(line)), flush=True)
    return 0


def _rounded(value):
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
