"""The reward role: scores each response with a rule (a Python function) or a reward model."""

from __future__ import annotations

from typing import Callable

import torch

from pipeline.records import Rollout
from pipeline.roles.host import resolve_device, role_state

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
        prompts, responses = [], []
        for row in range(len(rollout)):
            prompt = rollout.input_ids[row, :rollout.prompt_length][rollout.attention_mask[row, :rollout.prompt_length].bool()]
            response = rollout.responses[row][rollout.response_mask[row].bool()]
            prompts.append(self.tokenizer.decode(prompt.tolist(), skip_special_tokens=True))
            responses.append(self.tokenizer.decode(response.tolist(), skip_special_tokens=True))
        return prompts, responses

    def score(self, rollout: Rollout) -> torch.Tensor:
        """(B,) one scalar reward per sample."""
        prompts, responses = self.texts(rollout)
        if self.function is not None:
            return torch.tensor([float(self.function(p, r)) for p, r in zip(prompts, responses)])
        return self._model_scores([p + r for p, r in zip(prompts, responses)])

    @torch.no_grad()
    def _model_scores(self, texts: list[str]) -> torch.Tensor:
        # Re-tokenise with the reward model's own tokenizer: it need not share the policy's.
        scores = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.model_tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True)
            logits = self.model(**{k: v.to(self.device) for k, v in batch.items()}).logits
            scores.append(logits[:, 0].float().cpu())
        return torch.cat(scores)


def score(rollout: Rollout) -> torch.Tensor:
    """Task: (B,) rewards for one rollout shard."""
    return role_state("reward").score(rollout)
