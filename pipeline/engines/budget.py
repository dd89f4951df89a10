"""How many sequences a generation batch may hold in the memory its GPU has left.

The rollout engines ask before every request (the memory another process or a co-located
role holds changes while a run goes on), so a GPU that fills up shrinks the next batch
instead of failing it. The estimate is the KV cache of a sequence at its full length plus
the decode step's per-sequence workspace, and the prefill's activations: every prompt's for
an engine that prefills a batch at once, one pass's for the cuda_graph engine, which
prefills a pass at a time (fitting_slots); an out-of-memory error is still caught and
halves the batch (resources.allocator.in_chunks), so a low estimate costs one retry.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from resources.allocator import free_bytes

# Float32 copies of one row of logits alive during sampling (the scaled logits, the
# log-sum-exp's temporary of them less their maximum, a padded copy where the vocabulary is
# not a whole number of stretches, and one for the filters / the model's own output;
# engines/sampling.py).
SAMPLING_COPIES = 4
# Share of the free memory a generation batch may plan to use: the rest absorbs the
# allocator's rounding and what the estimate leaves out.
HEADROOM = 0.85


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def kv_layout(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim): what a KV cache holds per token."""
    text = _text_config(config)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token adds to the cache, over all layers."""
    layers, kv_heads, head_dim = kv_layout(config)
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def sequence_bytes(config, dtype: torch.dtype, prompt_length: int, length: int, cache_copies: int = 1) -> int:
    """Peak bytes one sequence needs while it is generated to `length` tokens: what it holds
    (held_bytes) and its prompt's prefill (prefill_bytes), for an engine that prefills every
    prompt of a batch at once."""
    return held_bytes(config, dtype, length, cache_copies) + prefill_bytes(config, dtype, prompt_length)


def held_bytes(config, dtype: torch.dtype, length: int, cache_copies: int = 1) -> int:
    """Bytes a sequence holds while it is generated to `length` tokens: its KV cache and its
    share of the sampling workspace. `cache_copies`: 1 for a preallocated cache; 2 for one
    that grows by concatenation (transformers' dynamic cache holds the old and the new
    tensor for a moment)."""
    sampling = SAMPLING_COPIES * 4 * _text_config(config).vocab_size
    return cache_copies * kv_bytes_per_token(config, dtype) * length + sampling


def prefill_bytes(config, dtype: torch.dtype, prompt_length: int) -> int:
    """A prompt's share of its prefill pass: one layer's activations over the prompt plus
    its attention scores (the eager worst case), freed layer by layer."""
    text = _text_config(config)
    size = torch.empty((), dtype=dtype).element_size()
    intermediate = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    return prompt_length * (3 * intermediate + 4 * text.hidden_size) * size \
        + text.num_attention_heads * prompt_length * prompt_length * 4


def free_for_generation(device: Any, reserve: Callable[[], int] | None = None) -> int | None:
    """What a generation batch may plan on: the memory this process can still allocate on
    `device` (allocator.free_bytes), less `reserve()`: what a role sharing the process
    needs on top of what it holds now (a hosted rollout's host: its next update). None off
    CUDA."""
    free = free_bytes(device)
    if free is None or reserve is None:
        return free
    return max(0, free - reserve())


def fitting_rows(free: int | None, per_sequence: int, max_rows: int, headroom: float = HEADROOM) -> int:
    """Sequences that fit in `free` bytes, `per_sequence` each: fitting_slots with nothing
    needed once."""
    return fitting_slots(free, per_sequence, 0, max_rows, max_rows, headroom)


def fitting_slots(free: int | None, held: int, prefill: int, pass_rows: int, max_rows: int,
                  headroom: float = HEADROOM) -> int:
    """Decode slots that fit in `free` bytes when each holds `held` bytes and the prompts
    prefill in passes of at most `pass_rows`, one pass at a time, `prefill` bytes a prompt:
    a pass's activations are needed once, not once a slot. At most `max_rows`, at least 1;
    `max_rows` without a memory reading (CPU)."""
    if free is None or held + prefill <= 0:
        return max_rows
    rows = int(headroom * free / (held + prefill))   # every prompt in one pass
    if rows > pass_rows:                             # more slots than a pass holds
        rows = int((headroom * free - pass_rows * prefill) / held)
    return max(1, min(max_rows, rows))


def power_of_two_below(rows: int) -> int:
    """The largest power of two <= rows (rows >= 1)."""
    return 1 << (max(rows, 1).bit_length() - 1)
