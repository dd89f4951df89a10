"""Attention for one new token against a KV cache, without copying the cache per query head.

Models with grouped-query attention (Qwen2-0.5B: 14 query heads share 2 key/value heads)
keep one key and one value per KV head in the cache. transformers' SDPA path, given an
attention mask (always, for left-padded batches), repeats keys and values once per query
head before the kernel (its own single-token shortcut is off under torch.compile): a
decode step then writes and reads heads / kv_heads copies of the whole cache, 7 for
Qwen2-0.5B, which is most of a step's memory traffic at large batches.

Here a single query token's heads of one group ride on the query-length axis instead,
(B, H, 1, D) -> (B, H_kv, H / H_kv, D), and attend to the cache as it is stored: the same
products and the same softmax, each key and value read once. Anything else (prefill,
several query tokens, per-head masks, soft-capping) goes to transformers' SDPA unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def packed_gqa_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (B, H, Q, D), key/value (B, H_kv, L, D),
    mask (B, 1 or H, Q, L) or None -> ((B, Q, H, D), None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    batch, heads, q_length, dim = query.shape
    shared_mask = attention_mask is None or attention_mask.shape[1] == 1
    if q_length != 1 or groups == 1 or not shared_mask or kwargs.get("softcap") is not None or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    packed = query.reshape(batch, heads // groups, groups, dim)   # head h = kv_head * groups + g
    # A (B, 1, 1, L) mask broadcasts over the kv heads and the group's query heads alike.
    output = F.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask, scale=scaling)
    return output.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None
