"""The algorithm options' maths: loss aggregation, clip-higher and dual clip, GSPO, the entropy
bonus, the critic-free advantage estimators and the learning-rate schedule, on hand-computed
small cases; splitting a batch never changes the gradient; the defaults are the losses of
before the options, bit for bit."""

from __future__ import annotations

import math
import subprocess
import types
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from pipeline.advantages import (ESTIMATORS, discounted_returns, grpo_batch_std, grpo_no_std, reinforce_plus_plus,
                                 reinforce_plus_plus_baseline, rloo)
from pipeline.algorithms import LOSS_AGGREGATIONS, aggregate_loss, kl_loss, kl_penalty, masked_sum, policy_loss
from pipeline.policy_losses import POLICY_LOSSES, gspo_policy_loss
from pipeline.schedules import lr_factor


def t(x):
    return torch.tensor(x, dtype=torch.float32)


# ------------------------------------------------------------------ loss aggregation

PER_TOKEN = t([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
MASK = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])   # valid: 1, 2 | 4 | none -> 3 tokens, 2 sequences


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 7 / 3),                     # (1 + 2 + 4) / 3 tokens
    ("token-sum", 7.0),
    ("seq-mean-token-mean", (1.5 + 4) / 2),    # row means 1.5 and 4; the empty row is not a sequence
    ("seq-mean-token-sum", (3 + 4) / 2),
    ("seq-mean-token-sum-norm", 7 / (2 * 4)),  # horizon 4
])
def test_each_aggregation_by_hand(mode, expected):
    assert_close(aggregate_loss(PER_TOKEN, MASK, mode, horizon=4), t(expected))


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 7 / 6), ("token-sum", 7.0), ("seq-mean-token-mean", 5.5 / 4), ("seq-mean-token-sum", 7 / 4),
    ("seq-mean-token-sum-norm", 7 / (4 * 4)),
])
def test_aggregations_divide_by_the_global_counts_given(mode, expected):
    assert_close(aggregate_loss(PER_TOKEN, MASK, mode, tokens=6.0, sequences=4.0, horizon=4), t(expected))


def test_an_unknown_mode_or_a_missing_horizon_is_an_error():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        aggregate_loss(PER_TOKEN, MASK, "mean")
    with pytest.raises(ValueError, match="needs a horizon > 0"):
        aggregate_loss(PER_TOKEN, MASK, "seq-mean-token-sum-norm")


def test_kl_loss_follows_the_aggregation():
    logp, ref = t([[0.0, -1.0], [-2.0, 0.0]]), t([[-1.0, -1.0], [-1.0, 0.0]])
    mask = t([[1, 1], [1, 0]])
    k3 = kl_penalty(logp, ref, "k3")   # row 0: e^-1 - (-1) - 1 = e^-1, 0; row 1: e^1 - 1 - 1 = e - 2
    rows = [math.exp(-1) / 2, math.e - 2]
    assert_close(kl_loss(logp, ref, mask, loss_agg_mode="seq-mean-token-mean"), t(sum(rows) / 2))
    assert_close(kl_loss(logp, ref, mask, loss_agg_mode="token-sum"), masked_sum(k3, mask))


# ------------------------------------------------------------------ clipping

def _ratios(*ratios):
    """logp, old_logp with exp(logp - old) = ratios, one token per row."""
    logp = torch.log(t([[r] for r in ratios])).requires_grad_()
    return logp, torch.zeros_like(logp)


def test_clip_higher_by_hand():
    # ratio 1.5, A = +1: clipped at 1 + 0.28 -> loss -1.28 (symmetric 0.2: -1.2)
    # ratio 0.5, A = -1: max(0.5, clip(0.5, 0.8, 1.28) = 0.8) -> 0.8 (the lower clip is clip_ratio)
    logp, old = _ratios(1.5, 0.5)
    adv, mask = t([[1.0], [-1.0]]), torch.ones(2, 1)
    loss, stats = policy_loss(logp, old, adv, mask, 0.2, clip_ratio_high=0.28, loss_agg_mode="token-sum")
    assert_close(loss, t(-1.28 + 0.8))
    assert_close(stats["clip_frac"], t(1.0))
    symmetric, _ = policy_loss(logp, old, adv, mask, 0.2, loss_agg_mode="token-sum")
    assert_close(symmetric, t(-1.2 + 0.8))


