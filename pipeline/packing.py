"""Packed forwards: the real tokens of padded rows, back to back in fewer, fuller rows.

A rollout row is (P+R) wide: its prompt left-padded to P, its response right-padded to R,
its real tokens contiguous. With long-tailed response lengths nearly every computed token
of a padded micro-batch is padding. Packing trims each row to its real tokens and places
the rows into packed rows of `capacity` tokens (first-fit decreasing); position ids restart
at 0 for every sequence, which is all a transformers model (>= 4.5x) needs to keep the
sequences apart: with `attention_mask=None` and no cache, masking_utils'
`find_packed_sequence_indices` reads sequence boundaries from the position ids (sdpa,
eager and flex get a block-diagonal causal mask; flash-attention runs varlen).

Also here: cutting a shard into micro-batches of consecutive rows by a budget of real
tokens, with exactly as many micro-batches as the rest of the group runs.

Pure: torch only, no roles, no driver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

# Packed widths are multiples of this: few distinct shapes, and rows that end on whole
# tiles; small, so that rows of short sequences are not padded much either.
PACK_ALIGN = 16


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def pack_capacity(longest: int) -> int:
    """Tokens a packed row may hold: the longest sequence, rounded up to PACK_ALIGN.

    Not more: attention over a packed row computes every pair of its positions and masks
    the pairs of different sequences (SDPA with a mask skips no blocks), so a row of C
    tokens costs C^2 whatever it holds. On long-tailed lengths (mean 343 of at most 1152)
    rows as long as the longest sequence still fill to 1.04-1.07x the real tokens, with
    2.5x the attention work of the sequences alone; 2048-token rows came to 4.7x, and to
    16x for uniform rows of 150 tokens (the attention-bound tiny CPU model slowed down).
    """
    return round_up(longest, PACK_ALIGN)


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bin packing: indices of `lengths`, longest first (ties: lower index first), each into
    the first bin with room for it, a new bin where none has. Every length must fit
    `capacity`. Returns the bins, each the indices in placement order."""
    if any(length > capacity for length in lengths):
        raise ValueError(f"a sequence of {max(lengths)} tokens does not fit packed rows of {capacity}")
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[index] <= free:
                bins[b].append(index)
                room[b] -= lengths[index]
                break
        else:
            bins.append([index])
            room.append(capacity - lengths[index])
    return bins


@dataclass(frozen=True)
class PackPlan:
    """Where each row's real tokens go: bins of row indices and the packed rows' width."""

    lengths: tuple[int, ...]          # real tokens of each row
    bins: tuple[tuple[int, ...], ...]
    width: int                        # the fullest bin rounded up to PACK_ALIGN (<= capacity)

    @property
    def computed_tokens(self) -> int:
        """Tokens the model computes over: packed rows x width (real tokens plus filler)."""
        return len(self.bins) * self.width

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)


def plan_packing(lengths: Sequence[int], capacity: int | None = None) -> PackPlan:
    """A PackPlan for rows of `lengths` real tokens (capacity: pack_capacity of the longest)."""
    lengths = tuple(int(n) for n in lengths)
    capacity = pack_capacity(max(lengths, default=1)) if capacity is None else capacity
    bins = first_fit_decreasing(lengths, capacity)
    fullest = max((sum(lengths[i] for i in b) for b in bins), default=1)
    return PackPlan(lengths, tuple(tuple(b) for b in bins), min(capacity, round_up(max(fullest, 1), PACK_ALIGN)))


