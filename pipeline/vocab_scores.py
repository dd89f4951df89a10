"""Response tokens' log-probabilities and entropies from final hidden states, through the
output projection onto the vocabulary, as one autograd function.

Each chunk of tokens' logits (tokens x vocabulary: 2048 x 152k for Qwen2 in a compiled
update) is the largest tensor of an update. Differentiated op by op, a chunk's float32 copy,
its log-softmax and its probabilities are kept or recomputed for their backward, each one
more pass over the block. Here the forward keeps only three numbers a token (the
log-sum-exp, the entropy and the token's log-probability); the backward runs the head again
for the chunk's logits and turns them into their gradient in one pass:

    z = logits / T,  log p = z - lse,  H = lse - sum_v p_v z_v
    d log p_t / dz = onehot(t) - p
    dH / dz        = -p (log p + H)

then the head's own backward (a linear head's two products). Everything is computed in
float32 from the logits and the gradient handed back in the logits' dtype, as autograd would.
"""

from __future__ import annotations

import torch


def token_scores(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                 with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(N, V) logits, (N,) tokens -> float32 (N,) log p(token), entropy (None unless
    `with_entropy`) and log-sum-exp of softmax(logits / temperature)."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logprobs = z.gather(-1, tokens[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return logprobs, None, lse
    p = torch.sub(z, lse[:, None]).exp_()
    return logprobs, lse - p.mul_(z).sum(-1), lse


def logits_gradient(logits: torch.Tensor, tokens: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor | None,
                    grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None, temperature: float,
                    elementwise: bool = False) -> torch.Tensor:
    """The gradient of sum(grad_logprobs * log p(token) + grad_entropy * H) over the logits,
    in their dtype (grad_entropy None: the entropy was not differentiated).

    The token's one-hot is added as a scatter of N values (eagerly the cheapest: a comparison
    is two more passes over the block), or with `elementwise` as a comparison, which keeps a
    compiled gradient one kernel from the logits to their gradient (a scatter needs the
    float32 block written out first). In-place steps save eager allocations."""
    logp = logits.float() - (lse * temperature)[:, None]
    if temperature != 1.0:
        logp.div_(temperature)
    p = logp.exp()
    if elementwise:
        picked = torch.arange(logits.shape[-1], device=logits.device)[None, :] == tokens[:, None]
        grad = torch.where(picked, 1.0 - p, -p).mul_(grad_logprobs[:, None])   # g_logp (onehot - p)
    else:
        grad = p.mul(-grad_logprobs[:, None])
        grad.index_put_((torch.arange(len(tokens), device=logits.device), tokens), grad_logprobs, accumulate=True)
    if grad_entropy is not None:   # - g_H p (log p + H)
        grad.sub_(logp.add_(entropy[:, None]).mul_(p).mul_(grad_entropy[:, None]))
    if temperature != 1.0:
        grad.div_(temperature)
    return grad.to(logits.dtype)


def _elementwise_logits_gradient(*args) -> torch.Tensor:
    return logits_gradient(*args, elementwise=True)


# Compiled (dynamic shapes: the last chunk is shorter) for models trained compiled, where
# each becomes one or two kernels over the block.
_compiled_token_scores = torch.compile(token_scores, dynamic=True)
_compiled_logits_gradient = torch.compile(_elementwise_logits_gradient, dynamic=True)


class _ProjectedScores(torch.autograd.Function):
    """The head's parameters are inputs (their gradients reach them through autograd as any
    other's); the head itself is called for the logits, in the backward again, so whatever
    it does (a bias, forward hooks) counts both times."""

    @staticmethod
    def forward(ctx, hidden, tokens, temperature: float, entropy_grad: bool | None, compiled: bool, head, *params):
        scores = _compiled_token_scores if compiled else token_scores
        logprobs, entropy, lse = scores(head(hidden), tokens, temperature, entropy_grad is not None)
        if entropy is None:   # not asked for: an empty placeholder (a function's outputs are tensors)
            entropy = logprobs.new_empty(0)
        ctx.save_for_backward(hidden, tokens, lse, entropy, *params)
        ctx.head, ctx.temperature, ctx.entropy_grad, ctx.compiled = head, temperature, bool(entropy_grad), compiled
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, tokens, lse, entropy, *params = ctx.saved_tensors
        wanted = [ctx.needs_input_grad[0], *ctx.needs_input_grad[6:]]
        with torch.enable_grad():
            states = hidden.detach().requires_grad_(wanted[0])
            logits = ctx.head(states)
        gradient = _compiled_logits_gradient if ctx.compiled else logits_gradient
        grad_logits = gradient(logits.detach(), tokens, lse, entropy, grad_logprobs,
                               grad_entropy if ctx.entropy_grad else None, ctx.temperature)
        inputs = [tensor for tensor, want in zip([states, *params], wanted) if want]
        grads = iter(torch.autograd.grad(logits, inputs, grad_logits) if inputs else ())
        return (next(grads) if wanted[0] else None, None, None, None, None, None,
                *(next(grads) if want else None for want in wanted[1:]))


def projected_scores(head: torch.nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float,
                     entropy_grad: bool | None = False,
                     compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N, H) final hidden states, (N,) tokens -> float32 (N,) log p(token) and entropy of
    softmax(head(hidden) / temperature). Differentiable in the hidden states and the head's
    parameters; the entropy too with `entropy_grad` True (False: a figure; None: not
    computed, returned as None). `compiled`: the passes over the logits through torch.compile."""
    logprobs, entropy = _ProjectedScores.apply(hidden, tokens, temperature, entropy_grad, compiled, head,
                                               *head.parameters())
    return logprobs, None if entropy_grad is None else entropy
