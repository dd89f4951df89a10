"""Tests for pipeline.algorithms: hand-worked values on tiny tensors, plus reference checks."""

import math

import pytest
import torch
from torch.testing import assert_close

from pipeline.algorithms import (
    compute_gae,
    entropy_from_logits,
    group_advantages,
    grpo_advantages,
    importance_weights,
    kl_loss,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_whiten,
    policy_loss,
    token_level_rewards,
    value_loss,
)


def t(x):
    return torch.tensor(x, dtype=torch.float32)


# ---------------------------------------------------------------- masked reductions


def test_masked_sum_and_mean():
    x = t([[1, 2, 3], [4, 5, 6]])
    m = t([[1, 1, 0], [1, 0, 0]])
    # valid: 1, 2, 4 -> sum 7, count 3, mean 7/3
    assert_close(masked_sum(x, m), t(7.0))
    assert_close(masked_mean(x, m), t(7.0 / 3))
    # per row: sums [1+2, 4] = [3, 4]; means [3/2, 4/1]
    assert_close(masked_sum(x, m, dim=1), t([3, 4]))
    assert_close(masked_mean(x, m, dim=1), t([1.5, 4.0]))
    # bool mask behaves the same
    assert_close(masked_mean(x, m.bool()), t(7.0 / 3))


def test_masked_mean_empty_and_nan_padding():
    x = t([[1.0, float("nan")], [float("inf"), 2.0]])
    m = t([[0, 0], [0, 1]])
    # row 0 has no valid token -> 0 (not nan); nan/inf on padding never leak
    assert_close(masked_mean(x, m, dim=1), t([0.0, 2.0]))
    assert_close(masked_sum(x, m), t(2.0))
    assert_close(masked_mean(x, torch.zeros_like(m)), t(0.0))


def test_masked_whiten():
    x = t([[1, 2, 3, 100]])
    m = t([[1, 1, 1, 0]])
    # mean over valid = 2; biased var = ((1-2)^2 + 0 + (3-2)^2)/3 = 2/3; std = 0.81650
    # whitened = [-1, 0, 1] / 0.81650 = [-1.22474, 0, 1.22474]; padding -> 0
    s = 1 / math.sqrt(2 / 3)
    assert_close(masked_whiten(x, m, eps=0.0), t([[-s, 0, s, 0]]))
    # shift_mean=False adds the mean 2 back: [0.77526, 2, 3.22474, 0]
    assert_close(masked_whiten(x, m, shift_mean=False, eps=0.0), t([[2 - s, 2, 2 + s, 0]]))


def test_masked_whiten_random_matches_unbiased_false():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 9, generator=g)
    m = torch.rand(4, 9, generator=g) > 0.3
    out = masked_whiten(x, m)
    v = x[m]
    assert_close(out[m], (v - v.mean()) / torch.sqrt(v.var(unbiased=False) + 1e-8))
    assert_close(out[m].mean(), t(0.0), atol=1e-6, rtol=0)


# ---------------------------------------------------------------- logits -> logp / entropy


def test_logprobs_from_logits_by_hand():
    logits = t([[[0.0, math.log(3.0)]]])  # probs [1/4, 3/4]
    assert_close(logprobs_from_logits(logits, torch.tensor([[1]])), t([[math.log(0.75)]]))
    # temperature 2: logits/2 = [0, ln(3)/2] -> probs [1, sqrt3] / (1 + sqrt3)
    # token 0 -> log p = -ln(1 + sqrt3) = -1.00505
    assert_close(
        logprobs_from_logits(logits, torch.tensor([[0]]), temperature=2.0),
        t([[-math.log(1 + math.sqrt(3))]]),
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_from_logits_matches_categorical(temperature):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 11, generator=g) * 3
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    ref = torch.distributions.Categorical(logits=logits / temperature).log_prob(tokens)
    assert_close(logprobs_from_logits(logits, tokens, temperature), ref)


def test_logprobs_from_logits_bf16_computes_in_float32():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 4, 7, generator=g) * 3).to(torch.bfloat16)
    tokens = torch.randint(0, 7, (2, 4), generator=g)
    out = logprobs_from_logits(logits, tokens)
    assert out.dtype == torch.float32
    ref = torch.distributions.Categorical(logits=logits.float()).log_prob(tokens)
    assert_close(out, ref)


