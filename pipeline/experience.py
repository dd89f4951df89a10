"""From scored rollouts to the Experience an update consumes: rewards, KL and advantages.

Pure tensor code (runs in the driver on small CPU tensors); the math lives in algorithms.py.
"""

from __future__ import annotations

import torch

from pipeline.advantages import ESTIMATORS
from pipeline.algorithms import compute_gae, kl_penalty, masked_mean, masked_whiten, token_level_rewards
from pipeline.records import Experience, Rollout


def build_experience(rollout: Rollout, scores: torch.Tensor, ref_logprobs: torch.Tensor,
                     values: torch.Tensor | None, *, algorithm: str, kl_coef: float, gamma: float,
                     lam: float, group_size: int, whiten: bool,
                     advantage: str = "grpo", overlong_filter: bool = False) -> tuple[Experience, dict[str, float]]:
    """Args: rollout (B rows), scores (B,), ref_logprobs (B, R), values (B, R) or None for GRPO.

    PPO: per-token reward = -kl_coef * KL, plus the score on the last token; GAE with the
    critic's values gives advantages (whitened) and returns. The returns are taken before
    whitening: they are the critic's targets, in reward units. GRPO: each sample's reward is
    normalised within its group (the rows sharing rollout.group_ids, in any order: shards
    need not arrive in prompt order) and applied to all of its tokens; KL goes to the loss.
    Other critic-free estimators (`advantage`, a key of advantages.ESTIMATORS: rloo,
    reinforce_plus_plus, ...) take GRPO's place.
    `group_size` is the number of rows every group must have.
    `overlong_filter` (DAPO): a response cut at max_new_tokens (rollout.clipped) leaves the
    loss (its mask and advantages become 0) after the advantages are computed, so it still
    counts in its group's baseline as the reward it got.
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
        _check_groups(rollout.group_ids, group_size)
        advantages = ESTIMATORS[advantage](scores, rollout.group_ids, mask, gamma)
        returns = old_values = torch.zeros_like(mask)
    if overlong_filter:
        loss_mask = mask * (~rollout.clipped)[:, None]
        advantages = advantages * loss_mask
    else:
        loss_mask = mask
    experience = Experience(
        input_ids=rollout.input_ids, attention_mask=rollout.attention_mask, response_mask=loss_mask,
        behavior_logprobs=rollout.behavior_logprobs, ref_logprobs=ref_logprobs,
        advantages=advantages, returns=returns, old_values=old_values,
        prompt_length=rollout.prompt_length,
    )
    stats = {"reward_mean": float(scores.float().mean()), "reward_std": float(scores.float().std(correction=0)),
             "kl_mean": float(masked_mean(kl, mask)), "response_length": float(mask.sum(-1).mean()),
             "tokens": int(mask.sum()), "clipped_fraction": float(rollout.clipped.float().mean())}
    return experience, stats


def _check_groups(group_ids: torch.Tensor, group_size: int) -> None:
    """A group with rows missing (or from two steps) would get a baseline from the wrong rows."""
    ids, counts = torch.unique(group_ids, return_counts=True)
    wrong = {int(i): int(c) for i, c in zip(ids, counts) if c != group_size}
    if wrong:
        raise ValueError(f"GRPO groups must have samples_per_prompt={group_size} rows each; "
                         f"group id -> rows: {dict(list(wrong.items())[:5])}")
