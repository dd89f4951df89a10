"""Pure tensor math for RL post-training: PPO (with critic) and GRPO.

Shape letters: B = sequences in the batch, T = response tokens (right-padded), V = vocab.
A ``mask`` is (B, T), bool or 0/1 float, 1 on real response tokens. Nothing here knows about
configs, workers or I/O, so every function can be tested on tiny hand-made tensors.

Loss reduction rule (policy_loss, value_loss, kl_loss): the per-token loss is summed over valid
tokens and divided by ``normalizer`` when given, else by this batch's valid-token count. Passing
the *global* token count (all micro-batches and data-parallel ranks) as ``normalizer`` makes the
sum of the per-shard losses, and therefore of their gradients, equal the loss of the whole batch.
The other aggregation modes (``aggregate_loss``) follow the same rule with the global sequence
count: every mode is a sum of per-row terms over a constant, so splitting never changes it.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch import Tensor

Normalizer = Optional[Union[float, int, Tensor]]

# exp() of a log-ratio above this overflows float32 soon after; clamping keeps a single stale
# or badly-sampled token from turning the whole loss into inf/nan (same bound as verl).
_MAX_LOG_RATIO = 20.0


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """sum(x * mask), over everything or along ``dim``. x, mask: same shape, e.g. (B, T).

    torch.where rather than x*mask so that inf/nan sitting on padding cannot leak (inf*0 = nan).
    """
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """sum(x * mask) / max(sum(mask), 1); an all-padding input gives 0 instead of nan."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise x over its valid entries. x, mask: (B, T) -> (B, T).

    mu = masked_mean(x), var = masked_mean((x - mu)^2) (biased, unbiased=False),
    out = (x - mu) / sqrt(var + eps), plus mu again if ``shift_mean`` is False.
    Padding is set to 0 so the result can go straight into a masked loss.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def logprobs_from_logits(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log p(token) under softmax(logits / temperature). logits (B, T, V), tokens (B, T) -> (B, T) f32.

    logp = logits[token] / temperature - logsumexp(logits / temperature). Done in float32 because
    bf16 log-softmax loses ~2 significant digits, which shows up directly in the PPO ratio.
    The temperature must match the one used for sampling, or ratios are biased from step 0.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    # gather-then-logsumexp avoids materialising a second (B, T, V) log_softmax tensor.
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits). logits (B, T, V) -> (B, T) float32.

    H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v (stable: never takes log of a tiny p).
    """
    logits = logits.float()
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k1") -> Tensor:
    """Per-token KL(policy || ref) estimate from sampled-token log-probs. (B, T), (B, T) -> (B, T).

    k1 = logp - ref                      (unbiased, can be negative)
    k2 = 0.5 * (logp - ref)^2            (biased, low variance)
    k3 = exp(ref - logp) - (ref - logp) - 1   (Schulman: unbiased and >= 0)
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        # clamp: exp overflows when ref is far above the policy on some token.
        d = (-log_ratio).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return torch.exp(d) - d - 1.0
    raise ValueError(f"unknown kl kind {kind!r}; expected 'k1', 'k2' or 'k3'")