def test_dual_clip_bounds_negative_advantages_only():
    # ratio 4, A = -1: PPO's max(4, 1.2) = 4; the dual clip caps it at c * |A| = 3 (and its gradient is 0).
    # ratio 4, A = +1: max(-4, -1.2) = -1.2, untouched by the dual clip.
    logp, old = _ratios(4.0, 4.0)
    adv, mask = t([[-1.0], [1.0]]), torch.ones(2, 1)
    loss, stats = policy_loss(logp, old, adv, mask, 0.2, clip_ratio_c=3.0, loss_agg_mode="token-sum")
    assert_close(loss, t(3.0 - 1.2))
    assert_close(stats["clip_frac_lower"], t(0.5))
    loss.backward()
    assert_close(logp.grad, torch.zeros(2, 1))
    plain, stats = policy_loss(logp, old, adv, mask, 0.2, loss_agg_mode="token-sum")
    assert_close(plain, t(4.0 - 1.2))
    assert_close(stats["clip_frac_lower"], t(0.0))


# ------------------------------------------------------------------ GSPO

def test_gspo_by_hand():
    # Row 0: token log-ratios log 2 and 0 -> s = exp(log 2 / 2) = sqrt 2; A = +1 -> clipped at 1.2,
    # loss -1.2 on both tokens (row mean -1.2), no gradient. Row 1: one valid token, ratio 0.81,
    # A = -1 -> loss 0.81, gradient d/dlogp = -A * s = 0.81, over 1 token and 2 sequences.
    logp = torch.log(t([[2.0, 1.0], [0.81, 5.0]])).requires_grad_()
    old = torch.zeros(2, 2)
    adv, mask = t([[1.0, 1.0], [-1.0, -1.0]]), t([[1, 1], [1, 0]])
    loss, stats = gspo_policy_loss(logp, old, adv, mask, 0.2, loss_agg_mode="seq-mean-token-mean")
    assert_close(loss, t((-1.2 + 0.81) / 2))
    assert_close(stats["clip_frac"], t(2 / 3))
    loss.backward()
    assert_close(logp.grad, t([[0.0, 0.0], [0.81 / 2, 0.0]]))


def test_gspo_gradient_is_the_sequence_ratio_gradient_spread_over_tokens():
    # Unclipped, with one advantage per row, d loss / d logp_bt = -A_b s_b / n_b: the gradient of
    # -A_b * s_b(theta) with s_b = exp(mean_t log-ratio), under seq-mean-token-mean.
    g = torch.Generator().manual_seed(1)
    logp = (torch.randn(3, 4, generator=g) * 0.01).requires_grad_()
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    adv = t([[0.5], [-1.0], [2.0]]).expand(3, 4)
    loss, _ = gspo_policy_loss(logp, torch.zeros(3, 4), adv, mask, 0.2, loss_agg_mode="seq-mean-token-mean")
    loss.backward()
    n = mask.sum(-1, keepdim=True)
    s = torch.exp((logp.detach() * mask).sum(-1, keepdim=True) / n)
    assert_close(logp.grad, -adv * s / n * mask / 3)


def test_policy_losses_table():
    assert POLICY_LOSSES == {"ppo": policy_loss, "gspo": gspo_policy_loss}


# ------------------------------------------------------------------ the defaults are today's losses

def _ppo_loss_before(logp, old_logp, advantages, mask, clip_ratio, normalizer, is_weights):
    """The PPO loss as it was before the options (main at f1103d9), written out as the reference."""
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    per_token = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio))
    per_token = per_token * is_weights
    return torch.where(mask.bool(), per_token, torch.zeros(())).sum() / normalizer


