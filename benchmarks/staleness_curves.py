"""Does training on stale rollouts learn like on-policy training? Reward curves on the quickstart.

The quickstart task (reward = share of digits in the response, pipeline.rewards.digit_fraction)
with the quickstart's hyperparameters and model, PPO, the same seed, `max_staleness` 0, 1
and 2. Prints the reward of every step for each setting side by side, then one JSON summary
line per run: mean reward of the first and last 8 steps, first step reaching 0.8, the
staleness seen and the mean importance weight of the stale steps.

    PYTHONPATH=$PWD python benchmarks/staleness_curves.py --csv /tmp/curves.csv
    PYTHONPATH=$PWD python benchmarks/staleness_curves.py --seeds 0 1 2 --ablation

The loss is decoupled PPO (AReaL): the clip is centred on the proximal policy (the actor's
weights at the start of the update, log-probs recomputed), and the rollout's own log-probs
(the behaviour policy) enter through the weight min(exp(proximal - behaviour), is_cap).
`--ablation` adds staleness 2 with is_cap=1.0, i.e. weights truncated at 1. That is *not*
"no correction": the code always centres the clip on the recomputed proximal policy and
always applies the weight, so naive PPO on stale data (clip centred on the behaviour
log-probs, no weight) cannot be expressed through the trainer's options.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-file", default=str(ROOT / "examples" / "quickstart.yaml"))
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, help="default: the run file's (40 for the quickstart)")
    parser.add_argument("--seeds", type=int, nargs="+", help="default: the run file's seed")
    parser.add_argument("--ablation", action="store_true", help="also staleness 2 with is_cap=1.0")
    parser.add_argument("--window", type=int, default=8, help="steps averaged for first/last")
    parser.add_argument("--target", type=float, default=0.8, help="reward whose first step is reported")
    parser.add_argument("--csv", help="write every step of every run here")
    return parser.parse_args(argv)


def wait_idle(client, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while any(client.processing().values()) and time.monotonic() < deadline:
        time.sleep(0.2)


def run_curve(cluster, run, reward_fn, *, seed: int, staleness: int, steps: int, is_cap: float | None) -> list:
    from pipeline.models import create_tiny_model
    from pipeline.trainer import HybridTrainer

    train = {k: v for k, v in vars(run.train).items() if k not in ("algorithm", "steps")}
    train.update(seed=seed, max_staleness=staleness)
    if is_cap is not None:
        train["is_cap"] = is_cap
    wait_idle(cluster.client)
    with tempfile.TemporaryDirectory(prefix="dask-rl-curves-") as out:
        # The quickstart's model: `dask-rl run` builds it with the run's seed and default size.
        model = create_tiny_model(Path(out) / "tiny-model", seed=seed)
        trainer = HybridTrainer(str(model), reward_fn, run.resources, algorithm=run.train.algorithm,
                                prompts=run.inputs["prompts"], cluster=cluster, output_dir=out,
                                show_progress=False, **train)
        try:
            return trainer.train(steps)
        finally:
            trainer.close()   # drops the batches still in flight; the shared cluster stays up


def summarise(name: str, seed: int, records: list, window: int, target: float) -> dict:
    rewards = [r.reward_mean for r in records]
    reached = next((r.step for r in records if r.reward_mean >= target), None)
    stale = [r for r in records if r.staleness > 0]
    return {
        "setting": name, "seed": seed, "steps": len(records),
        f"first{window}": round(statistics.fmean(rewards[:window]), 4),
        f"last{window}": round(statistics.fmean(rewards[-window:]), 4),
        f"first_step_reward_ge_{target}": reached,
        "staleness_seen": sorted({r.staleness for r in records}),
        "is_weight_mean_stale_steps": (round(statistics.fmean(r.losses["is_weight_mean"] for r in stale), 4)
                                       if stale else None),
        "is_weight_mean_fresh_steps": (round(statistics.fmean(r.losses["is_weight_mean"] for r in records
                                                              if r.staleness == 0), 4)
                                       if len(stale) < len(records) else None),
        "kl_last": round(records[-1].kl_mean, 4),
        "seconds": round(sum(r.seconds for r in records), 1),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    from pipeline.run_file import load_run_file
    from pipeline.rewards import resolve_reward_function
    from resources.cluster import RoleCluster
    from resources.plan import plan_workers

    run = load_run_file(args.run_file)
    steps = args.steps or run.train.steps
    seeds = args.seeds or [run.train.seed]
    reward_fn = resolve_reward_function(run.inputs["reward_function"])
    settings = [(f"staleness{s}", s, None) for s in args.staleness]
    if args.ablation:
        settings.append(("staleness2_iscap1", 2, 1.0))
    curves: dict[tuple[str, int], list] = {}
    summaries = []
    with RoleCluster(plan_workers(run.resources), dashboard_address=":0") as cluster:
        for seed in seeds:
            for name, staleness, is_cap in settings:
                records = run_curve(cluster, run, reward_fn, seed=seed, staleness=staleness, steps=steps,
                                    is_cap=is_cap)
                curves[name, seed] = records
                summaries.append(summarise(name, seed, records, args.window, args.target))
                print(json.dumps(summaries[-1]), flush=True)

    for seed in seeds:
        names = [name for name, _, _ in settings]
        print(f"\nseed {seed}: reward per step")
        print("step " + " ".join(f"{n:>18}" for n in names))
        for step in range(steps):
            print(f"{step:4d} " + " ".join(f"{curves[n, seed][step].reward_mean:18.3f}" for n in names))
    print()
    for summary in summaries:
        print(json.dumps({"summary": summary}))
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["setting", "seed", "step", "reward", "kl", "staleness", "policy_version",
                             "is_weight_mean", "clip_frac", "policy_loss", "seconds"])
            for (name, seed), records in curves.items():
                for r in records:
                    writer.writerow([name, seed, r.step, f"{r.reward_mean:.5f}", f"{r.kl_mean:.5f}", r.staleness,
                                     r.policy_version, f"{r.losses.get('is_weight_mean', float('nan')):.6f}",
                                     f"{r.losses.get('clip_frac', float('nan')):.5f}",
                                     f"{r.losses.get('policy_loss', float('nan')):.6f}", f"{r.seconds:.3f}"])
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