@dataclass(frozen=True)
class PackedRows:
    """A micro-batch packed: model inputs plus the map back to the padded layout.

    input_ids, position_ids: (N, W); position ids run 0.. within each sequence, and the
    filler after a packed row's last sequence (pad id) runs 0.. as a sequence of its own,
    restarting before it would reach the longest real sequence's length: no position is
    one the padded rows did not use (a model with a table of positions has them all).
    starts: (B,) flat index into N*W of each padded row's first real token.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    starts: torch.Tensor
    plan: PackPlan

    def model_inputs(self) -> dict:
        """Keyword arguments of a transformers forward that runs the packed sequences apart:
        no attention mask and no cache, else the packed format is not detected."""
        return dict(input_ids=self.input_ids, position_ids=self.position_ids, attention_mask=None, use_cache=False)


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_id: int = 0,
              capacity: int | None = None) -> PackedRows:
    """(B, L) padded ids and mask (real tokens contiguous per row) -> PackedRows."""
    rows, width_in = input_ids.shape
    device = input_ids.device
    mask = attention_mask.bool()
    lengths = mask.sum(-1)
    firsts = mask.int().argmax(-1)        # the first real column of each row (0 for an empty row)
    plan = plan_packing(lengths.tolist(), capacity)
    starts = [0] * rows
    fills = []
    for b, members in enumerate(plan.bins):
        offset = b * plan.width
        for row in members:
            starts[row] = offset
            offset += plan.lengths[row]
        fills.append(offset - b * plan.width)
    starts_t = torch.tensor(starts, device=device)
    lengths = lengths.to(device)
    token_row = torch.repeat_interleave(torch.arange(rows, device=device), lengths)
    within = torch.arange(token_row.numel(), device=device) - (torch.cumsum(lengths, 0) - lengths)[token_row]
    source = token_row * width_in + firsts[token_row] + within
    target = starts_t[token_row] + within
    count = len(plan.bins)
    packed_ids = input_ids.new_full((count * plan.width,), pad_id)
    packed_ids[target] = input_ids.reshape(-1)[source]
    # Filler slots of bin b sit at columns >= fill_b: arange - fill_b numbers them 0, 1, ...
    positions = (torch.arange(plan.width, device=device) - torch.tensor(fills, device=device)[:, None])
    positions = positions.remainder(max(plan.lengths, default=1) or 1).reshape(-1)
    positions[target] = within
    return PackedRows(packed_ids.view(count, plan.width), positions.view(count, plan.width), starts_t, plan)


def response_slots(packed: PackedRows, attention_mask: torch.Tensor,
                   prompt_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The real response tokens of a packed micro-batch, T of them: (predictors, outputs).

    predictors: (T,) flat index into the packed N*W positions whose hidden state predicts
    the token (the token before it: its prompt's last token for the first response token).
    outputs: (T,) flat index of the token into the (B, R) response layout.
    Every row must have at least one prompt token.
    """
    mask = attention_mask.bool()
    response = mask[:, prompt_length:]
    prompt_tokens = mask[:, :prompt_length].sum(-1)
    rows, columns = response.nonzero(as_tuple=True)
    predictors = packed.starts[rows] + prompt_tokens[rows] + columns - 1
    return predictors, rows * response.shape[1] + columns


def unpack_responses(values: torch.Tensor, outputs: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """(T,) values at `outputs` -> (B, R), zeros elsewhere; differentiable in `values`."""
    flat = values.new_zeros(shape[0] * shape[1])
    return flat.index_put((outputs,), values).view(shape)


def computed_tokens(batch, packed: bool) -> list[int]:
    """The tokens a forward computes for each row of `batch` (input_ids and attention_mask,
    (B, L)): its real tokens when packed, else the padded width. What a token budget counts."""
    if packed:
        return batch.attention_mask.sum(-1).tolist()
    return [batch.input_ids.shape[1]] * batch.input_ids.shape[0]


def micro_batch_count(lengths: Sequence[int], budget: int) -> int:
    """Micro-batches of consecutive rows, each at most `budget` real tokens (a row longer
    than that alone), filled greedily in order: the fewest such cuts need."""
    count, used = 0, 0
    for length in lengths:
        if count == 0 or used + length > budget:
            count, used = count + 1, 0
        used += length
    return count


def token_chunks(lengths: Sequence[int], count: int) -> list[slice]:
    """Exactly `count` slices of consecutive rows covering all of them, whose largest token
    sum is as small as it can be (ranks of a group run the same number of micro-batches,
    and a rank needing fewer spreads its rows evenly over them). Where `count` exceeds the
    rows, the last slices are empty (as records.even_chunks gives)."""
    lengths = [int(n) for n in lengths]
    if not lengths:
        return [slice(0, 0)] * count
    low, high = max(lengths), sum(lengths)
    while low < high:  # the smallest limit whose greedy cut needs at most `count` slices
        middle = (low + high) // 2
        low, high = (middle + 1, high) if micro_batch_count(lengths, middle) > count else (low, middle)
    slices, start, used = [], 0, 0
    for row, length in enumerate(lengths):
        if row > start and used + length > low:
            slices.append(slice(start, row))
            start, used = row, 0
        used += length
    slices.append(slice(start, len(lengths)))
    while len(slices) < min(count, len(lengths)):  # halve the slice with most rows
        widest = max(range(len(slices)), key=lambda i: slices[i].stop - slices[i].start)
        part = slices[widest]
        middle = (part.start + part.stop) // 2
        slices[widest:widest + 1] = [slice(part.start, middle), slice(middle, part.stop)]
    return slices + [slice(len(lengths), len(lengths))] * (count - len(slices))
