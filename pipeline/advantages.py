"""Advantage estimators without a critic, one function per formula (pure tensor maths).

Each takes the outcome rewards of a batch and returns (B, T) advantages, 0 on padding:

    fn(scores (B,), group_ids (B,), mask (B, T), gamma) -> (B, T)

`group_ids` names each row's prompt (the rows of a group may sit anywhere in the batch).
The trainer picks one from ESTIMATORS by `train.advantage` once; PPO's GAE (with a critic)
stays in algorithms.compute_gae. The formulas follow verl's core_algos; where a convention
differs it is said in the function's docstring.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from pipeline.algorithms import group_advantages, masked_whiten

EPS = 1e-6


def _per_token(advantages: Tensor, mask: Tensor) -> Tensor:
    """(B,) sequence advantages -> (B, T), the same value on every valid token, 0 on padding."""
    return advantages[:, None] * mask


def _group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """(B,) mean of each row's group, (B,) size of each row's group."""
    r = scores if scores.is_floating_point() else scores.float()
    _, group, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(counts.shape, dtype=r.dtype).index_add_(0, group, r)
    return (sums / counts.to(r.dtype))[group], counts[group]


@torch.no_grad()
def grpo(scores: Tensor, group_ids: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """GRPO (DeepSeekMath, arXiv 2402.03300): A_i = (r_i - mean(g)) / (std(g) + 1e-6), std unbiased.
    The default of algorithm grpo, bit for bit (algorithms.group_advantages)."""
    return group_advantages(scores, group_ids)[:, None] * mask


@torch.no_grad()
def grpo_no_std(scores: Tensor, group_ids: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Dr. GRPO (arXiv 2503.20783): A_i = r_i - mean(g), no division by the group's std (which
    favours prompts that are too easy or too hard). verl: norm_adv_by_std_in_grpo=False."""
    return group_advantages(scores, group_ids, scale_by_std=False)[:, None] * mask


@torch.no_grad()
def grpo_batch_std(scores: Tensor, group_ids: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Group mean, batch std (LitePPO, arXiv 2508.08221; TRL's scale_rewards="batch"):
    A_i = (r_i - mean(g)) / (std(all rewards of the batch) + 1e-6), std unbiased. Not in verl's
    core_algos. A group of one gets 0, as in grpo."""
    r = scores if scores.is_floating_point() else scores.float()
    mean, size = _group_stats(r, group_ids)
    std = r.std() if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
    adv = torch.where(size > 1, (r - mean) / (std + EPS), torch.zeros_like(r))
    return _per_token(adv, mask)


@torch.no_grad()
def rloo(scores: Tensor, group_ids: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """RLOO (Ahmadian et al., arXiv 2402.14740): each sample's baseline is the mean of the
    other samples of its group, A_i = r_i - sum_{j != i} r_j / (n - 1) = n/(n-1) (r_i - mean(g)).
    A group of one gets 0 (no other sample to compare with); verl keeps its raw reward there."""
    r = scores if scores.is_floating_point() else scores.float()
    mean, size = _group_stats(r, group_ids)
    n = size.to(r.dtype)
    adv = torch.where(size > 1, n / (n - 1).clamp(min=1) * (r - mean), torch.zeros_like(r))
    return _per_token(adv, mask)


def _last_token_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """(B, T): each row's score on its last valid token, 0 elsewhere."""
    m = mask.bool()
    t = torch.arange(m.shape[-1], device=m.device)
    last = (t * m).argmax(dim=-1)
    r = scores.to(torch.float32) * m.any(-1)
    return torch.zeros(m.shape, dtype=r.dtype).scatter(-1, last[:, None], r[:, None])


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t+1} over each row's valid tokens (padding skipped, 0 there).
    rewards, mask: (B, T) -> (B, T)."""
    m = mask.to(rewards.dtype)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    out = []
    for t in reversed(range(rewards.shape[1])):
        value = rewards[:, t] + gamma * running
        running = value * m[:, t] + running * (1 - m[:, t])
        out.append(value)
    return torch.stack(out[::-1], dim=1) * m


@torch.no_grad()
def reinforce_plus_plus(scores: Tensor, group_ids: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """REINFORCE++ (Hu, arXiv 2501.03262): the discounted return of the outcome reward at each
    token, G_t = gamma^(last - t) * r, whitened over all valid tokens of the batch (masked_whiten).
    Groups are not used. The KL to the reference stays in the loss (train.kl_coef), as for the
    other critic-free estimators here; verl's REINFORCE++ recipe usually folds a k1 KL into the
    per-token reward before the returns instead."""
    returns = discounted_returns(_last_token_rewards(scores, mask), mask, gamma)
    return masked_whiten(returns, mask)


@torch.no_grad()
def reinforce_plus_plus_baseline(scores: Tensor, group_ids: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """REINFORCE++-baseline (arXiv 2501.03262): subtract the group mean, A_i = r_i - mean(g), put
    it on every token, then whiten over all valid tokens of the batch. gamma is not used."""
    r = scores if scores.is_floating_point() else scores.float()
    mean, _ = _group_stats(r, group_ids)
    return masked_whiten(_per_token(r - mean, mask), mask)


# train.advantage -> estimator, for algorithm grpo (critic-free). "gae" is PPO's, with a critic.
ESTIMATORS: dict[str, Callable[[Tensor, Tensor, Tensor, float], Tensor]] = {
    "grpo": grpo,
    "grpo_no_std": grpo_no_std,
    "grpo_batch_std": grpo_batch_std,
    "rloo": rloo,
    "reinforce_plus_plus": reinforce_plus_plus,
    "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline,
}
