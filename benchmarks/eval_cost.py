"""What held-out evaluation costs a training step: the same run with and without it, side by side.

examples/answers_cpu.yaml's task and settings (the tiny chat model, "repeat the digit", its
two rewards) for `--steps` steps, once with `eval_every_n_steps: --every` (greedy, every eval
prompt once) and once without, on one cluster of the example's workers. Prints one JSON
line per run: median and mean step seconds, and the evaluations' own wall seconds.

    PYTHONPATH=$PWD python benchmarks/eval_cost.py --steps 60 --every 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cluster, run_file, train: dict, steps: int) -> dict:
    from pipeline.cli import _reward_function
    from pipeline.models import create_tiny_model
    from pipeline.rewards import resolve_reward_function
    from pipeline.trainer import HybridTrainer

    rewards = [_reward_function(spec, resolve_reward_function) for spec in run_file.inputs["reward_function"]]
    with tempfile.TemporaryDirectory(prefix="dask-rl-eval-cost-") as out:
        model = create_tiny_model(Path(out) / "model", chat=True, seed=train["seed"])
        with HybridTrainer(str(model), rewards, run_file.resources, prompts=run_file.inputs["prompts"],
                           eval_prompts=run_file.inputs["eval_prompts"], cluster=cluster, output_dir=out,
                           show_progress=False, **{**train, "steps": steps}) as trainer:
            history = trainer.train()
            lines = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    seconds = [r.seconds for r in history[1:]]   # the first step also pays for compiling and warm-up
    evals = [line["eval/seconds"] for line in lines if "eval/seconds" in line]
    return {"eval_every_n_steps": train["eval_every_n_steps"], "steps": len(history),
            "median_step_s": round(statistics.median(seconds), 3), "mean_step_s": round(statistics.fmean(seconds), 3),
            "evaluations": len(evals), "eval_wall_s_median": round(statistics.median(evals), 3) if evals else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=5, help="eval_every_n_steps of the run with evaluation")
    args = parser.parse_args(argv)
    from pipeline.run_file import load_run_file
    from resources.cluster import RoleCluster
    from resources.plan import plan_workers

    run_file = load_run_file(ROOT / "examples" / "answers_cpu.yaml")
    base = {k: v for k, v in vars(run_file.train).items()}
    with RoleCluster(plan_workers(run_file.resources), dashboard_address=":0") as cluster:
        for every in (0, args.every, 0, args.every):   # interleaved: drift in the machine's load hits both
            train = {**base, "eval_every_n_steps": every, "eval_before_train": False}
            print(json.dumps(run(cluster, run_file, train, args.steps)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
