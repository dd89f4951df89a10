"""A KV cache of decode slots, for continuous batching in the cuda_graph engine.

A static batch decodes until its longest row ends: on long-tailed response lengths most
decode slots hold finished rows most of the time. Here each of S slots holds one sequence,
and a slot whose sequence ended takes the next waiting one. What makes that cheap:

- every slot writes its new token's key and value into the same column of a ring of L
  columns (the column of the step, modulo L), so a decode step is one shape whatever the
  slots hold, and is captured once as a CUDA graph;
- which columns a slot attends to is a (S, 1, 1, L) boolean mask kept on the device: a new
  sequence's prompt is written into the L columns just before the current one, its mask row
  reset to them; rotary positions come per slot (position ids), not from the column;
- a window (prompt bucket + max_new_tokens) never exceeds L, so the ring never overwrites a
  column a live sequence still attends to.

The cache is this module's own tensors, reached by the model's attention through the
`slot_cache` keyword (transformers passes a forward's extra keywords on to its attention
function): the engine does not depend on how a transformers version lays out its caches.
Attention for one new token reads the cache as stored: through decode_kernel.py's Triton
kernel where it applies (a CUDA GPU with Triton, a head size it tiles), else gqa_decode's
packed form of SDPA. On an H100 at 256 slots over a ring of 1152 columns the kernel took
0.56 ms of attention a decode step against SDPA's 1.82, and the step 2.54 ms of GPU time
against 3.80 (benchmarks/decode_profile.py). A cache made with `attention_kernel=False` keeps
SDPA (the rollout role's `cuda_graph_args: {decode_attention: sdpa}`).
"""

from __future__ import annotations

import torch

from pipeline.engines import decode_kernel
from pipeline.engines.budget import kv_bytes_per_token, kv_layout
from pipeline.engines.gqa_decode import packed_gqa_attention

NAME = "dask_rl_slots"


def slot_cache_bytes(config, dtype: torch.dtype, slots: int, length: int) -> int:
    """What a SlotCache of `slots` x `length` holds."""
    return kv_bytes_per_token(config, dtype) * slots * length


class SlotCache:
    """Keys and values of `slots` sequences over a ring of `length` columns: per layer
    (slots, kv_heads, length, head_dim) tensors, allocated once and written in place (the
    captured graphs keep pointing at them).

    With `within` (a cache of as many or more slots over the same ring), the tensors are
    the first `slots` rows of that cache's: a request's tail moves into fewer slots without
    a cache of its own per slot count (those summed to twice the largest)."""

    def __init__(self, config, slots: int, length: int, dtype: torch.dtype, device,
                 within: "SlotCache | None" = None, attention_kernel: bool = True):
        self.slots, self.length = slots, length
        self.attention_kernel = attention_kernel   # decode attention through the Triton kernel where it applies
        if within is not None:
            if within.length != length or within.slots < slots:
                raise ValueError(f"a cache of {slots} x {length} cannot live in one of {within.slots} x "
                                 f"{within.length}")
            self.keys = [tensor[:slots] for tensor in within.keys]
            self.values = [tensor[:slots] for tensor in within.values]
            self.nbytes = 0    # what this cache allocated: nothing of its own
        else:
            layers, kv_heads, head_dim = kv_layout(config)
            shape = (slots, kv_heads, length, head_dim)
            self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
            self.nbytes = slot_cache_bytes(config, dtype, slots, length)
        if torch.device(device).type == "cuda":
            for tensor in (*self.keys, *self.values):   # mutated inside captured graphs
                torch._dynamo.mark_static_address(tensor)

    def take_rows(self, source: "SlotCache", rows: torch.Tensor) -> None:
        """Copy `source`'s slots `rows` (one index per slot of this cache) into this cache.
        The two may share storage (one lives within the other), so each layer's rows are
        gathered before they are written."""
        for mine, theirs in zip((*self.keys, *self.values), (*source.keys, *source.values)):
            mine.copy_(theirs.index_select(0, rows))


def slot_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   slot_cache: SlotCache | None = None, slot_rows: torch.Tensor | None = None,
                   slot_columns: torch.Tensor | None = None, slot_sources: torch.Tensor | None = None,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract, plus the slot cache's keywords.

    - decode (slot_rows None): query/key/value (S, H or H_kv, 1, D) of every slot; the new
      key and value go into column `slot_columns` (1,), then the query attends to the whole
      ring under `attention_mask` (S, 1, 1, L) (on a GPU through decode_kernel's Triton
      kernel, which skips the blocks of columns outside the slot's window);
    - prefill (slot_rows (k,)): k new prompts, left-padded to W tokens, are stored in slots
      `slot_rows` at ring columns `slot_columns` (W,) and attend among themselves as usual;
      with `slot_sources` (k,), the pass computed fewer prompts (the distinct ones) and slot
      `slot_rows[i]` stores prompt `slot_sources[i]`'s keys and values;
    - without a slot cache (a training or scoring forward of the same model): packed
      grouped-query attention, i.e. transformers' SDPA.
    """
    if slot_cache is None:
        return packed_gqa_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    keys, values = slot_cache.keys[module.layer_idx], slot_cache.values[module.layer_idx]
    if slot_rows is None:
        keys.index_copy_(2, slot_columns, key)
        values.index_copy_(2, slot_columns, value)
        if slot_cache.attention_kernel and _kernel_applies(query, keys, attention_mask, dropout, kwargs):
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return decode_kernel.slot_decode_attention(query, keys, values, attention_mask, scale), None
        return packed_gqa_attention(module, query, keys, values, attention_mask, scaling=scaling)
    # (k, H_kv, W, D) -> the (k, W) cells (slot, column), each an (H_kv, D) block.
    stored_key, stored_value = (key, value) if slot_sources is None else (key[slot_sources], value[slot_sources])
    keys[slot_rows[:, None], :, slot_columns[None, :]] = stored_key.transpose(1, 2).to(keys.dtype)
    values[slot_rows[:, None], :, slot_columns[None, :]] = stored_value.transpose(1, 2).to(values.dtype)
    return packed_gqa_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def _kernel_applies(query, keys, attention_mask, dropout: float, kwargs: dict) -> bool:
    """The Triton decode kernel computes plain softmax attention under a boolean mask shared
    by a slot's heads; anything else (soft-capping, dropout, other masks) stays with SDPA."""
    return (not dropout and kwargs.get("softcap") is None and attention_mask is not None
            and attention_mask.dtype == torch.bool and attention_mask.shape[1:3] == (1, 1)
            and decode_kernel.usable(query, keys))


def use_slot_attention(model) -> None:
    """Switch `model` to slot_attention (any attention implementation: the decode and
    prefill maths are SDPA's; models loaded with flash or eager attention compute the same)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    decode_kernel.prepare(next(model.parameters()).device)
    if getattr(model.config, "_attn_implementation", None) == NAME:
        return
    AttentionInterface.register(NAME, slot_attention)
    # Prefill builds SDPA's masks (causal and padding); decode passes its own 4-D mask, which
    # transformers hands over as it is.
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(NAME)
