"""Move a role's devices while training runs; print per-step throughput and the change.

For each change: seconds from update_resource to the new workers' first task (their
readiness task: model loaded, current weights loaded) and to the end of the change (old
workers drained and retired). For each step: version, seconds and tokens/s, so a lost or
repeated step, or a stall, shows.

    python benchmarks/elastic_scaling.py examples/quickstart.yaml --role rollout \\
        --move 4:workers=2 --move 10:workers=1                       # CPU: grow, then shrink
    python benchmarks/elastic_scaling.py examples/elastic_gpu.yaml --role reference \\
        --move 4:cuda=0 --move 12:cpu=1                              # GPU: onto GPU 0 and back
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path


def parse_move(text: str) -> tuple[int, dict]:
    step, _, what = text.partition(":")
    key, _, value = what.partition("=")
    if key == "workers":
        return int(step), {"workers": int(value)}
    if key == "cuda":
        return int(step), {"device_type": "cuda", "device_ids": [int(v) for v in value.split(",")]}
    if key == "cpu":
        return int(step), {"device_type": "cpu", "workers": int(value)}
    raise SystemExit(f"--move {text!r}: use STEP:workers=N, STEP:cuda=ID[,ID] or STEP:cpu=N")


def main() -> None:
    from pipeline.run_file import load_run_file
    from pipeline.models import create_tiny_model
    from pipeline.rewards import resolve_reward_function
    from pipeline.trainer import HybridTrainer

    parser = argparse.ArgumentParser()
    parser.add_argument("run_file")
    parser.add_argument("--role", required=True)
    parser.add_argument("--move", action="append", default=[], help="STEP:workers=N | STEP:cuda=ID | STEP:cpu=N")
    parser.add_argument("--steps", type=int)
    args = parser.parse_args()
    run = load_run_file(args.run_file)
    out = Path(tempfile.mkdtemp(prefix="dask-rl-elastic-"))
    model = str(create_tiny_model(out / "tiny", seed=run.train.seed))
    train = {k: v for k, v in vars(run.train).items() if k != "algorithm"}
    if args.steps:
        train["steps"] = args.steps
    trainer = HybridTrainer(model, resolve_reward_function(run.inputs["reward_function"]), run.resources,
                            algorithm=run.train.algorithm, prompts=run.inputs["prompts"], output_dir=str(out),
                            dashboard_address=":0", show_progress=False, **train)
    moves = sorted(parse_move(m) for m in args.move)

    def mover():
        for at_step, request in moves:
            while len(trainer.history) < at_step:
                time.sleep(0.01)
            called = time.perf_counter()
            for change in trainer.update_resource(args.role, **request):
                print(json.dumps({"change": str(change), "at_step": at_step, "request": request,
                                  "to_first_task_s": round(change.ready_seconds, 2),
                                  "whole_change_s": round(time.perf_counter() - called, 2)}), flush=True)

    thread = threading.Thread(target=mover)
    thread.start()
    start = time.perf_counter()

    def report(record):
        print(json.dumps({"step": record.step, "version": record.policy_version, "seconds": round(record.seconds, 3),
                          "tokens_per_second": round(record.tokens_per_second), "reward": round(record.reward_mean, 3),
                          "workers": [w["name"] for w in trainer.fleet.cluster.workers_of(args.role)]}), flush=True)

    trainer.train(on_step=report)
    thread.join()
    versions = [r.policy_version for r in trainer.history]
    print(json.dumps({"steps": len(versions), "versions_consecutive": versions == list(range(1, len(versions) + 1)),
                      "train_seconds": round(time.perf_counter() - start, 1)}))
    trainer.close()


if __name__ == "__main__":
    main()
