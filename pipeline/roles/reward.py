"""The reward role: scores each response with a rule (a Python function) or a reward model.

Every score is checked here, where the prompt and response are at hand: a reward function
that raises or returns something other than one finite number, or a reward model that
scores NaN, marks its sample as a SampleProblem (score NaN) instead of failing the shard.
The driver then drops or refuses those samples as `train.reward_errors` says.
"""

from __future__ import annotations

import logging
import math
import numbers
from typing import Any, Callable

import torch

from pipeline.records import SHOWN_TEXT, Rollout, SampleProblem, Scores
from pipeline.roles.host import resolve_device, role_state
from resources.config import shorten

logger = logging.getLogger("dask_rl")

RewardFunction = Callable[[str, str], float]   # (prompt text, response text) -> reward


class RewardRole:
    def __init__(self, tokenizer_dir: str, *, function: RewardFunction | None = None,
                 model_dir: str | None = None, device: str = "auto", batch_size: int = 32):
        device = resolve_device(device)
        from pipeline.models import load_sequence_scorer, load_tokenizer

        if (function is None) == (model_dir is None):
            raise ValueError("a reward role needs exactly one of a reward function or a reward model")
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.function = function
        self.device = device
        self.batch_size = batch_size
        if model_dir is not None:
            self.model = load_sequence_scorer(model_dir, device=device)
            self.model_tokenizer = load_tokenizer(model_dir)

    def texts(self, rollout: Rollout) -> tuple[list[str], list[str]]:
        """Decode prompts and responses (padding and EOS dropped)."""
        ids = [rollout.token_ids(row) for row in range(len(rollout))]
        return ([self.tokenizer.decode(p, skip_special_tokens=True) for p, _ in ids],
                [self.tokenizer.decode(r, skip_special_tokens=True) for _, r in ids])

    def score(self, rollout: Rollout) -> Scores:
        """One scalar reward per sample; NaN, with the reason, where there is none."""
        prompts, responses = self.texts(rollout)
        if self.function is not None:
            called = [self._call(p, r) for p, r in zip(prompts, responses)]
            values, errors = [v for v, _ in called], [e for _, e in called]
        else:
            values = self._model_scores([p + r for p, r in zip(prompts, responses)]).tolist()
            errors = [None if math.isfinite(v) else f"the reward model scored {v}" for v in values]
        problems = [SampleProblem(row, "reward", error, shorten(prompts[row], SHOWN_TEXT),
                                  shorten(responses[row], SHOWN_TEXT))
                    for row, error in enumerate(errors) if error is not None]
        scores = torch.tensor(values, dtype=torch.float32)
        scores[[p.row for p in problems]] = math.nan
        return Scores(scores, problems)

    def _call(self, prompt: str, response: str) -> tuple[float, str | None]:
        """(score, None), or (nan, what went wrong) for a raising function or a bad value."""
        try:
            value = self.function(prompt, response)
        except Exception as error:  # the user's function: any failure is this sample's problem
            logger.debug("dask-rl: the reward function failed on prompt %r", prompt[:SHOWN_TEXT], exc_info=True)
            return math.nan, shorten(f"the reward function raised {type(error).__name__}: {error}", 300)
        problem = _bad_score(value)
        return (math.nan, f"the reward function {problem}") if problem else (float(value), None)

    @torch.no_grad()
    def _model_scores(self, texts: list[str]) -> torch.Tensor:
        # Re-tokenise with the reward model's own tokenizer: it need not share the policy's.
        scores = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.model_tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True)
            logits = self.model(**{k: v.to(self.device) for k, v in batch.items()}).logits
            scores.append(logits[:, 0].float().cpu())
        return torch.cat(scores)


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


def score(rollout: Rollout) -> Scores:
    """Task: the rewards of one rollout shard."""
    return role_state("reward").score(rollout)