def _kl_loss_before(logp, ref_logp, mask, normalizer):
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    return torch.where(mask.bool(), torch.exp(d) - d - 1.0, torch.zeros(())).sum() / normalizer


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_defaults_give_the_losses_and_gradients_of_before_bit_for_bit(seed):
    g = torch.Generator().manual_seed(seed)
    shape = (5, 7)
    logp = (torch.randn(shape, generator=g) * 0.3).requires_grad_()
    old, ref = logp.detach() + torch.randn(shape, generator=g) * 0.2, logp.detach() + torch.randn(shape, generator=g)
    adv, weights = torch.randn(shape, generator=g), torch.rand(shape, generator=g) + 0.5
    mask = (torch.rand(shape, generator=g) > 0.3).float()
    new = policy_loss(logp, old, adv, mask, 0.2, normalizer=40.0, is_weights=weights)[0] + 0.1 * kl_loss(
        logp, ref, mask, normalizer=40.0)
    (new_grad,) = torch.autograd.grad(new, logp)
    before = _ppo_loss_before(logp, old, adv, mask, 0.2, 40.0, weights) + 0.1 * _kl_loss_before(logp, ref, mask, 40.0)
    (before_grad,) = torch.autograd.grad(before, logp)
    assert torch.equal(new, before) and torch.equal(new_grad, before_grad)


def _module_before_options():
    """pipeline/algorithms.py as it was before the options (main at f1103d9), from git."""
    root = Path(__file__).resolve().parents[2]
    shown = subprocess.run(["git", "-C", str(root), "show", "f1103d9:pipeline/algorithms.py"], capture_output=True,
                           text=True)
    if shown.returncode != 0:
        pytest.skip(f"the commit before the options is not in this checkout: {shown.stderr.strip()}")
    module = types.ModuleType("algorithms_before_options")
    exec(compile(shown.stdout, "algorithms_before_options.py", "exec"), module.__dict__)
    return module


def test_defaults_equal_the_functions_of_before_bit_for_bit():
    before = _module_before_options()
    g = torch.Generator().manual_seed(5)
    shape = (6, 9)
    logp = (torch.randn(shape, generator=g) * 0.3).requires_grad_()
    old, ref = logp.detach() + torch.randn(shape, generator=g) * 0.2, logp.detach() + torch.randn(shape, generator=g)
    adv, weights = torch.randn(shape, generator=g), torch.rand(shape, generator=g) + 0.5
    mask = (torch.rand(shape, generator=g) > 0.3).float()
    for normalizer in (None, 37.0):
        for now, then in ((policy_loss, before.policy_loss), (kl_loss, before.kl_loss)):
            args = (logp, old, adv, mask, 0.2, normalizer, weights) if now is policy_loss else (logp, ref, mask)
            kwargs = {} if now is policy_loss else {"normalizer": normalizer}
            new_loss, old_loss = now(*args, **kwargs), then(*args, **kwargs)
            new_loss, old_loss = (new_loss[0], old_loss[0]) if isinstance(new_loss, tuple) else (new_loss, old_loss)
            assert torch.equal(new_loss, old_loss)
            assert torch.equal(torch.autograd.grad(new_loss, logp)[0], torch.autograd.grad(old_loss, logp)[0])
    scores, groups = torch.randn(12, generator=g), torch.arange(12) // 4
    assert torch.equal(ESTIMATORS["grpo"](scores, groups, torch.ones(12, 3), 1.0),
                       before.group_advantages(scores, groups)[:, None] * torch.ones(12, 3))


# ------------------------------------------------------------------ splitting never changes the gradient

