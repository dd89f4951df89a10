"""How a slot request lays out its prefill passes (continuous.SlotRun): prompt widths, which
prefixes share a pass, and the attention mask a pass runs under. Pure functions of lengths
and masks, apart from the slot loop that uses them."""

from __future__ import annotations

import torch


def bucket_length(length: int, step: int) -> int:
    """A prompt width: `length` rounded up to a multiple of `step` (at least one step)."""
    return max(step, -(-length // step) * step)


def prefill_passes(lengths: list[int], bucket: int, ring: int, budget: int) -> list[tuple[int, list[int]]]:
    """Prefixes (by index into `lengths`) grouped into prefill passes -> [(width, indices)].

    Longest first, each pass padded to its first prefix's length rounded up to `bucket` (at
    most the ring) and holding at most `budget` tokens (rows x width; one row at least). So a
    new 128-token prompt is never padded to a carried row's 1100 tokens, rows of similar
    length share a pass, and the padding computed is under a bucket a row."""
    passes: list[tuple[int, list[int]]] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if passes and (len(passes[-1][1]) + 1) * passes[-1][0] <= budget:
            passes[-1][1].append(index)
        else:
            passes.append((min(bucket_length(lengths[index], bucket), ring), [index]))
    return passes


def distinct_prefixes(prefixes: list[list[int]]) -> list[list[int]]:
    """Positions of `prefixes` grouped by equal prefix, in first-seen order: a group's
    samples of one prompt share a prefill (its keys and values are computed once)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for position, prefix in enumerate(prefixes):
        groups.setdefault(tuple(prefix), []).append(position)
    return list(groups.values())


def prefill_mask(prompt_mask: torch.Tensor) -> torch.Tensor:
    """(k, W) left-padded prompt mask -> (k, 1, W, W) boolean attention mask: causal, real
    keys only. A padding position (no real key at or before it) attends to every key, so
    its output is finite; nothing reads it. Given in full, transformers uses it as it is,
    instead of first asking whether the prompts have padding at all, a wait for the device."""
    width = prompt_mask.shape[-1]
    causal = torch.ones(width, width, dtype=torch.bool, device=prompt_mask.device).tril()
    mask = causal & prompt_mask.bool()[:, None, None, :]
    return mask | ~mask.any(-1, keepdim=True)
