"""From scored rollouts to the Experience an update consumes: rewards, KL and advantages.

Pure tensor code (runs in the driver on small CPU tensors); the math lives in algorithms.py.
"""

from __future__ import annotations

import torch

from pipeline.algorithms import (compute_gae, grpo_advantages, kl_penalty, masked_mean, masked_whiten,
                                 token_level_rewards)
from pipeline.records import Experience, Rollout


def build_experience(rollout: Rollout, scores: torch.Tensor, ref_logprobs: torch.Tensor,
                     values: torch.Tensor | None, *, algorithm: str, kl_coef: float, gamma: float,
                     lam: float, group_size: int, whiten: bool) -> tuple[Experience, dict[str, float]]:
    """Args: rollout (B rows), scores (B,), ref_logprobs (B, R), values (B, R) or None for GRPO.

    PPO: per-token reward = -kl_coef * KL, plus the score on the last token; GAE with the
    critic's values gives advantages (whitened) and returns. GRPO: each sample's reward is
    normalised within its prompt's group and applied to all of its tokens; KL goes to the loss.
    """
    mask = rollout.response_mask
    kl = kl_penalty(rollout.behavior_logprobs, ref_logprobs, kind="k1") * mask
    if algorithm == "ppo":
        rewards = token_level_rewards(scores, kl, mask, kl_coef)
        advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
        if whiten:
            advantages = masked_whiten(advantages, mask)
        old_values = values
    else:
        advantages = grpo_advantages(scores, group_size)[:, None] * mask
        returns = old_values = torch.zeros_like(mask)
    experience = Experience(
        input_ids=rollout.input_ids, attention_mask=rollout.attention_mask, response_mask=mask,
        behavior_logprobs=rollout.behavior_logprobs, ref_logprobs=ref_logprobs,
        advantages=advantages, returns=returns, old_values=old_values,
        policy_version=torch.full((len(rollout),), rollout.policy_version, dtype=torch.long),
        prompt_length=rollout.prompt_length,
    )
    stats = {"reward_mean": float(scores.float().mean()), "kl_mean": float(masked_mean(kl, mask)),
             "response_length": float(mask.sum(-1).mean()), "tokens": int(mask.sum())}
    return experience, stats
