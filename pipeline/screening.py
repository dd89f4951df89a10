"""Samples that must not reach an update: found on the driver, dropped or refused before
the update is submitted (pure code on small CPU tensors).

A sample is bad when a role could not give it finite numbers: its reward (a raising reward
function, a wrong type, NaN from a reward model: the reward role reports these with the
texts and the original error), the rollout's or the reference's log-probs or the critic's
values on its response tokens, or, once built, its advantages or returns. One NaN that
reached the loss would make every weight of the published policy NaN.
`train.reward_errors` says what happens to them:

- "skip" (the default): bad samples are dropped, each logged with the role, its prompt and
  response cut short and the original error, and counted (StepRecord.dropped_samples).
  GRPO drops the whole group of a bad sample: advantages are relative to the group, and a
  group with a row missing would get its baseline from the wrong rows. PPO drops that row.
- "raise": the first bad sample fails the step with a BadSampleError naming it.

Either way, a batch with too little left to train on fails the step with a BadSampleError
naming the role and one sample; nothing is published, so the last good version stays.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from pipeline.experience import build_experience
from pipeline.records import SHOWN_TEXT, Experience, Rollout, SampleProblem, Scores
from resources.config import shorten

logger = logging.getLogger("dask_rl")

WARN_LIMIT = 3     # samples logged one by one per step; the rest are counted
# The per-token inputs of the experience and the role that computed each.
PER_TOKEN_ROLES = {"behavior_logprobs": "rollout", "ref_logprobs": "reference", "values": "critic"}


class BadSampleError(ValueError):
    """A step refused because of its samples; the message names the role, a sample and the fix."""


@dataclass(frozen=True)
class SampleScreen:
    """How one step treats bad samples."""

    on_error: str = "skip"                 # train.reward_errors: "skip" or "raise"
    by_group: bool = False                 # GRPO: a bad sample takes its group with it
    min_rows: int = 1                      # rows the update needs (mini-batches x ranks)
    decode: Callable[[list[int]], str] | None = None  # token ids -> text, for samples a role did not decode


def select_samples(rows: torch.Tensor, rollout: Rollout, scores: Scores, per_token: dict[str, torch.Tensor]
                   ) -> tuple[Rollout, Scores, dict[str, torch.Tensor]]:
    """The samples `rows` (a 1-D index tensor) of a step's rollout, scores and per-token values."""
    return rollout.select(rows), scores.select(rows), {k: v[rows] for k, v in per_token.items()}


def screen_samples(rollout: Rollout, scores: Scores, per_token: dict[str, torch.Tensor], screen: SampleScreen
                   ) -> tuple[Rollout, Scores, dict[str, torch.Tensor], int]:
    """(rollout, scores (B' rows), per_token, dropped): the step's samples without the bad ones.

    `per_token` holds (B, R) tensors such as ref_logprobs and values; a sample is bad when
    the reward role reported it or a per-token value on its response tokens is not finite.
    """
    problems = list(scores.problems) + _non_finite(rollout, {"behavior_logprobs": rollout.behavior_logprobs,
                                                             **per_token})
    rows = _kept_rows(rollout, problems, screen)
    return (*select_samples(rows, rollout, scores, per_token), len(rollout) - len(rows))


def checked_experience(rollout: Rollout, scores: torch.Tensor, ref_logprobs: torch.Tensor,
                       values: torch.Tensor | None, screen: SampleScreen, **build
                       ) -> tuple[Experience, dict[str, float]]:
    """build_experience(...), with the samples whose advantages or returns are not finite
    dropped (then built again: whitening must not see them) or refused. The stats count
    them as "dropped_samples"."""
    experience, stats = build_experience(rollout, scores, ref_logprobs, values, **build)
    bad = _bad_rows(experience)
    if bad.any():
        problems = [SampleProblem(int(row), "advantages", "its advantages or returns are not finite (inputs "
                                  "finite: a value overflowed)") for row in bad.nonzero().flatten()]
        rows = _kept_rows(rollout, problems, screen)
        experience, stats = build_experience(rollout.select(rows), scores[rows], ref_logprobs[rows],
                                             None if values is None else values[rows], **build)
        if _bad_rows(experience).any():
            raise BadSampleError(f"advantages: not finite even without the {len(rollout) - len(rows)} samples "
                                 f"that overflowed. Fix: lower the reward scale or train.gamma; nothing was "
                                 f"published")
        stats["dropped_samples"] = len(rollout) - len(rows)
    stats.setdefault("dropped_samples", 0)
    return experience, stats


