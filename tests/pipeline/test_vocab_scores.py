"""vocab_scores.projected_scores: log-probabilities, entropies and their gradients against
hand-computed values and against autograd through the log-softmax, chunk by chunk."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.algorithms import entropy_from_logits, logprobs_from_logits
from pipeline.vocab_scores import projected_scores


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    """A head without a bias whose weight is `weight` (out x in)."""
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    with torch.no_grad():
        head.weight.copy_(weight)
    return head


def test_two_tokens_by_hand():
    """Logits (0, ln 3): p = (1/4, 3/4). Token 1 sampled, temperature 1."""
    hidden = torch.tensor([[0.0, math.log(3.0)]], requires_grad=True)
    head = _linear(torch.eye(2))   # logits = hidden
    weight = head.weight
    logprobs, entropy = projected_scores(head, hidden, torch.tensor([1]), 1.0, entropy_grad=True)
    p = (0.25, 0.75)
    h = -(p[0] * math.log(p[0]) + p[1] * math.log(p[1]))
    assert logprobs.item() == pytest.approx(math.log(0.75), abs=1e-6)
    assert entropy.item() == pytest.approx(h, abs=1e-6)
    (logprobs.sum() + 2.0 * entropy.sum()).backward()
    # d log p_1 / dz = onehot(1) - p; dH / dz_k = -p_k (log p_k + H)
    expected = [(0 - p[k]) + (1.0 if k == 1 else 0.0) - 2.0 * p[k] * (math.log(p[k]) + h) for k in range(2)]
    assert hidden.grad[0].tolist() == pytest.approx(expected, abs=1e-6)
    # logits = hidden @ weight.T: d/dW[k, j] = grad_z[k] * hidden[j]
    assert weight.grad[:, 1].tolist() == pytest.approx([g * math.log(3.0) for g in expected], abs=1e-6)
    assert weight.grad[:, 0].tolist() == pytest.approx([0.0, 0.0], abs=1e-7)


def test_temperature_by_hand():
    """Logits (0, 2 ln 3) at temperature 2 give the same p = (1/4, 3/4); the gradient of
    log p_0 over the logits is (onehot(0) - p) / 2."""
    hidden = torch.tensor([[0.0, 2 * math.log(3.0)]], requires_grad=True)
    logprobs, entropy = projected_scores(_linear(torch.eye(2)), hidden, torch.tensor([0]), 2.0, entropy_grad=None)
    assert entropy is None   # not asked for: not computed
    assert logprobs.item() == pytest.approx(math.log(0.25), abs=1e-6)
    logprobs.sum().backward()
    assert hidden.grad[0].tolist() == pytest.approx([0.75 / 2, -0.75 / 2], abs=1e-6)


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_autograd_through_the_log_softmax(entropy_grad, temperature):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=generator, dtype=torch.float64).float().requires_grad_()
    head = _linear(torch.randn(300, 16, generator=generator))
    weight = head.weight
    tokens = torch.randint(0, 300, (37,), generator=generator)
    up_logprobs, up_entropy = torch.randn(37, generator=generator), torch.randn(37, generator=generator)

    def grads(logprobs, entropy):
        loss = (up_logprobs * logprobs).sum() + ((up_entropy * entropy).sum() if entropy_grad else 0.0)
        return torch.autograd.grad(loss, (hidden, weight))

    logprobs, entropy = projected_scores(head, hidden, tokens, temperature, entropy_grad=entropy_grad)
    mine = grads(logprobs, entropy)
    logits = hidden @ weight.T
    expected_logprobs = logprobs_from_logits(logits, tokens, temperature)
    expected_entropy = entropy_from_logits(logits / temperature)
    expected = grads(expected_logprobs, expected_entropy)
    # float32 rounding of logits of size ~10 (the two sum in different orders)
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-4, rtol=0)
    torch.testing.assert_close(entropy, expected_entropy, atol=1e-4, rtol=0)
    for got, want in zip(mine, expected):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert entropy.requires_grad == entropy_grad


def test_bf16_logits_give_bf16_gradients_computed_in_float32():
    """A bf16 model's logits: scores in float32, gradients in bf16 like the weights, within
    bf16 rounding of the float32 computation."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(20, 32, generator=generator)
    weight = torch.randn(500, 32, generator=generator) * 0.2
    tokens = torch.randint(0, 500, (20,), generator=generator)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        h = hidden.to(dtype).detach().requires_grad_()
        head = _linear(weight.to(dtype))
        w = head.weight
        logprobs, _ = projected_scores(head, h, tokens, 1.0)
        assert logprobs.dtype == torch.float32
        logprobs.sum().backward()
        assert h.grad.dtype == dtype and w.grad.dtype == dtype
        results[dtype] = logprobs.detach(), h.grad.float()
    torch.testing.assert_close(results[torch.bfloat16][0], results[torch.float32][0], atol=0.1, rtol=0)
    torch.testing.assert_close(results[torch.bfloat16][1], results[torch.float32][1], atol=0.05, rtol=0.05)


def test_the_heads_bias_and_forward_hooks_count_in_both_passes():
    """The head is called, not read: a bias and a hook that rescales its logits enter the
    scores and the gradients (of the hidden states, the weight and the bias) as they do
    when the head's logits are differentiated op by op."""
    generator = torch.Generator().manual_seed(2)
    head = torch.nn.Linear(8, 50)
    head.register_forward_hook(lambda module, args, logits: logits * 1.5)
    hidden = torch.randn(11, 8, generator=generator, requires_grad=True)
    tokens = torch.randint(0, 50, (11,), generator=generator)
    logprobs, entropy = projected_scores(head, hidden, tokens, 0.8, entropy_grad=True)
    mine = torch.autograd.grad((logprobs.sum() + entropy.sum()), (hidden, head.weight, head.bias))
    logits = head(hidden)
    expected = logprobs_from_logits(logits, tokens, 0.8), entropy_from_logits(logits / 0.8)
    theirs = torch.autograd.grad(expected[0].sum() + expected[1].sum(), (hidden, head.weight, head.bias))
    torch.testing.assert_close(logprobs, expected[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, expected[1], atol=1e-5, rtol=0)
    for got, want in zip(mine, theirs):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_the_scattered_and_the_elementwise_one_hot_give_one_gradient(with_entropy):
    """Eagerly the token's one-hot is a scatter, compiled a comparison: the same numbers."""
    from pipeline.vocab_scores import logits_gradient, token_scores

    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 40, generator=generator) * 3
    tokens = torch.randint(0, 40, (9,), generator=generator)
    grad_logprobs, grad_entropy = torch.randn(9, generator=generator), torch.randn(9, generator=generator)
    _, entropy, lse = token_scores(logits, tokens, 0.6)
    args = (logits, tokens, lse, entropy, grad_logprobs, grad_entropy if with_entropy else None, 0.6)
    torch.testing.assert_close(logits_gradient(*args, elementwise=True), logits_gradient(*args), atol=1e-6, rtol=0)