class TinyPolicy(torch.nn.Module):
    """logp of a token = log_softmax(features @ W)[token]: enough to give each term a real gradient."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 6, generator=torch.Generator().manual_seed(3)))

    def forward(self, features, tokens):
        logits = features @ self.weight
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
        p = torch.softmax(logits, -1)
        return logp, torch.logsumexp(logits, -1) - (p * logits).sum(-1)


def _batch(rows=7, width=5):
    g = torch.Generator().manual_seed(11)
    lengths = torch.tensor([5, 1, 3, 0, 4, 2, 5])[:rows]   # uneven rows, one empty
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    noise = lambda: torch.randn(rows, width, generator=g) * 0.1 - 1.8  # noqa: E731 - log-probs near log(1/6)
    return dict(features=torch.randn(rows, width, 4, generator=g),
                tokens=torch.randint(0, 6, (rows, width), generator=g), old=noise(), ref=noise(),
                adv=torch.randn(rows, 1, generator=g).expand(rows, width).contiguous(), mask=mask)


def _loss(model, b, rows, mode, loss_name, tokens, sequences):
    logp, entropy = model(b["features"][rows], b["tokens"][rows])
    mask = b["mask"][rows]
    agg = dict(loss_agg_mode=mode, sequences=sequences, horizon=5.0)
    loss, _ = POLICY_LOSSES[loss_name](logp, b["old"][rows], b["adv"][rows], mask, 0.2, normalizer=tokens,
                                       clip_ratio_high=0.28, clip_ratio_c=3.0, **agg)
    loss = loss + 0.1 * kl_loss(logp, b["ref"][rows], mask, normalizer=tokens, **agg)
    return loss - 0.01 * aggregate_loss(entropy, mask, mode, tokens, sequences, 5.0)


def _gradient(parts, mode, loss_name, global_counts=True):
    """Gradient summed over `parts` (lists of row indexes: micro-batches, or ranks' micro-batches)."""
    b, model = _batch(), TinyPolicy()
    tokens, sequences = float(b["mask"].sum()), float((b["mask"].sum(-1) > 0).sum())
    for rows in parts:
        rows = torch.tensor(rows)
        counts = (tokens, sequences) if global_counts else (None, None)
        _loss(model, b, rows, mode, loss_name, *counts).backward()   # accumulates, as micro-batches do
    return model.weight.grad


SPLITS = {"micro-batches": [[0, 1], [2, 3], [4, 5], [6]],
          "2 ranks x micro-batches": [[0, 2, 4], [6], [1, 3], [5]]}   # rank 0: rows 0,2,4,6; rank 1: 1,3,5


@pytest.mark.parametrize("loss_name", ["ppo", "gspo"])
@pytest.mark.parametrize("mode", list(LOSS_AGGREGATIONS))
@pytest.mark.parametrize("split", list(SPLITS))
def test_splitting_a_batch_leaves_the_gradient_unchanged(mode, loss_name, split):
    whole = _gradient([list(range(7))], mode, loss_name)
    assert whole.abs().sum() > 0
    assert_close(_gradient(SPLITS[split], mode, loss_name), whole, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_local_counts_would_change_the_gradient(mode):
    """The property above is not vacuous: each part dividing by its own counts differs."""
    whole = _gradient([list(range(7))], mode, "ppo")
    local = _gradient(SPLITS["micro-batches"], mode, "ppo", global_counts=False)
    assert not torch.allclose(local, whole, rtol=1e-3)


# ------------------------------------------------------------------ advantage estimators

SCORES = t([1, 0, 2, 3, 3, 0])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])
ONES = torch.ones(6, 2)


def test_grpo_without_std_is_reward_minus_group_mean():
    # group means 1 and 2
    assert_close(grpo_no_std(SCORES, GROUPS, ONES, 1.0), t([0, -1, 1, 1, 1, -2])[:, None].expand(6, 2))


def test_grpo_with_batch_std():
    # batch rewards mean 1.5, squared deviations sum 9.5, unbiased var 9.5 / 5 = 1.9
    std = math.sqrt(1.9)
    assert_close(grpo_batch_std(SCORES, GROUPS, ONES, 1.0)[:, 0], t([0, -1, 1, 1, 1, -2]) / (std + 1e-6))


def test_rloo_leave_one_out_baseline():
    # row 0: 1 - (0 + 2) / 2 = 0; row 1: 0 - (1 + 2) / 2 = -1.5; row 5: 0 - (3 + 3) / 2 = -3
    assert_close(rloo(SCORES, GROUPS, ONES, 1.0)[:, 0], t([0, -1.5, 1.5, 1.5, 1.5, -3]))
    # a group of one has no other sample: 0
    assert_close(rloo(t([5.0]), torch.tensor([0]), torch.ones(1, 1), 1.0), t([[0.0]]))


