"""Held-out evaluation: the eval prompts generated and scored as futures on the rollout and
reward roles, beside training (at a lower priority), never a pause of the loop.

Every `eval_every_n_steps` steps (and before the first with `eval_before_train`) the
current policy samples each eval prompt `eval_samples_per_prompt` times (greedy at
`eval_temperature: 0`); the step goes on, and the figures are read once the futures are
done: each reward's mean, the weighted reward's mean, and, counting a sample as correct
when its reward is at least `eval_correct_reward`, accuracy (the share of correct samples),
pass@1 (the mean over prompts of c/n) and pass@n (the share of prompts with a correct sample).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from pipeline.config import TrainConfig
from pipeline.data import PromptStream
from pipeline.records import GenerationRequest, RewardInputs, Scores, join_scores
from pipeline.roles import reward, rollout

logger = logging.getLogger("dask_rl")
# Eval tasks yield to the training's: Dask runs higher priorities first on a busy worker.
EVAL_PRIORITY = -10


@dataclass
class PendingEval:
    step: int                 # the step whose weights are evaluated (steps done before it)
    version: int
    submitted: float
    rollouts: list = field(default_factory=list)
    scores: list = field(default_factory=list)

    @property
    def futures(self) -> list:
        return self.rollouts + self.scores


class Evaluation:
    def __init__(self, fleet, prompts: PromptStream, train_config: TrainConfig, stop_token_ids: tuple[int, ...] = ()):
        self.fleet, self.prompts, self.train_config = fleet, prompts, train_config
        self.stop_token_ids = stop_token_ids
        self.pending: list[PendingEval] = []

    def due(self, steps_done: int, first: bool) -> bool:
        tc = self.train_config
        if first and tc.eval_before_train:
            return True
        return tc.eval_every_n_steps > 0 and steps_done > 0 and steps_done % tc.eval_every_n_steps == 0

    def submit(self, steps_done: int, version: int, weights) -> None:
        """Generate and score every eval prompt with the weights of `version`."""
        tc, fleet = self.train_config, self.fleet
        ids = self.prompts.token_ids
        draws = list(range(len(ids)))  # every eval prompt once, in file order: its index is its group id
        n_shards = max(1, min(len(fleet.addresses("rollout")), len(ids)))
        pending = PendingEval(steps_done, version, time.perf_counter())
        greedy = tc.eval_temperature == 0
        for shard in range(n_shards):
            mine = draws[shard::n_shards]
            request = GenerationRequest(
                prompt_ids=[ids[d] for d in mine], group_ids=mine, samples_per_prompt=tc.eval_samples_per_prompt,
                max_new_tokens=tc.max_new_tokens, seed=tc.seed * 7_919 + steps_done * 1009 + shard,
                stop_token_ids=self.stop_token_ids, stop_strings=tc.stop,
                # Greedy is sampling the most likely token alone (top-k 1); else the run's filters.
                **({"temperature": 1.0, "top_k": 1} if greedy else
                   {"temperature": tc.eval_temperature, "top_k": tc.top_k, "top_p": tc.top_p, "min_p": tc.min_p}))
            tag = f"eval{steps_done}-{shard}"
            generated = fleet.submit("rollout", rollout.generate, request, weights, tag=tag, priority=EVAL_PRIORITY)
            rows = [self.prompts.rows[d] for d in mine] if self.prompts.rows else None
            inputs = RewardInputs({d: r.prompt for d, r in zip(mine, rows)},
                                  {d: r.fields for d, r in zip(mine, rows)}) if rows else None
            pending.rollouts.append(generated)
            pending.scores.append(fleet.submit("reward", reward.score, generated, inputs, tag=tag,
                                               priority=EVAL_PRIORITY))
        self.pending.append(pending)

    def finished(self, wait: bool = False) -> list[dict[str, float]]:
        """The figures of every evaluation whose futures are done (all of them with `wait`)."""
        done = [p for p in self.pending if wait or all(f.done() for f in p.futures)]
        self.pending = [p for p in self.pending if p not in done]
        results = []
        for pending in done:
            groups = torch.cat([r.group_ids for r in self.fleet.wait("rollout", pending.rollouts, "evaluation rollouts")])
            scores = join_scores(self.fleet.wait("reward", pending.scores, "evaluation rewards"))
            results.append({"eval/step": pending.step, "eval/policy_version": pending.version,
                            **eval_figures(scores, groups, self.train_config),
                            "eval/seconds": time.perf_counter() - pending.submitted})
        for pending in done:
            self.fleet.client.cancel(pending.futures)  # results read: free them on the workers
        return results

    def cancel(self) -> None:
        for pending in self.pending:
            self.fleet.client.cancel(pending.futures)
        self.pending.clear()


def eval_figures(scores: Scores, group_ids: torch.Tensor, tc: TrainConfig) -> dict[str, float]:
    """Per-reward means, the weighted reward's mean, accuracy, pass@1 and pass@n.

    `group_ids` (B,) names each sample's prompt; a sample a reward could not score counts as
    not correct."""
    n = tc.eval_samples_per_prompt
    values = scores.values
    correct = torch.where(values.isfinite(), values >= tc.eval_correct_reward, torch.zeros((), dtype=torch.bool))
    per_prompt = correct[group_ids.argsort(stable=True)].view(-1, n).float()
    figures = {"eval/reward": _nanmean(values), "eval/accuracy": float(correct.float().mean()),
               "eval/pass@1": float(per_prompt.mean(dim=1).mean()),
               f"eval/pass@{n}": float(per_prompt.max(dim=1).values.mean()),
               "eval/samples": float(len(values))}
    for name, component in scores.components.items():
        figures[f"eval/rewards/{name}/mean"] = _nanmean(component)
    return figures


def _nanmean(values: torch.Tensor) -> float:
    finite = values[values.isfinite()]
    return float(finite.mean()) if len(finite) else math.nan
