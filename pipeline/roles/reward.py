"""The reward role: scores each response with reward functions and/or reward models.

A step's reward is the weighted sum of its rewards (reward_specs.py: the two calling
conventions, names and weights); each reward's own value is kept too (Scores.components)
for its figures. Every value is checked here, where the texts are at hand: a reward that
raises, runs past its time bound or returns something other than one finite number (or
None: "does not apply") marks its sample as a SampleProblem (score NaN) instead of failing
the shard, and so does a sample to which no reward applies. The driver then drops or
refuses those samples as `train.reward_errors` says.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from typing import Any, Callable

import torch

from pipeline.records import SHOWN_TEXT, RewardInputs, Rollout, SampleProblem, Scores
from pipeline.reward_specs import RewardSpec, accepted_keywords
from pipeline.roles.bounded_calls import BoundedCalls
from pipeline.roles.host import resolve_device, role_state
from resources.config import shorten

logger = logging.getLogger("dask_rl")

RewardFunction = Callable[..., Any]   # (prompt, response, **fields) -> float | None, or TRL's batched form


class RewardRole:
    """`rewards`: the RewardSpecs to compute; `function=` / `model_dir=` is the one-reward
    short form. `timeout`: seconds one call of a reward function may take (train.reward_timeout;
    0 = no bound, calls run in this worker's thread)."""

    def __init__(self, tokenizer_dir: str, *, function: RewardFunction | None = None,
                 model_dir: str | None = None, rewards: list[RewardSpec] | None = None, device: str = "auto",
                 batch_size: int = 32, timeout: float = 0.0):
        device = resolve_device(device)
        from pipeline.models import load_sequence_scorer, load_tokenizer

        if rewards is None:
            if (function is None) == (model_dir is None):
                raise ValueError("a reward role needs exactly one of a reward function or a reward model")
            rewards = [RewardSpec("reward", function=function, model_dir=model_dir)]
        self.specs = rewards
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.device = device
        self.batch_size = batch_size
        # Calls in child processes, one per two of this worker's cores: a batch of math checks
        # spreads over them; a hung or crashed call is killed and costs its own sample only.
        self.calls = BoundedCalls(timeout, processes=max(1, min(4, (os.cpu_count() or 2) // 2)))
        self.models = {spec.name: (load_sequence_scorer(spec.model_dir, device=device), load_tokenizer(spec.model_dir))
                       for spec in rewards if spec.model_dir is not None}

    def close(self) -> None:
        self.calls.close()

    def texts(self, rollout: Rollout) -> tuple[list[str], list[str]]:
        """Decode prompts and responses (padding and special tokens such as EOS dropped)."""
        return self._decode(*rollout.all_token_ids())

    def _decode(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> tuple[list[str], list[str]]:
        """texts, from the token ids. A prompt is decoded once for all its samples: decoding is
        most of a step's scoring (256 x 384 tokens: about 0.5 s on a 2-core CPU host), and a
        group repeats its prompt."""
        prompts: dict[tuple[int, ...], str] = {}
        for ids in prompt_ids:
            if tuple(ids) not in prompts:
                prompts[tuple(ids)] = self.tokenizer.decode(ids, skip_special_tokens=True)
        return ([prompts[tuple(ids)] for ids in prompt_ids],
                [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in response_ids])

    def score(self, rollout: Rollout, inputs: RewardInputs | None = None) -> Scores:
        """The weighted reward per sample and each reward's own value; NaN, with the reason,
        where there is none. `inputs`: each prompt's original form and fields, by group id
        (without them a function sees the decoded prompt and no fields)."""
        prompt_ids, response_ids = rollout.all_token_ids()
        prompt_texts, responses = self._decode(prompt_ids, response_ids)
        samples = _Samples(rollout, prompt_texts, responses, response_ids, inputs)
        components, errors = {}, [None] * len(rollout)
        for spec in self.specs:
            if spec.function is None:
                values, spec_errors = self._model_scores(spec.name, samples)
            elif spec.batched:
                values, spec_errors = self._batched(spec, samples)
            else:
                values, spec_errors = self._per_sample(spec, samples)
            components[spec.name] = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)
            errors = [e or (f"{spec.name}: {s}" if s and len(self.specs) > 1 else s)
                      for e, s in zip(errors, spec_errors)]
        total, errors = _weighted_sum(self.specs, components, errors)
        problems = [SampleProblem(row, "reward", error, shorten(prompt_texts[row], SHOWN_TEXT),
                                  shorten(responses[row], SHOWN_TEXT))
                    for row, error in enumerate(errors) if error is not None]
        total[[p.row for p in problems]] = math.nan
        return Scores(total, problems, components)

    def _per_sample(self, spec: RewardSpec, samples: _Samples) -> tuple[list, list]:
        calls = [((samples.prompts[row], samples.responses[row]),
                  accepted_keywords(spec.function, samples.keywords(row))) for row in range(samples.rows)]
        results = self.calls.run(spec.function, calls)
        checked = [_checked(value, error, "the reward function") for value, error in results]
        return [v for v, _ in checked], [e for _, e in checked]

    def _batched(self, spec: RewardSpec, samples: _Samples) -> tuple[list, list]:
        """TRL's convention: one call for the shard, keyword arguments only."""
        offered = {"prompts": samples.prompts, "completions": samples.completions(), **samples.columns()}
        [(values, error)] = self.calls.run(spec.function, [((), accepted_keywords(spec.function, offered))])
        if error is not None:
            return [None] * samples.rows, [_checked(None, error, "the reward function")[1]] * samples.rows
        if not (isinstance(values, (list, tuple)) and len(values) == samples.rows):
            error = f"the reward function returned {shorten(repr(values))}, not a list of {samples.rows} values " \
                    f"(one per completion)"
            return [None] * samples.rows, [error] * samples.rows
        checked = [_checked(value, None, "the reward function") for value in values]
        return [v for v, _ in checked], [e for _, e in checked]

    @torch.no_grad()
    def _model_scores(self, name: str, samples: _Samples) -> tuple[list, list]:
        # Re-tokenise with the reward model's own tokenizer: it need not share the policy's.
        model, tokenizer = self.models[name]
        texts = [p + r for p, r in zip(samples.prompt_texts, samples.responses)]
        scores = []
        for start in range(0, len(texts), self.batch_size):
            batch = tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True)
            logits = model(**{k: v.to(self.device) for k, v in batch.items()}).logits
            scores += logits[:, 0].float().cpu().tolist()
        return scores, [None if math.isfinite(v) else f"the reward model scored {v}" for v in scores]


class _Samples:
    """One shard's samples as the reward functions see them."""

    def __init__(self, rollout: Rollout, prompt_texts: list[str], responses: list[str],
                 completion_ids: list[list[int]], inputs: RewardInputs | None):
        groups = rollout.group_ids.tolist()
        self.rows = len(rollout)
        self.prompt_texts, self.responses = prompt_texts, responses
        self.prompts = [inputs.prompts[g] for g in groups] if inputs else prompt_texts
        self.fields = [inputs.fields[g] for g in groups] if inputs else [{} for _ in groups]
        self.completion_ids = completion_ids

    def keywords(self, row: int) -> dict[str, Any]:
        return {**self.fields[row], "completion_ids": self.completion_ids[row]}

    def completions(self) -> list:
        """As TRL gives them: text, or an assistant message where the prompt was a conversation."""
        return [[{"role": "assistant", "content": r}] if isinstance(p, list) else r
                for p, r in zip(self.prompts, self.responses)]

    def columns(self) -> dict[str, list]:
        """Each field as a list over the samples (None where a row lacks it), and completion_ids."""
        names = dict.fromkeys(key for fields in self.fields for key in fields)
        return {**{name: [fields.get(name) for fields in self.fields] for name in names},
                "completion_ids": self.completion_ids}


def _checked(value: Any, error: str | None, what: str) -> tuple[float | None, str | None]:
    """(a finite float or None, None) or (None, what went wrong)."""
    if error is not None:  # an exception's text, "timed out after N s" or how the child died
        raised = not error.startswith(("timed out", "the child process"))
        return None, shorten(f"{what} {'raised ' if raised else ''}{error}", 300)
    if value is None:
        return None, None
    problem = _bad_score(value)
    return (None, f"{what} {problem}") if problem else (float(value), None)


def _weighted_sum(specs: list[RewardSpec], components: dict[str, torch.Tensor], errors: list[str | None]
                  ) -> tuple[torch.Tensor, list[str | None]]:
    """Sum over the rewards that apply of weight x value; a sample none applies to is a problem."""
    stacked = torch.stack([components[s.name] for s in specs], dim=1)
    weights = torch.tensor([s.weight for s in specs], dtype=torch.float32)
    applies = stacked.isfinite()
    total = torch.where(applies, stacked * weights, torch.zeros(())).sum(dim=1)
    none_apply = ~applies.any(dim=1)
    errors = [e or ("every reward returned None (none applies to this sample)" if none else None)
              for e, none in zip(errors, none_apply.tolist())]
    return total, errors


def _bad_score(value: Any) -> str | None:
    """What is wrong with `value` as a reward (None: it is one finite number)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return f"returned a tensor of shape {tuple(value.shape)}, not one number"
        value = value.item()
    if not isinstance(value, numbers.Real):  # bool, int, float and numpy scalars are numbers
        return f"returned {shorten(repr(value))} (a {type(value).__name__}), not a number"
    try:
        number = float(value)
    except OverflowError:
        return "returned an integer too large for a float, not a finite number"
    return None if math.isfinite(number) else f"returned {number}, not a finite number"


def score(rollout: Rollout, inputs: RewardInputs | None = None) -> Scores:
    """Task: the rewards of one rollout shard (`inputs`: its prompts' original forms and fields)."""
    return role_state("reward").score(rollout, inputs)
