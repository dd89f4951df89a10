"""Policy losses beside PPO's token-level one (pure tensor maths), and the table the actor picks
its loss from by `train.policy_loss`. Every loss takes policy_loss's arguments and returns
(scalar, stats) with the same stats keys, so the actor calls whichever was chosen the same way.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from pipeline.algorithms import Normalizer, aggregate_loss, clipped_surrogate, masked_mean, masked_sum, policy_loss


def gspo_policy_loss(
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
    """GSPO (Qwen, arXiv 2507.18071): the clipped surrogate on a sequence-level ratio. Same
    arguments and stats as policy_loss; (B, T) tensors -> (scalar, stats).

    s_b = exp(mean over b's valid tokens of (logp - old_logp)), the per-token geometric mean of
    the sequence's ratio; each token t of b uses s_bt = sg[s_b] * exp(logp_bt - sg[logp_bt])
    (the value of s_b, with the gradient of s_b spread over b's tokens), then
    loss_t = -min(s_bt * A, clip(s_bt, 1 - eps_low, 1 + eps_high) * A). With
    loss_agg_mode seq-mean-token-mean this is the paper's objective; verl always uses that
    mode for GSPO, here the train key decides (the GSPO recipe sets it). The log of s_bt is
    capped at 10 like verl does. clip_ratio_c does not apply (the ratio is per sequence).
    """
    log_ratio = logp - old_logp
    lengths = mask.to(log_ratio.dtype).sum(-1).clamp(min=1)
    seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / lengths
    log_s = (logp - logp.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    per_token, clipped, unclipped = clipped_surrogate(torch.exp(log_s), advantages, clip_ratio, high)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = aggregate_loss(per_token, mask, loss_agg_mode, normalizer, sequences, horizon)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((clipped > unclipped).float(), mask),
            "clip_frac_lower": torch.zeros((), device=logp.device),
            "approx_kl": masked_mean(0.5 * log_ratio.float() ** 2, mask),
        }
    return loss, stats


# train.policy_loss -> the function the actor calls (chosen once per update).
POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "ppo": policy_loss,
    "gspo": gspo_policy_loss,
}
