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

    Sampling inverts the distribution's cumulative sum with one uniform number a row: the
    vocabulary is cut into VOCAB_STRETCHES stretches, the pass that takes each stretch's mass
    (and the log-sum-exp) is, without filters, the only one over the whole row, and the uniform picks a
    stretch by their running masses, then a token by the running masses within that stretch
    alone. Shapes are fixed (no host syncs): it runs inside the captured decode step.
    """
    scaled = logits.float() / temperature
    allowed = filter_logits(scaled, top_k, top_p, min_p) if filters_active(top_k, top_p, min_p) else scaled
    stretches = _stretches(allowed)                                   # (B, S, L)
    # Each stretch's log-mass in one pass over the row (a log-sum-exp keeps its running
    # maximum and sum together); -inf for a stretch of filtered-out tokens or padding.
    stretch_logsumexp = torch.logsumexp(stretches, dim=-1)            # (B, S)
    allowed_logsumexp = torch.logsumexp(stretch_logsumexp, dim=-1)    # (B,)
    masses = torch.exp(stretch_logsumexp - allowed_logsumexp[:, None])   # each stretch's probability
    running = masses.cumsum(dim=-1)
    target = torch.rand_like(allowed_logsumexp) * running[:, -1]      # where the row's uniform falls
    stretch = _first_above(running, target, masses)                   # (B,)
    # The second look reads the chosen stretch alone.
    chosen = stretches.gather(1, stretch[:, None, None].expand(-1, 1, stretches.shape[-1])).squeeze(1)   # (B, L)
    within = torch.exp(chosen - allowed_logsumexp[:, None])           # its tokens' probabilities
    before = (running - masses).gather(1, stretch[:, None]).squeeze(1)   # the mass of the stretches before it
    place = _first_above(cumsum_in_blocks(within), target - before, within)
    tokens = stretch * stretches.shape[-1] + place
    logsumexp = allowed_logsumexp if allowed is scaled else torch.logsumexp(
        torch.logsumexp(_stretches(scaled), dim=-1), dim=-1)
    return tokens, scaled.gather(-1, tokens[:, None]).squeeze(-1) - logsumexp


# How many stretches the sampler cuts the vocabulary into. The pass over the whole row then
# runs as many programs a row, and the second look reads one stretch (152k / 32 = 4748
# logits for Qwen2) instead of the row.
VOCAB_STRETCHES = 32


def _stretches(values: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B, S, ceil(V / S)), the vocabulary in S stretches, the last padded with -inf
    (mass 0, nothing for a maximum)."""
    rows, width = values.shape
    count = min(VOCAB_STRETCHES, width)
    length = -(-width // count)
    if count * length > width:
        values = torch.nn.functional.pad(values, (0, count * length - width), value=float("-inf"))
    return values.view(rows, count, length)


def _first_above(running: torch.Tensor, target: torch.Tensor, masses: torch.Tensor) -> torch.Tensor:
    """(B, N) running sums of (B, N) non-negative masses, (B,) targets below each row's total
    -> the first index whose running sum exceeds the target. Where rounding leaves no such
    index, or one of mass 0 (a filtered-out token), the last index with mass instead."""
    above = running > target[:, None]
    index = above.int().argmax(dim=-1)                      # the first True
    positions = torch.arange(masses.shape[-1], device=masses.device)
    last_with_mass = torch.where(masses > 0, positions, 0).amax(dim=-1)
    fits = above.any(dim=-1) & (masses.gather(1, index[:, None]).squeeze(1) > 0)
    return torch.where(fits, index, last_with_mass)


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
