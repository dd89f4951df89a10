"""How a slot request lays out its prefill passes (continuous.SlotRun): prompt widths, which
prefixes share a pass or a computation, and the attention mask a pass runs under (pure
functions of lengths and masks, apart from the slot loop that uses them); and the clock of
the passes' time."""

from __future__ import annotations

import time
from typing import Callable

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


class PassClock:
    """The time prefill passes take: on CUDA a pair of events a pass, read once at the end
    (no wait for the device per pass), elsewhere the wall clock."""

    def __init__(self, on_cuda: bool):
        self.on_cuda = on_cuda
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.wall_ms = 0.0

    def start(self) -> Callable[[], None]:
        """Starts timing a pass; the returned function ends it."""
        if self.on_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.events.append((start, end))
            return end.record
        began = time.perf_counter()

        def stop():
            self.wall_ms += 1e3 * (time.perf_counter() - began)
        return stop

    def milliseconds(self) -> float:
        """Every pass's time so far, once the last has ended."""
        if self.events:
            self.events[-1][1].synchronize()
        return self.wall_ms + sum(start.elapsed_time(end) for start, end in self.events)
