"""Per-step timing and the step record that the progress bar, logs and dashboard show."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any


class PhaseTimer:
    """`with timer("generate"): ...` records wall seconds per named phase."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


@dataclass
class StepRecord:
    """What one training step did."""

    step: int
    policy_version: int               # version after this step's update
    reward_mean: float
    kl_mean: float                    # mean per-token log pi_behavior - log pi_ref
    response_length: float            # mean generated tokens per sample
    tokens: int                       # generated tokens trained on
    seconds: float
    staleness: float                  # mean over rows of (version trained - version of the row's first token)
    losses: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)
    reward_std: float = 0.0           # spread of the batch's rewards (population std)
    clipped_fraction: float = 0.0     # share of responses cut at max_new_tokens without a stop
    # Work the workers made smaller to fit GPU memory during the step, one line each
    # ("role: what: before -> after unit (cause: detail)"), and how many of them an
    # out-of-memory error forced (the others were planned smaller from a memory reading).
    degradations: list[str] = field(default_factory=list)
    oom_backoffs: int = 0
    dropped_samples: int = 0          # samples left out as bad (train.reward_errors: skip)
    samples: list[dict] = field(default_factory=list)   # a few {"prompt", "response", "reward"} rows
    rewards: dict[str, dict[str, float]] = field(default_factory=dict)  # reward name -> {"mean", "std"}
    # train.filter_groups: groups left out as all-equal, and extra draws of prompts made.
    uninformative_groups: int = 0
    extra_draws: int = 0
    evaluation: dict[str, float] = field(default_factory=dict)  # "eval/..." figures finished during the step
    staleness_max: int = 0            # the oldest row's (max_staleness bounds it)
    carried_rows: int = 0             # train.partial_rollouts: unfinished rows the next step continues
    rows: int = 0                     # samples trained on (response_length is their mean length)

    def figures(self) -> dict[str, float]:
        """The step's numbers, flat: a line of metrics.jsonl, a TensorBoard scalar each."""
        return {"step": self.step, "policy_version": self.policy_version, "reward": self.reward_mean,
                "kl": self.kl_mean, "response_length": self.response_length, "tokens": self.tokens,
                "tokens_per_second": self.tokens_per_second, "seconds": self.seconds,
                "staleness": self.staleness, "staleness_max": self.staleness_max, "carried_rows": self.carried_rows,
                "rows": self.rows,
                "clipped_fraction": self.clipped_fraction, "dropped_samples": self.dropped_samples,
                "oom_backoffs": self.oom_backoffs, "uninformative_groups": self.uninformative_groups,
                "extra_draws": self.extra_draws, **self.losses,
                **{f"seconds_{phase}": value for phase, value in self.phases.items()},
                **{f"rewards/{name}/{stat}": value for name, stats in self.rewards.items()
                   for stat, value in stats.items()},
                **self.evaluation}

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def as_dict(self) -> dict[str, Any]:
        """Every field plus tokens_per_second: what the dashboard and /metrics are sent."""
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}

    def summary(self) -> dict[str, str]:
        """The progress bar's postfix."""
        shown = {"reward": f"{self.reward_mean:.3f}", "kl": f"{self.kl_mean:.4f}",
                 "tok/s": f"{self.tokens_per_second:.0f}", "v": str(self.policy_version)}
        return {**shown, "dropped": str(self.dropped_samples)} if self.dropped_samples else shown


def reward_figures(components: dict) -> dict[str, dict[str, float]]:
    """Each reward's mean and population std over the samples it applied to (NaN: None)."""
    figures = {}
    for name, values in components.items():
        applied = values[values.isfinite()].float()
        figures[name] = ({"mean": float(applied.mean()), "std": float(applied.std(correction=0))} if len(applied)
                         else {"mean": float("nan"), "std": float("nan")})
    return figures


def sum_stats(items) -> dict[str, float]:
    totals: dict[str, float] = {}
    for stats in items:
        for key, value in stats.items():
            totals[key] = totals.get(key, 0.0) + value
    return totals


def normalise_update_stats(totals: dict[str, float], optimizer_steps: int) -> dict[str, float]:
    """Token-weighted sums -> fractions; per-step sums -> means over the optimizer steps."""
    tokens = max(totals.pop("tokens", 0.0), 1.0)
    out = {key: value / optimizer_steps for key, value in totals.items()}
    if "clip_tokens" in out:
        out["clip_frac"] = totals["clip_tokens"] / tokens
        out["is_weight_mean"] = totals.pop("is_weight_sum") / tokens
        out.pop("clip_tokens")
        out.pop("is_weight_sum", None)
    # Per-token means: the share of tokens the dual clip bounded, the policy's entropy.
    for summed, mean in (("clip_lower_tokens", "clip_frac_lower"), ("entropy_sum", "entropy")):
        if summed in out:
            out[mean] = totals[summed] / tokens
            out.pop(summed)
    return out