def test_logprobs_from_logits_gradient():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    tokens = torch.randint(0, 5, (2, 3))
    logprobs_from_logits(logits, tokens).sum().backward()
    # d log p_k / d z = onehot(k) - softmax(z)
    expect = torch.nn.functional.one_hot(tokens, 5).float() - torch.softmax(logits.detach(), -1)
    assert_close(logits.grad, expect)


def test_entropy_from_logits():
    # uniform over 4 -> ln 4 = 1.38629
    # [0, ln3] -> p = [1/4, 3/4]: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.34657 + 0.21576 = 0.56233
    logits = t([[[0, 0, 0, 0], [0, math.log(3.0), -1e9, -1e9]]])
    expect = t([[math.log(4), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]])
    assert_close(entropy_from_logits(logits), expect)
    g = torch.Generator().manual_seed(3)
    r = torch.randn(3, 4, 13, generator=g) * 4
    assert_close(entropy_from_logits(r), torch.distributions.Categorical(logits=r).entropy())


# ---------------------------------------------------------------- KL


def test_kl_penalty_kinds_by_hand():
    logp = t([[-1.0, -2.0]])
    ref = t([[-2.0, -1.0]])
    # log ratio logp-ref = [1, -1]
    assert_close(kl_penalty(logp, ref, "k1"), t([[1.0, -1.0]]))
    # k2 = 0.5 * d^2 = [0.5, 0.5]
    assert_close(kl_penalty(logp, ref, "k2"), t([[0.5, 0.5]]))
    # k3 with u = ref - logp = [-1, 1]: e^-1 + 1 - 1 = 0.36788 ; e^1 - 1 - 1 = 0.71828
    assert_close(kl_penalty(logp, ref, "k3"), t([[math.exp(-1), math.e - 2]]))
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(logp, ref, "k4")


def test_kl_penalty_k3_nonnegative_and_zero_at_equal():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(5, 6, generator=g) * 3, torch.randn(5, 6, generator=g) * 3
    assert (kl_penalty(a, b, "k3") >= 0).all()
    assert_close(kl_penalty(a, a, "k3"), torch.zeros(5, 6))


def test_kl_loss():
    logp = t([[-1.0, -2.0, -5.0]])
    ref = t([[-2.0, -1.0, 0.0]])
    m = t([[1, 1, 0]])
    # k3 on valid tokens = [0.36788, 0.71828] -> mean 0.54308 (third token is padding)
    assert_close(kl_loss(logp, ref, m), t((math.exp(-1) + math.e - 2) / 2))
    # k1 = [1, -1] -> 0 ; normalizer=4 -> (0.36788 + 0.71828)/4
    assert_close(kl_loss(logp, ref, m, kind="k1"), t(0.0))
    assert_close(kl_loss(logp, ref, m, normalizer=4.0), t((math.exp(-1) + math.e - 2) / 4))


# ---------------------------------------------------------------- rewards and advantages


