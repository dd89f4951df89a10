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

# The forwards' packing mode in which rows with the same prompt share one copy of it
# (pack_shared_prompts); True packs each row whole (pack_rows), False packs nothing.
SHARED_PROMPTS = "shared_prompts"

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
    starts_t, positions = _placement(plan, max(plan.lengths, default=1), device)
    token_row, within = _spread(lengths.to(device))
    source = token_row * width_in + firsts[token_row] + within
    target = starts_t[token_row] + within
    count = len(plan.bins)
    packed_ids = input_ids.new_full((count * plan.width,), pad_id)
    packed_ids[target] = input_ids.reshape(-1)[source]
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


@dataclass(frozen=True)
class SharedPromptRows:
    """A micro-batch packed with each prompt once: a group of rows whose prompts are the
    same tokens (a GRPO group, or PPO samples of one prompt) becomes one sequence, its prompt
    followed by each row's response, and each response sees the prompt and itself only.

    input_ids, position_ids: (N, W); a response's positions continue its prompt's, as in
    the padded row. unit, part: (N, W) which group (unit) a token belongs to and which part
    of it: 0 the prompt, i >= 1 the unit's i-th response; filler has a unit of its own.
    predictors: (T,) flat index into N*W of the hidden state that predicts each real
    response token (its prompt's last token for the first one), outputs: (T,) that token's
    flat index into the (B, R) response layout, as response_slots returns them.
    prompt_start, prompt_tokens: (U,) where each unit's prompt starts (flat index into N*W)
    and its length; response_start, response_tokens: (B,) the same for each row's response
    (a row without response tokens starts where it would have); row_unit: (B,) each row's unit.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    unit: torch.Tensor
    part: torch.Tensor
    predictors: torch.Tensor
    outputs: torch.Tensor
    plan: PackPlan
    prompt_start: torch.Tensor
    prompt_tokens: torch.Tensor
    response_start: torch.Tensor
    response_tokens: torch.Tensor
    row_unit: torch.Tensor

    def visible(self, row, head, query, key):
        """Whether position `query` of packed row `row` attends to position `key`: the key
        comes no later, in the same unit, from the prompt or the query's own response.
        Tensors that broadcast, in FlexAttention's mask_mod signature (`head` unused): the
        pairs the attention tiles (roles/shared_attention.py) compute, as one predicate."""
        unit, part = self.unit, self.part
        return ((key <= query) & (unit[row, query] == unit[row, key])
                & ((part[row, key] == 0) | (part[row, key] == part[row, query])))


def prompt_units(input_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of each row's prompt among the distinct ones: rows with the same real
    prompt tokens (the first P columns where `prompt_mask`, (B, P), is set) get the same."""
    keys = torch.where(prompt_mask, input_ids[:, :prompt_mask.shape[1]], -1)
    return torch.unique(keys, dim=0, return_inverse=True)[1]