def token_level_rewards(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """PPO per-token reward. scores (B,), kl (B, T), mask (B, T) -> (B, T).

    r[b, t] = -kl_coef * kl[b, t] on valid tokens, plus scores[b] at row b's last valid token.
    Rows with no valid token get all zeros (their score has nowhere to go).
    """
    m = mask.bool()
    rewards = torch.where(m, -kl_coef * kl, torch.zeros_like(kl))
    t = torch.arange(m.shape[-1], device=m.device)
    # index of the last valid token; argmax of t*m works for any mask, not only prefixes.
    last = (t * m).argmax(dim=-1)
    has_any = m.any(dim=-1)
    bonus = torch.where(has_any, scores.to(rewards.dtype), torch.zeros_like(scores, dtype=rewards.dtype))
    return rewards.scatter_add(-1, last.unsqueeze(-1), bonus.unsqueeze(-1))


@torch.no_grad()
def compute_gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation. rewards, values, mask: (B, T) -> (advantages, returns), (B, T).

    delta_t = r_t + gamma * V_{t+1} - V_t,   A_t = delta_t + gamma * lam * A_{t+1},
    with V and A after the last valid token taken as 0 (the episode ends there).
    returns = A + V. Both outputs are 0 where mask == 0 and carry no grad (they are targets).
    Masked positions are skipped, not treated as zero-reward steps: the recursion carries the next
    valid token's V and A across them, so right padding and holes (e.g. tool output) both work.
    """
    B, T = rewards.shape
    m = mask.to(values.dtype)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_adv = torch.zeros_like(next_value)
    advs = []
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        mt = m[:, t]
        next_value = values[:, t] * mt + next_value * (1 - mt)
        next_adv = adv * mt + next_adv * (1 - mt)
        advs.append(adv)
    advantages = torch.stack(advs[::-1], dim=1)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    advantages = torch.where(mask.bool(), advantages, zero)
    returns = torch.where(mask.bool(), advantages + values, zero)
    return advantages, returns


@torch.no_grad()
def grpo_advantages(
    scores: Tensor, group_size: int, eps: float = 1e-6, scale_by_std: bool = True
) -> Tensor:
    """group_advantages for contiguous groups. scores (B,), B = n_prompts * group_size -> (B,)."""
    B = scores.shape[0]
    if group_size < 1 or B % group_size != 0:
        raise ValueError(
            f"batch of {B} scores is not a whole number of groups of group_size={group_size}"
        )
    group_ids = torch.arange(B, device=scores.device) // group_size
    return group_advantages(scores, group_ids, eps, scale_by_std)


@torch.no_grad()
def group_advantages(
    scores: Tensor, group_ids: Tensor, eps: float = 1e-6, scale_by_std: bool = True
) -> Tensor:
    """Group-relative advantages. scores (B,), group_ids (B,), rows of a group anywhere -> (B,).

    A_i = (r_i - mean(g)) / (std(g) + eps) over the rows g with group_ids == group_ids[i], std
    unbiased (N-1) as in the GRPO paper / TRL; with scale_by_std=False, A_i = r_i - mean(g)
    (Dr. GRPO). A group of one has no baseline, so its advantage is 0 (the unbiased std of one
    sample is nan).
    """
    r = scores if scores.is_floating_point() else scores.float()
    _, group, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n = counts.to(r.dtype)
    per_group = lambda x: torch.zeros_like(n).index_add_(0, group, x)  # noqa: E731 - sums of x per group
    adv = r - (per_group(r) / n)[group]
    if scale_by_std:
        std = (per_group(adv**2) / (n - 1).clamp(min=1)).sqrt()
        adv = adv / (std[group] + eps)
    return torch.where(counts[group] > 1, adv, torch.zeros_like(adv))


@torch.no_grad()
def importance_weights(
    proximal_logp: Tensor, behavior_logp: Tensor, mask: Tensor, cap: Optional[float]
) -> Tensor:
    """Truncated importance weights for decoupled PPO (AReaL). (B, T) each -> (B, T), no grad.

    w = min(exp(proximal - behavior), cap), 0 on padding. ``behavior`` is the (possibly stale)
    policy that generated the tokens, ``proximal`` the policy the PPO clip is centred on.
    Truncating at ``cap`` bounds the variance that very off-policy tokens would add.
    cap=None disables truncation.
    """
    log_w = (proximal_logp - behavior_logp).clamp(max=_MAX_LOG_RATIO)
    w = torch.exp(log_w)
    if cap is not None:
        w = w.clamp(max=cap)
    return torch.where(mask.bool(), w, torch.zeros_like(w))


def _reduce(per_token: Tensor, mask: Tensor, normalizer: Normalizer) -> Tensor:
    """sum over valid tokens / (normalizer or this batch's valid-token count)."""
    total = masked_sum(per_token, mask)
    if normalizer is None:
        return total / mask.to(total.dtype).sum().clamp(min=1)
    _check_positive("normalizer", normalizer)
    return total / normalizer


def _check_positive(name: str, value: Normalizer) -> None:
    if not isinstance(value, Tensor) and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def _row_sums(per_token: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(B,) loss summed over each row's valid tokens, and (B,) each row's valid-token count."""
    return masked_sum(per_token, mask, dim=-1), mask.to(per_token.dtype).sum(-1)


def _sequences(mask: Tensor, sequences: Normalizer) -> Normalizer:
    """The given global sequence count, or this batch's rows with a valid token."""
    if sequences is None:
        return (mask.to(torch.float32).sum(-1) > 0).sum().clamp(min=1)
    _check_positive("sequences", sequences)
    return sequences


def _token_sum(per_token, mask, tokens, sequences, horizon) -> Tensor:
    return masked_sum(per_token, mask)


def _seq_mean_token_mean(per_token, mask, tokens, sequences, horizon) -> Tensor:
    sums, counts = _row_sums(per_token, mask)
    return (sums / counts.clamp(min=1)).sum() / _sequences(mask, sequences)


def _seq_mean_token_sum(per_token, mask, tokens, sequences, horizon) -> Tensor:
    return _row_sums(per_token, mask)[0].sum() / _sequences(mask, sequences)


def _seq_mean_token_sum_norm(per_token, mask, tokens, sequences, horizon) -> Tensor:
    if horizon is None or horizon <= 0:
        raise ValueError(f"seq-mean-token-sum-norm needs a horizon > 0 (the max response length), got {horizon}")
    return _row_sums(per_token, mask)[0].sum() / (_sequences(mask, sequences) * horizon)


# train.loss_agg_mode -> reduction; each takes (per_token, mask, tokens, sequences, horizon).
LOSS_AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "token-mean": lambda per_token, mask, tokens, sequences, horizon: _reduce(per_token, mask, tokens),
    "token-sum": _token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate_loss(per_token: Tensor, mask: Tensor, mode: str = "token-mean", tokens: Normalizer = None,
                   sequences: Normalizer = None, horizon: Optional[float] = None) -> Tensor:
    """A (B, T) per-token loss -> scalar. ``tokens``/``sequences``: the global valid-token count
    and the global count of rows with a valid token (this batch's when None); ``horizon``: a
    constant length (train.max_new_tokens). l = per-token loss on valid tokens, n_b = row b's
    valid tokens:

    token-mean               sum_b,t l / tokens                (today's; DAPO's token-level loss)
    token-sum                sum_b,t l                         (no normaliser)
    seq-mean-token-mean      sum_b (sum_t l / n_b) / sequences (the GRPO paper's, GSPO's)
    seq-mean-token-sum       sum_b sum_t l / sequences
    seq-mean-token-sum-norm  sum_b sum_t l / (sequences * horizon)   (Dr. GRPO's constant)

    verl's seq-mean-token-sum-norm divides by the padded response length only and leaves the
    batch scale to its trainer; here the global sequence count is in it, so the loss does not
    grow with the batch, and the horizon is the configured max_new_tokens, not each
    micro-batch's padded width (which would make splitting change the update).
    Rows with no valid token add nothing to any mode and are not counted.
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {', '.join(LOSS_AGGREGATIONS)}")
    return LOSS_AGGREGATIONS[mode](per_token, mask, tokens, sequences, horizon)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_ratio: float,
    normalizer: Normalizer = None,
    is_weights: Optional[Tensor] = None,
    *,
    clip_ratio_high: Optional[float] = None,
    clip_ratio_c: Optional[float] = None,
    loss_agg_mode: str = "token-mean",
    sequences: Normalizer = None,
    horizon: Optional[float] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate. logp, old_logp, advantages, mask, is_weights: (B, T) -> (scalar, stats).

    ratio = exp(logp - old_logp)
    loss_t = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)  [* is_weights_t]
    eps_low = clip_ratio; eps_high = clip_ratio_high or clip_ratio (DAPO's clip-higher).
    Dual clip (Ye et al. 2019, arXiv 1912.09729), only with clip_ratio_c = c > 1: where A < 0,
    loss_t = min(loss_t, -c * A), so a huge ratio on a bad token cannot push the loss without
    bound. verl turns it on by default (c = 3); here None (off) keeps the plain PPO loss.
    The per-token loss is reduced by ``aggregate_loss(loss_agg_mode, normalizer = global token
    count, sequences, horizon)``.
    For decoupled PPO pass old_logp = proximal log-probs and
    is_weights = importance_weights(proximal, behavior, mask, cap).
    stats (detached): clip_frac = share of valid tokens where the clipped term was the active one,
    clip_frac_lower = share where the dual clip was, approx_kl = masked_mean(0.5 * (logp - old_logp)^2).
    """
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    per_token, clipped, unclipped = clipped_surrogate(ratio, advantages, clip_ratio, high)
    dual = torch.zeros_like(per_token, dtype=torch.bool)
    if clip_ratio_c is not None:
        bound = -advantages * clip_ratio_c
        dual = (advantages < 0) & (per_token > bound)
        per_token = torch.where(dual, bound, per_token)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = aggregate_loss(per_token, mask, loss_agg_mode, normalizer, sequences, horizon)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((clipped > unclipped).float(), mask),
            "clip_frac_lower": masked_mean(dual.float(), mask),
            "approx_kl": masked_mean(0.5 * log_ratio.float() ** 2, mask),
        }
    return loss, stats


def clipped_surrogate(ratio: Tensor, advantages: Tensor, low: float, high: float) -> tuple[Tensor, Tensor, Tensor]:
    """(per-token loss, clipped term, unclipped term): max of the negated terms == -min of the
    surrogate terms."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped, unclipped


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range: float,
    normalizer: Normalizer = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped critic loss. values, old_values, returns, mask: (B, T) -> (scalar, stats).

    v_clip = old + clip(v - old, -c, c);  loss_t = 0.5 * max((v - R)^2, (v_clip - R)^2).
    The max keeps the critic from moving further than c from its rollout-time estimate in the
    direction that helps. stats (detached): value_clip_frac = share of valid tokens where the
    clipped term was the larger one.
    """
    old_values = old_values.detach()
    returns = returns.detach()
    v_clip = old_values + (values - old_values).clamp(-clip_range, clip_range)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (v_clip - returns) ** 2
    per_token = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
    loss = _reduce(per_token, mask, normalizer)
    with torch.no_grad():
        stats = {"value_clip_frac": masked_mean((loss_clipped > loss_unclipped).float(), mask)}
    return loss, stats


def kl_loss(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    kind: str = "k3",
    normalizer: Normalizer = None,
    *,
    loss_agg_mode: str = "token-mean",
    sequences: Normalizer = None,
    horizon: Optional[float] = None,
) -> Tensor:
    """GRPO's in-loss KL to the reference policy. logp, ref_logp, mask: (B, T) -> scalar.

    loss = aggregate_loss(kl_penalty(logp, ref_logp, kind), loss_agg_mode, normalizer = global
    token count, sequences, horizon); token-mean: sum_valid kl / tokens.
    Gradient flows through logp only; the reference is a fixed anchor.
    """
    return aggregate_loss(kl_penalty(logp, ref_logp.detach(), kind), mask, loss_agg_mode, normalizer, sequences,
                          horizon)