def test_token_level_rewards_padded_rows():
    scores = t([1.0, 2.0, 3.0])
    kl = t([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]])
    m = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    # kl_coef 0.5: row0 = [-0.05, -0.10, -0.15 + 1] ; row1 = [-0.2 + 2, 0, 0] ; row2 no tokens -> 0
    expect = t([[-0.05, -0.1, 0.85], [1.8, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert_close(token_level_rewards(scores, kl, m, 0.5), expect)
    assert_close(token_level_rewards(scores, kl, m.bool(), 0.5), expect)


def test_compute_gae_by_hand():
    # gamma = lam = 0.5, so gamma*lam = 0.25. Row 0 (full), r = [1, 0, 2], V = [1, 2, 4]:
    #   t=2: delta = 2 + 0.5*0 - 4 = -2            A2 = -2
    #   t=1: delta = 0 + 0.5*4 - 2 = 0             A1 = 0 + 0.25*(-2) = -0.5
    #   t=0: delta = 1 + 0.5*2 - 1 = 1             A0 = 1 + 0.25*(-0.5) = 0.875
    #   returns = A + V = [1.875, 1.5, 2]
    # Row 1: same but the 4th token is padding (r=9, V=7 there must be ignored) -> same numbers.
    # Row 2: mask [1, 1, 0, 0], r = [1, 0, ...], V = [1, 2, ...]:
    #   t=1: delta = 0 + 0 - 2 = -2                A1 = -2
    #   t=0: delta = 1 + 0.5*2 - 1 = 1             A0 = 1 + 0.25*(-2) = 0.5
    #   returns = [1.5, 0]
    rewards = t([[1, 0, 2, 0], [1, 0, 2, 9], [1, 0, 5, 5]])
    values = t([[1, 2, 4, 0], [1, 2, 4, 7], [1, 2, 3, 3]])
    mask = t([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 0, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.5, lam=0.5)
    assert_close(adv, t([[0.875, -0.5, -2, 0], [0.875, -0.5, -2, 0], [0.5, -2, 0, 0]]))
    assert_close(ret, t([[1.875, 1.5, 2, 0], [1.875, 1.5, 2, 0], [1.5, 0, 0, 0]]))


def _reference_gae(rewards, values, mask, gamma, lam):
    """Plain Python loop, one row at a time, over the valid prefix only."""
    B, T = rewards.shape
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        n = int(mask[b].sum())
        last = 0.0
        for i in reversed(range(n)):
            next_v = float(values[b, i + 1]) if i + 1 < n else 0.0
            delta = float(rewards[b, i]) + gamma * next_v - float(values[b, i])
            last = delta + gamma * lam * last
            adv[b][i] = last
            ret[b][i] = last + float(values[b, i])
    return torch.tensor(adv), torch.tensor(ret)


@pytest.mark.parametrize("seed", range(5))
def test_compute_gae_matches_python_loop(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 7
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = T, 0  # always cover a full row and an empty row
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    gamma, lam = 0.9, 0.8
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = _reference_gae(rewards, values, mask, gamma, lam)
    assert_close(adv, ref_adv)
    assert_close(ret, ref_ret)


def test_compute_gae_no_grad_and_skips_holes():
    values = torch.tensor([[1.0, 5.0, 2.0]], requires_grad=True)
    rewards = t([[1.0, 7.0, 3.0]])
    adv, ret = compute_gae(rewards, values, t([[1, 0, 1]]), 0.5, 0.5)
    assert not adv.requires_grad and not ret.requires_grad
    # a masked hole is skipped: same as the compressed row r = [1, 3], V = [1, 2]
    #   A1 = 3 - 2 = 1 ; A0 = (1 + 0.5*2 - 1) + 0.25*1 = 1.25
    assert_close(adv, t([[1.25, 0.0, 1.0]]))
    assert_close(ret, t([[2.25, 0.0, 3.0]]))


def test_grpo_advantages_by_hand():
    scores = t([1.0, 0.0, 1.0, 1.0])
    # group [1, 0]: mean 0.5, unbiased std = sqrt((0.25 + 0.25)/1) = 0.70711
    #   -> (+-0.5) / (0.70711 + 1e-6) = +-0.70711
    # group [1, 1]: mean 1, std 0 -> 0 / (0 + 1e-6) = 0
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert_close(grpo_advantages(scores, 2), t([s, -s, 0.0, 0.0]))
    # without std scaling (Dr. GRPO): r - mean = [0.5, -0.5, 0, 0]
    assert_close(grpo_advantages(scores, 2, scale_by_std=False), t([0.5, -0.5, 0.0, 0.0]))
    # group of one has no baseline -> 0
    assert_close(grpo_advantages(scores, 1), torch.zeros(4))
    # one group of 4: mean 0.75, unbiased var = (3*0.0625 + 0.5625)/3 = 0.25, std 0.5
    #   -> [0.5, -1.5, 0.5, 0.5] (up to eps)
    assert_close(grpo_advantages(scores, 4, eps=0.0), t([0.5, -1.5, 0.5, 0.5]))


def test_grpo_advantages_bad_group_size():
    with pytest.raises(ValueError, match=r"5.*3|3.*5"):
        grpo_advantages(torch.zeros(5), 3)


def test_grpo_advantages_int_scores():
    assert_close(grpo_advantages(torch.tensor([2, 0]), 2, eps=0.0), t([math.sqrt(0.5), -math.sqrt(0.5)]))


def test_group_advantages_follow_group_ids_not_row_order():
    # group 7 = rows 0, 2, 4 with scores [0, 3, 6]: mean 3, unbiased std sqrt((9 + 0 + 9)/2) = 3
    #   -> [-1, 0, 1]; group 2 = rows 1, 5 with [4, 2]: mean 3, std sqrt(2) -> +-1/sqrt(2);
    # group 9 = row 3 alone: no baseline -> 0 (not nan, even with eps = 0).
    scores = t([0.0, 4.0, 3.0, 5.0, 6.0, 2.0])
    ids = torch.tensor([7, 2, 7, 9, 7, 2])
    h = 1 / math.sqrt(2)
    assert_close(group_advantages(scores, ids, eps=0.0), t([-1.0, h, 0.0, 0.0, 1.0, -h]))
    # Dr. GRPO: r - mean only
    assert_close(group_advantages(scores, ids, scale_by_std=False), t([-3.0, 1.0, 0.0, 0.0, 3.0, -1.0]))


# ---------------------------------------------------------------- importance weights


def test_importance_weights():
    behavior = t([[-1.0, -1.0, -1.0]])
    prox = behavior + t([[math.log(0.5), math.log(3.0), math.log(1.5)]]).requires_grad_()
    m = t([[1, 1, 0]])
    # exp(prox - behavior) = [0.5, 3, 1.5] -> cap 2 -> [0.5, 2, 1.5] -> padding 0 -> [0.5, 2, 0]
    w = importance_weights(prox, behavior, m, cap=2.0)
    assert_close(w, t([[0.5, 2.0, 0.0]]))
    assert not w.requires_grad
    assert_close(importance_weights(prox, behavior, m, cap=None), t([[0.5, 3.0, 0.0]]))


# ---------------------------------------------------------------- policy loss


def _policy_case():
    # clip eps = 0.2, window [0.8, 1.2]; 4 valid tokens + 1 padding token
    #   a: ratio 1.5, A=+1: unclipped -1.5, clipped -1.2 -> max -1.2  (clipped)
    #   b: ratio 0.9, A=+1: both -0.9                     -> -0.9     (not clipped)
    #   c: ratio 1.5, A=-1: unclipped 1.5, clipped 1.2    -> 1.5      (not clipped, pessimistic)
    #   d: ratio 0.5, A=-2: unclipped 1.0, clipped 1.6    -> 1.6      (clipped)
    #   loss = (-1.2 - 0.9 + 1.5 + 1.6) / 4 = 1.0 / 4 = 0.25 ; clip_frac = 2/4
    ratios = [1.5, 0.9, 1.5, 0.5, 1.0]
    old = t([[-1.0, -2.0, -0.5, -1.5, -3.0]])
    logp = (old + t([[math.log(r) for r in ratios]])).requires_grad_()
    adv = t([[1.0, 1.0, -1.0, -2.0, 5.0]])
    mask = t([[1, 1, 1, 1, 0]])
    return logp, old, adv, mask, ratios


def test_policy_loss_by_hand():
    logp, old, adv, mask, ratios = _policy_case()
    loss, stats = policy_loss(logp, old, adv, mask, clip_ratio=0.2)
    assert_close(loss, t(0.25))
    assert_close(stats["clip_frac"], t(0.5))
    # approx_kl = mean 0.5*ln(r)^2 over valid: 0.5*(0.16440 + 0.01110 + 0.16440 + 0.48045)/4 = 0.10254
    assert_close(stats["approx_kl"], t(sum(0.5 * math.log(r) ** 2 for r in ratios[:4]) / 4))
    assert all(not v.requires_grad for v in stats.values())
    loss.backward()
    # clipped tokens give no gradient; unclipped d(-A*ratio)/dlogp = -A*ratio, /4:
    #   b: -0.9/4 = -0.225 ; c: 1.5/4 = 0.375
    assert_close(logp.grad, t([[0.0, -0.225, 0.375, 0.0, 0.0]]))


def test_policy_loss_normalizer_and_is_weights():
    logp, old, adv, mask, _ = _policy_case()
    # normalizer 8 instead of 4 valid tokens: 1.0 / 8
    loss, _ = policy_loss(logp, old, adv, mask, 0.2, normalizer=8.0)
    assert_close(loss, t(0.125))
    # is_weights [2, 1, 1, 1, 1]: (-2.4 - 0.9 + 1.5 + 1.6) / 4 = -0.05
    w = t([[2.0, 1.0, 1.0, 1.0, 1.0]])
    loss, _ = policy_loss(logp, old, adv, mask, 0.2, is_weights=w)
    assert_close(loss, t(-0.05))
    with pytest.raises(ValueError):
        policy_loss(logp, old, adv, mask, 0.2, normalizer=0.0)


def test_policy_loss_empty_mask_is_zero():
    logp, old, adv, mask, _ = _policy_case()
    loss, stats = policy_loss(logp, old, adv, torch.zeros_like(mask), 0.2)
    assert_close(loss, t(0.0))
    assert_close(stats["clip_frac"], t(0.0))


def _random_batch(seed, B=6, T=5):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, T, generator=g) - 2
    logp = old + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    w = importance_weights(old, old + 0.2 * torch.randn(B, T, generator=g), mask, cap=1.5)
    return logp, old, adv, mask, w


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("use_w", [False, True])
def test_policy_loss_normalizer_split_matches_full_batch(seed, use_w):
    logp, old, adv, mask, w = _random_batch(seed)
    w = w if use_w else None
    n = float(mask.sum())

    full_logp = logp.clone().requires_grad_()
    full, _ = policy_loss(full_logp, old, adv, mask, 0.2, is_weights=w)
    full.backward()

    split_logp = logp.clone().requires_grad_()
    total = 0.0
    for sl in (slice(0, 3), slice(3, 6)):
        part, _ = policy_loss(
            split_logp[sl], old[sl], adv[sl], mask[sl], 0.2, normalizer=n,
            is_weights=None if w is None else w[sl],
        )
        part.backward()  # gradients accumulate, as across micro-batches / summed over ranks
        total = total + part.detach()
    assert_close(total, full.detach())
    assert_close(split_logp.grad, full_logp.grad)


# ---------------------------------------------------------------- value loss


def test_value_loss_by_hand():
    # c = 0.2, R = 1, old = 0.5 everywhere; 3 valid tokens + 1 padding token
    #   a: v=1.0: unclipped 0;    v_clip = 0.5+0.2 = 0.7 -> 0.09  -> 0.5*0.09 = 0.045 (clipped)
    #   b: v=0.6: inside the window, both (0.6-1)^2 = 0.16   -> 0.08           (not clipped)
    #   c: v=0.0: unclipped 1.0;  v_clip = 0.3 -> 0.49        -> 0.5*1.0 = 0.5 (not clipped)
    #   loss = (0.045 + 0.08 + 0.5) / 3 = 0.208333 ; value_clip_frac = 1/3
    values = t([[1.0, 0.6, 0.0, 9.0]]).requires_grad_()
    old = t([[0.5, 0.5, 0.5, 0.5]])
    ret = t([[1.0, 1.0, 1.0, 1.0]])
    mask = t([[1, 1, 1, 0]])
    loss, stats = value_loss(values, old, ret, mask, clip_range=0.2)
    assert_close(loss, t(0.625 / 3))
    assert_close(stats["value_clip_frac"], t(1 / 3))
    loss.backward()
    # a: clipped branch is flat in v -> 0 ; b: (v-R)/3 = -0.4/3 ; c: (0-1)/3
    assert_close(values.grad, t([[0.0, -0.4 / 3, -1 / 3, 0.0]]))
    loss8, _ = value_loss(values, old, ret, mask, clip_range=0.2, normalizer=8)
    assert_close(loss8, t(0.625 / 8))


def test_value_loss_normalizer_split_matches_full_batch():
    g = torch.Generator().manual_seed(7)
    values = torch.randn(6, 5, generator=g)
    old = values + 0.3 * torch.randn(6, 5, generator=g)
    ret = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    n = float(mask.sum())
    full_v = values.clone().requires_grad_()
    full, _ = value_loss(full_v, old, ret, mask, 0.2)
    full.backward()
    split_v = values.clone().requires_grad_()
    parts = [value_loss(split_v[s], old[s], ret[s], mask[s], 0.2, normalizer=n)[0]
             for s in (slice(0, 2), slice(2, 6))]
    sum(parts).backward()
    assert_close(sum(p.detach() for p in parts), full.detach())
    assert_close(split_v.grad, full_v.grad)