def informative_groups(group_ids: torch.Tensor, scores: torch.Tensor) -> list[int]:
    """The group ids, in order of first appearance, whose finite scores are not all equal
    (DAPO's dynamic sampling keeps only those: an all-equal group's advantages are all 0)."""
    informative = []
    for group in dict.fromkeys(group_ids.tolist()):
        values = scores[group_ids == group]
        values = values[values.isfinite()]
        if len(values) > 1 and bool((values != values[0]).any()):
            informative.append(group)
    return informative


def keep_informative_groups(rollout: Rollout, scores: Scores, per_token: dict[str, torch.Tensor], groups: int,
                            min_rows: int) -> tuple[Rollout, Scores, dict[str, torch.Tensor], int]:
    """The rows of the first `groups` informative groups, and how many groups were left out.
    With fewer than `min_rows` such rows (every group all-equal), every row is kept: their
    advantages are 0, and an update needs its rows."""
    kept_groups = informative_groups(rollout.group_ids, scores.values)[:groups]
    rows = torch.isin(rollout.group_ids, torch.tensor(kept_groups, dtype=rollout.group_ids.dtype)).nonzero().flatten()
    all_groups = len(set(rollout.group_ids.tolist()))
    if len(rows) < min_rows:
        logger.warning("dask-rl: train.filter_groups: %d of %d groups have rewards that differ, too few for the "
                       "update's %d rows; training on every group this step", len(kept_groups), all_groups, min_rows)
        return rollout, scores, per_token, 0
    return (*select_samples(rows, rollout, scores, per_token), all_groups - len(kept_groups))


def _bad_rows(experience: Experience) -> torch.Tensor:
    return ~(experience.advantages.isfinite().all(-1) & experience.returns.isfinite().all(-1))


def _non_finite(rollout: Rollout, per_token: dict[str, torch.Tensor]) -> list[SampleProblem]:
    """A problem for every row with a non-finite value on its response tokens (padding is
    masked out of every loss, so only those tokens count)."""
    mask = rollout.response_mask.bool()
    problems = []
    for name, tensor in per_token.items():
        bad = ~torch.where(mask, tensor, torch.zeros_like(tensor)).isfinite().all(-1)
        role = PER_TOKEN_ROLES.get(name, name)
        problems += [SampleProblem(int(row), role, f"non-finite {name} on its response tokens")
                     for row in bad.nonzero().flatten()]
    return problems


def _kept_rows(rollout: Rollout, problems: list[SampleProblem], screen: SampleScreen) -> torch.Tensor:
    """The indexes of the rows to keep; raises where the step must be refused."""
    if not problems:
        return torch.arange(len(rollout))
    first = _describe(problems[0], rollout, screen.decode)
    role = problems[0].role
    if screen.on_error == "raise":
        raise BadSampleError(f"{first}. Fix: {_fix(role)}, or set train.reward_errors: skip to drop such "
                             f"samples; nothing was published")
    bad = torch.zeros(len(rollout), dtype=torch.bool)
    bad[[p.row for p in problems]] = True
    if screen.by_group:  # GRPO: the group of every bad sample
        bad = torch.isin(rollout.group_ids, rollout.group_ids[bad])
    kept = (~bad).nonzero().flatten()
    if len(kept) < screen.min_rows:
        raise BadSampleError(f"{int(bad.sum())} of {len(rollout)} samples of this step are bad, leaving {len(kept)} "
                             f"(the update needs {screen.min_rows}); e.g. {first}. Fix: {_fix(role)}; nothing "
                             f"was published, the last good version stays")
    for problem in problems[:WARN_LIMIT]:
        logger.warning("dask-rl: dropped %s", _describe(problem, rollout, screen.decode))
    logger.warning("dask-rl: dropped %d of %d samples of this step (%d found bad%s; train.reward_errors: skip)",
                   int(bad.sum()), len(rollout), len(problems), ", with their GRPO groups" if screen.by_group else "")
    return kept


def _describe(problem: SampleProblem, rollout: Rollout, decode: Callable | None) -> str:
    """`role: error; prompt '...', response '...'` with the texts cut short."""
    prompt, response = problem.prompt, problem.response
    if not (prompt or response) and decode is not None:
        prompt_ids, response_ids = rollout.token_ids(problem.row)
        prompt, response = shorten(decode(prompt_ids), SHOWN_TEXT), shorten(decode(response_ids), SHOWN_TEXT)
    return f"{problem.role}: {problem.error}; prompt {prompt!r}, response {response!r}"


def _fix(role: str) -> str:
    if role == "reward":
        return "make the reward return one finite number for every response"
    return f"check the {role} model and the train settings (a NaN weight or an overflow gives non-finite values)"
