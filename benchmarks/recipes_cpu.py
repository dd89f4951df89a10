"""Does each algorithm recipe learn? The quickstart task, one short CPU run per recipe.

The quickstart's task ("answer with digits": reward = share of digits in the response,
pipeline.rewards.digit_fraction), model (the tiny local Qwen2-architecture model, seed 0)
and cluster (examples/quickstart.yaml: one CPU worker per role), 32 samples per step. Each
recipe is the `train:` keys of README "Algorithm options"; PPO is the quickstart's own
settings. Prints one JSON line per recipe: the mean reward of the first and last `--window`
steps, the first and last step's reward, the last step's entropy and the seconds taken.

    PYTHONPATH=$PWD python benchmarks/recipes_cpu.py                  # every recipe
    PYTHONPATH=$PWD python benchmarks/recipes_cpu.py --recipes gspo rloo --steps 20

DAPO runs with clip-higher, token-mean and dynamic sampling (filter_groups); not with the
overlong filter: the quickstart's responses nearly all run to max_new_tokens, so it would take
almost every response out of the loss.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Group-based recipes: 8 prompts x 4 samples = 32 rows a step, like the PPO quickstart's 32 x 1.
GROUPS = dict(algorithm="grpo", prompts_per_step=8, samples_per_prompt=4)
RECIPES: dict[str, dict] = {
    "ppo": dict(algorithm="ppo"),
    "grpo": dict(GROUPS, kl_coef=0.01),
    "dr_grpo": dict(GROUPS, kl_coef=0.0, advantage="grpo_no_std", loss_agg_mode="seq-mean-token-sum-norm"),
    "dapo": dict(GROUPS, kl_coef=0.0, clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean",
                 lr_warmup_steps=2, filter_groups=True),
    "gspo": dict(GROUPS, kl_coef=0.0, policy_loss="gspo", loss_agg_mode="seq-mean-token-mean",
                 clip_ratio_low=0.0003, clip_ratio_high=0.0004),
    "rloo": dict(GROUPS, kl_coef=0.01, advantage="rloo"),
    "reinforce_plus_plus": dict(GROUPS, kl_coef=0.01, advantage="reinforce_plus_plus"),
    "reinforce_plus_plus_baseline": dict(GROUPS, kl_coef=0.01, advantage="reinforce_plus_plus_baseline"),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-file", default=str(ROOT / "examples" / "quickstart.yaml"))
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--window", type=int, default=5, help="steps averaged for first/last")
    return parser.parse_args(argv)


def run_recipe(cluster, run, reward_fn, recipe: dict, steps: int) -> list:
    from pipeline.models import create_tiny_model
    from pipeline.trainer import HybridTrainer

    train = {k: v for k, v in vars(run.train).items() if k not in ("algorithm", "steps")}
    train.update(recipe, steps=steps)
    with tempfile.TemporaryDirectory(prefix="dask-rl-recipes-") as out:
        model = create_tiny_model(Path(out) / "tiny-model", seed=train["seed"])  # the quickstart's model
        trainer = HybridTrainer(str(model), reward_fn, run.resources, prompts=run.inputs["prompts"],
                                cluster=cluster, output_dir=out, show_progress=False, **train)
        try:
            return trainer.train()
        finally:
            trainer.close()   # the shared cluster stays up for the next recipe


def summarise(name: str, records: list, window: int, seconds: float) -> dict:
    rewards = [r.reward_mean for r in records]
    return {"recipe": name, "steps": len(records),
            f"first{window}_mean_reward": round(statistics.fmean(rewards[:window]), 3),
            f"last{window}_mean_reward": round(statistics.fmean(rewards[-window:]), 3),
            "first_step_reward": round(rewards[0], 3), "last_step_reward": round(rewards[-1], 3),
            "last_entropy": round(records[-1].losses["entropy"], 3), "seconds": round(seconds, 1)}


def main(argv=None) -> int:
    args = parse_args(argv)
    from pipeline.run_file import load_run_file
    from pipeline.rewards import resolve_reward_function
    from resources.cluster import RoleCluster
    from resources.plan import plan_workers

    run = load_run_file(args.run_file)
    reward_fn = resolve_reward_function(run.inputs["reward_function"])
    summaries = []
    with RoleCluster(plan_workers(run.resources), dashboard_address=":0") as cluster:
        for name in args.recipes:
            start = time.perf_counter()
            records = run_recipe(cluster, run, reward_fn, RECIPES[name], args.steps)
            summaries.append(summarise(name, records, args.window, time.perf_counter() - start))
            print(json.dumps(summaries[-1]), flush=True)
    learned = [s["recipe"] for s in summaries
               if s[f"last{args.window}_mean_reward"] > s[f"first{args.window}_mean_reward"] + 0.2]
    rest = [s["recipe"] for s in summaries if s["recipe"] not in learned]
    print(json.dumps({"learned": learned, "not_learned": rest}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
