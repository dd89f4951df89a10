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


# Ring columns per block of the flex decode path: flex_attention's default block.
DECODE_BLOCK = 128


def live_blocks(mask: torch.Tensor, block: int | None = None):
    """(S, 1, 1, L) boolean slot mask -> a flex_attention BlockMask under which each slot reads
    only the blocks of `block` ring columns holding a column it attends to.

    A slot attends to a window of the ring (its prompt and response so far) that is mostly
    far shorter than the ring on long-tailed lengths: SDPA reads every column of every slot
    and masks, this reads the window's blocks. Blocks wholly inside the mask skip it; the
    others apply it column by column. Computed on the device from the mask alone (fixed
    shapes, no host sync): it runs inside the captured decode step, once for all layers."""
    from torch.nn.attention.flex_attention import BlockMask

    block = block or DECODE_BLOCK
    slots, length = mask.shape[0], mask.shape[-1]
    columns = mask.reshape(slots, length)
    count = -(-length // block)
    per_block = F.pad(columns, (0, count * block - length)).view(slots, count, block)
    whole = per_block.all(-1)
    some = per_block.any(-1) & ~whole

    def listing(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The selected blocks first (flex reads the first `number` of each row's indices).
        order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True)
        return (selected.sum(-1, dtype=torch.int32).view(slots, 1, 1),
                order.to(torch.int32).view(slots, 1, 1, count))

    def attended(b, h, q_idx, kv_idx):
        return columns[b, kv_idx]

    return BlockMask.from_kv_blocks(*listing(some), *listing(whole), BLOCK_SIZE=block, mask_mod=attended,
                                    seq_lengths=(1, length), compute_q_blocks=False)


def flex_gqa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks,
                       scaling: float | None) -> tuple[torch.Tensor, None]:
    """One new token's attention over the slot cache as stored, reading only `blocks`
    (live_blocks'): query (S, H, 1, D), key/value (S, H_kv, L, D) -> ((S, 1, H, D), None)."""
    from torch.nn.attention.flex_attention import flex_attention

    output = flex_attention(query, key, value, block_mask=blocks, scale=scaling,
                            enable_gqa=query.shape[1] != key.shape[1])
    return output.transpose(1, 2).contiguous(), None