def pack_shared_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                        pad_id: int = 0) -> SharedPromptRows:
    """(B, P+R) rows (prompt left-padded to P, response right-padded, at least one prompt
    token each) -> SharedPromptRows. Rows with the same real prompt tokens share one copy of
    it; the groups are packed first-fit decreasing into rows as long as the longest group."""
    rows, device = input_ids.shape[0], input_ids.device
    mask = attention_mask.bool()
    prompt_mask, response_mask = mask[:, :prompt_length], mask[:, prompt_length:]
    prompt_tokens, response_tokens = prompt_mask.sum(-1), response_mask.sum(-1)
    unit = prompt_units(input_ids, prompt_mask)
    units = int(unit.max()) + 1 if rows else 0
    order = torch.argsort(unit * rows + torch.arange(rows, device=device))   # by unit, then row
    first_of_unit = torch.full((units,), rows, device=device).scatter_reduce(
        0, unit, torch.arange(rows, device=device), "amin")
    unit_prompt = prompt_tokens[first_of_unit]
    unit_lengths = unit_prompt + torch.zeros(units, dtype=torch.long, device=device).index_add(0, unit, response_tokens)
    plan = plan_packing(unit_lengths.tolist())
    count, width = len(plan.bins), plan.width
    longest_row = int((prompt_tokens + response_tokens).max()) if rows else 1
    unit_start_t, positions = _placement(plan, longest_row, device)   # filler: positions rows use
    # Each row's response follows its unit's prompt and the responses of the unit's earlier
    # rows; `rank` numbers the rows of a unit 0, 1, ... (in `order`, by unit then row).
    sorted_units, sorted_lengths = unit[order], response_tokens[order]
    unit_first = _first_index(sorted_units)
    before_in_unit = torch.cumsum(sorted_lengths, 0) - sorted_lengths
    response_start, rank = torch.empty_like(response_tokens), torch.empty_like(response_tokens)
    response_start[order] = (unit_start_t[sorted_units] + unit_prompt[sorted_units]
                             + before_in_unit - before_in_unit[unit_first])
    rank[order] = torch.arange(rows, device=device) - unit_first

    packed_ids = input_ids.new_full((count * width,), pad_id)
    unit_map = (units + torch.arange(count, device=device)).repeat_interleave(width)   # filler: a unit per row
    part_map = torch.zeros(count * width, dtype=torch.long, device=device)
    # The prompts, one copy per unit (from its first row).
    p_unit, p_within = _spread(unit_prompt)
    p_row = first_of_unit[p_unit]
    p_target = unit_start_t[p_unit] + p_within
    packed_ids[p_target] = input_ids[p_row, prompt_length - unit_prompt[p_unit] + p_within]
    positions[p_target], unit_map[p_target] = p_within, p_unit
    # The responses.
    row_of, column = response_mask.nonzero(as_tuple=True)
    r_target = response_start[row_of] + column
    packed_ids[r_target] = input_ids[row_of, prompt_length + column]
    positions[r_target] = prompt_tokens[row_of] + column
    unit_map[r_target], part_map[r_target] = unit[row_of], rank[row_of] + 1
    # The first response token is predicted by its prompt's last token, the rest by the token before.
    prompt_last = unit_start_t[unit[row_of]] + prompt_tokens[row_of] - 1
    predictors = torch.where(column == 0, prompt_last, r_target - 1)
    shape = (count, width)
    return SharedPromptRows(packed_ids.view(shape), positions.view(shape), unit_map.view(shape),
                            part_map.view(shape), predictors, row_of * response_mask.shape[1] + column, plan,
                            unit_start_t, unit_prompt, response_start, response_tokens, unit)


def _placement(plan: PackPlan, longest: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the plan puts each item, as a flat index into its bins x width, and the packed
    rows' position ids as the filler takes them: after a bin's last item 0, 1, ...,
    restarting before `longest` (the callers write the items' own positions over theirs)."""
    starts, fills = [0] * len(plan.lengths), []
    for b, members in enumerate(plan.bins):
        offset = b * plan.width
        for item in members:
            starts[item] = offset
            offset += plan.lengths[item]
        fills.append(offset - b * plan.width)
    # Filler slots of bin b sit at columns >= fill_b: arange - fill_b numbers them 0, 1, ...
    positions = torch.arange(plan.width, device=device) - torch.tensor(fills, device=device)[:, None]
    return torch.tensor(starts, device=device), positions.remainder(max(longest, 1)).reshape(-1)


def _spread(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum(lengths),) the owner of each of `lengths`' consecutive elements and its index within it."""
    owner = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    return owner, torch.arange(owner.numel(), device=lengths.device) - (torch.cumsum(lengths, 0) - lengths)[owner]


def _first_index(sorted_keys: torch.Tensor) -> torch.Tensor:
    """For each element of a sorted 1-D tensor, the index of the first element equal to it."""
    index = torch.arange(sorted_keys.numel(), device=sorted_keys.device)
    starts = torch.ones_like(sorted_keys, dtype=torch.bool)
    starts[1:] = sorted_keys[1:] != sorted_keys[:-1]
    return torch.cummax(torch.where(starts, index, 0), 0).values


def computed_tokens(batch, packed: bool | str) -> list[int]:
    """The tokens a forward computes for each row of `batch` (input_ids, attention_mask and
    prompt_length; (B, L)): its real tokens when packed, else the padded width. What a token
    budget counts. SHARED_PROMPTS: a row whose prompt an earlier row has counts its response."""
    if not packed:
        return [batch.input_ids.shape[1]] * batch.input_ids.shape[0]
    real = batch.attention_mask.sum(-1)
    if packed != SHARED_PROMPTS:
        return real.tolist()
    prompts = batch.attention_mask[:, :batch.prompt_length].bool()
    unit = prompt_units(batch.input_ids, prompts)
    seen: set[int] = set()
    counts = []
    for u, tokens, prompt in zip(unit.tolist(), real.tolist(), prompts.sum(-1).tolist()):
        counts.append(tokens - prompt if u in seen else tokens)
        seen.add(u)
    return counts


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
