"""Sampling shared by the engines: the captured engine's sampler, the filters (top-k, top-p,
min-p) and the stop-string search.

The filters act on the temperature-scaled logits, in vLLM's order: min-p, then top-k, then
top-p on what is left, renormalised. They only choose which tokens can be sampled: every
engine reports the sampled token's log-probability under the unfiltered
log_softmax(logits / temperature), the distribution the actor's loss evaluates, so an
on-policy ratio starts at exactly 1.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch


def filters_active(top_k: int, top_p: float, min_p: float) -> bool:
    return top_k > 0 or top_p < 1.0 or min_p > 0.0


def filter_logits(scaled: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """(B, V) temperature-scaled logits -> the same with filtered-out tokens at -inf.

    min_p: drop a token whose probability is below min_p x the most likely token's.
    top_k: keep the k most likely (ties at the k-th value are kept).
    top_p: drop a token when the tokens ranked above it already hold top_p of the mass.
    The most likely token always survives. Shapes are fixed (no host syncs): it runs inside
    the cuda_graph engine's captured decode step.
    """
    if min_p > 0.0:
        logp = torch.log_softmax(scaled, dim=-1)
        threshold = logp.max(dim=-1, keepdim=True).values + math.log(min_p)  # a Python float: no copy to the device
        scaled = scaled.masked_fill(logp < threshold, float("-inf"))
    if top_k > 0:
        kth = torch.topk(scaled, min(top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = (cumsum_in_blocks(probs) - probs) > top_p
        scaled = scaled.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    return scaled


def sample_tokens(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) logits -> (B,) sampled tokens and (B,) their float32 logprobs.

    Tokens are sampled from log_softmax(logits / temperature) after the top-k / top-p /
    min-p filters (engines/sampling.py). The logprob returned is the unfiltered
    log_softmax(logits / temperature) of the sampled token: what the actor's loss
    evaluates, so on-policy ratios start at exactly 1 whatever the filters.
    Sampling is an exponential race (argmax_i p_i / E_i with E_i ~ Exp(1) picks i with
    probability p_i): one pass over the (filtered) logits, and it runs inside a CUDA graph.
    """
    scaled = logits.float() / temperature
    allowed = filter_logits(scaled, top_k, top_p, min_p) if filters_active(top_k, top_p, min_p) else scaled
    race = allowed - torch.empty_like(allowed).exponential_().log()  # a shift of `allowed` picks the same
    tokens = _argmax_by_stretches(race)
    logsumexp = torch.logsumexp(torch.logsumexp(_stretches(scaled), dim=-1), dim=-1)
    return tokens, scaled.gather(-1, tokens[:, None]).squeeze(-1) - logsumexp


# The sampler reduces each row over the vocabulary in this many stretches, then over their
# results. Compiled, a reduction over whole rows is one program a row: 256 rows of 152k
# logits kept an H100's 132 multiprocessors at two programs each, and the sampler took 0.2 ms
# of a 2.2 ms decode step.
VOCAB_STRETCHES = 32


def _stretches(values: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B, S, ceil(V / S)), the vocabulary in S stretches, the last padded with -inf
    (nothing for a maximum, exp(-inf) = 0 for a sum)."""
    rows, width = values.shape
    count = min(VOCAB_STRETCHES, width)
    length = -(-width // count)
    if count * length > width:
        values = torch.nn.functional.pad(values, (0, count * length - width), value=float("-inf"))
    return values.view(rows, count, length)


def _argmax_by_stretches(values: torch.Tensor) -> torch.Tensor:
    """values.argmax(-1) of a (B, V) tensor through its stretches (the first of equal maxima)."""
    stretches = _stretches(values)
    best, where = stretches.max(dim=-1)                # (B, S) each stretch's maximum and its place
    stretch = best.argmax(dim=-1, keepdim=True)        # (B, 1) the first stretch holding the row's
    return (stretch * stretches.shape[-1] + where.gather(-1, stretch)).squeeze(-1)


def cumsum_in_blocks(values: torch.Tensor, block: int = 256) -> torch.Tensor:
    """values.cumsum(-1) of a (B, V) tensor as two short scans (within blocks of `block`,
    then over the blocks' totals). The same sums up to rounding; torch.compile's inductor
    (torch 2.11) fails to generate code for one scan over a whole vocabulary (32k+) on CUDA."""
    rows, width = values.shape
    blocks = -(-width // block)
    within = torch.nn.functional.pad(values, (0, blocks * block - width)).view(rows, blocks, block).cumsum(-1)
    totals = within[..., -1]
    before = totals.cumsum(-1) - totals  # the mass of the blocks before each block
    return (within + before[..., None]).view(rows, blocks * block)[:, :width]


def stop_string_end(tokens: Sequence[int], decode: Callable[[list[int]], str], strings: Sequence[str]) -> int:
    """The index of the token whose text completes the first stop string in `tokens`, or -1.

    Decoding a prefix of tokens gives a prefix of the text (up to a multi-byte character
    split across tokens, which only delays a match by a token), so "the first t tokens
    contain a stop string" is monotone in t: a binary search over prefixes finds it with
    about log2(len) decodes.
    """
    tokens = list(tokens)
    if not strings or not tokens or not _contains(decode(tokens), strings):
        return -1
    low, high = 0, len(tokens) - 1  # the answer lies in [low, high]
    while low < high:
        middle = (low + high) // 2
        if _contains(decode(tokens[:middle + 1]), strings):
            high = middle
        else:
            low = middle + 1
    return low


def _contains(text: str, strings: Sequence[str]) -> bool:
    return any(s in text for s in strings)