def test_reinforce_plus_plus_discounts_then_whitens_over_the_batch():
    # gamma 0.5: row 0 (3 tokens, score 1) -> returns 0.25, 0.5, 1; row 1 (1 token, score -1) -> -1
    mask = t([[1, 1, 1], [1, 0, 0]])
    returns = discounted_returns(t([[0, 0, 1], [-1, 0, 0]]), mask, 0.5)
    assert_close(returns, t([[0.25, 0.5, 1.0], [-1.0, 0, 0]]))
    values = t([0.25, 0.5, 1.0, -1.0])   # mean 0.1875, biased var 2.171875 / 4
    white = (values - 0.1875) / math.sqrt(2.171875 / 4 + 1e-8)
    adv = reinforce_plus_plus(t([1.0, -1.0]), torch.tensor([0, 1]), mask, 0.5)
    assert_close(adv, t([[white[0], white[1], white[2]], [white[3], 0, 0]]))


def test_reinforce_plus_plus_baseline_centres_per_group_then_whitens():
    mask = torch.ones(6, 1)
    mask = torch.cat([mask, t([[1], [0], [0], [0], [0], [0]])], 1)   # row 0 has 2 tokens: 7 valid values
    # centred [0, -1, 1, 1, 1, -2], on 7 tokens: 0, 0, -1, 1, 1, 1, -2 -> mean 0, var 8 / 7
    adv = reinforce_plus_plus_baseline(SCORES, GROUPS, mask, 1.0)
    scale = 1 / math.sqrt(8 / 7 + 1e-8)
    assert_close(adv, t([[0, 0], [-1, 0], [1, 0], [1, 0], [1, 0], [-2, 0]]) * scale)


def test_every_estimator_gives_zero_on_padding():
    mask = t([[1, 0], [1, 1], [0, 0], [1, 0], [1, 1], [1, 0]])
    for name, estimator in ESTIMATORS.items():
        adv = estimator(SCORES, GROUPS, mask, 1.0)
        assert adv.shape == (6, 2) and torch.all(adv[mask == 0] == 0), name


# ------------------------------------------------------------------ learning-rate schedule

@pytest.mark.parametrize("update, schedule, min_ratio, expected", [
    (0, "linear", 0.0, 0.5),        # warmup 2: (0 + 1) / 2
    (1, "linear", 0.0, 1.0),        # (1 + 1) / 2
    (2, "linear", 0.0, 1.0),        # decay starts: progress 0 / 8
    (6, "linear", 0.0, 0.5),        # progress 4 / 8
    (6, "linear", 0.1, 0.55),       # 0.1 + 0.9 * 0.5
    (10, "linear", 0.0, 0.0),       # the end
    (12, "linear", 0.0, 0.0),       # past the end it stays there
    (4, "cosine", 0.0, 0.5 * (1 + math.cos(math.pi / 4))),   # progress 2 / 8
    (6, "cosine", 0.0, 0.5),
    (6, "constant", 0.1, 1.0),
])
def test_lr_factor_by_hand(update, schedule, min_ratio, expected):
    assert lr_factor(update, 10, warmup=2, schedule=schedule, min_ratio=min_ratio) == pytest.approx(expected)


def test_the_default_schedule_is_exactly_the_base_rate():
    assert all(lr_factor(update, 20) == 1.0 for update in range(25))


def test_the_step_figures_carry_entropy_and_the_dual_clip_share_per_token():
    from pipeline.metrics import normalise_update_stats

    # two optimizer steps of 10 and 30 tokens: entropy sums 25 and 55 -> 80 / 40 tokens = 2.0
    totals = {"tokens": 40.0, "clip_tokens": 4.0, "clip_lower_tokens": 2.0, "entropy_sum": 80.0,
              "is_weight_sum": 40.0, "policy_loss": 3.0}
    figures = normalise_update_stats(totals, optimizer_steps=2)
    assert figures == {"policy_loss": 1.5, "clip_frac": 0.1, "is_weight_mean": 1.0, "clip_frac_lower": 0.05,
                       "entropy": 2.0}
