"""Decode attention over the slot ring as one Triton kernel (CUDA only).

A decode step's query is one token a slot; the ring holds L columns a slot, of which a
slot's window (its prompt and response so far) is a part, under a (S, L) boolean mask.
Given that mask, PyTorch's SDPA runs a prefill kernel: it tiles the query axis by 64 rows
for the 7 query heads a KV head has here, and reads every column of the ring whether the
mask keeps it or not. On an H100 that was 1.8 ms of a 3.8 ms decode step at 256 slots
over a ring of 1152 columns (the Qwen2-0.5B shape, benchmarks/decode_profile.py).

Here one program takes one slot, one KV head and one stretch of columns (a split): the
group's query heads are the rows of one tile, keys and values are read once, a block of
columns the mask keeps none of is skipped without reading them, and the softmax runs
online in float32. The splits' partial results are merged by their log-sum-exp (flash
decoding), so few slots still fill the GPU. The maths are SDPA's: the same products, scale
and softmax over the same columns.
"""

from __future__ import annotations

import torch

BLOCK_COLUMNS = 64       # ring columns a program reads at once
PROGRAMS_WANTED = 1024   # splits are added until slots x KV heads x splits reach this


def prepare(device) -> bool:
    """Define the kernel for `device` if it can run there: a CUDA GPU of the Ampere
    generation or newer (Triton's bf16 products) with Triton installed. Called where the
    engine is built, outside compiled code (importing Triton is no graph operation)."""
    global _ready
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    _ready = _ready or _define_op()
    return _ready


def usable(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the kernel serves this decode step: prepared, a CUDA tensor, a head size it
    tiles (a power of two from 16 to 256) and at most 16 query heads a KV head."""
    if not _ready or not query.is_cuda:
        return False
    heads, kv_heads, dim = query.shape[1], key_cache.shape[1], query.shape[-1]
    return dim in (16, 32, 64, 128, 256) and heads % kv_heads == 0 and heads // kv_heads <= 16


def slot_decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          mask: torch.Tensor, scale: float) -> torch.Tensor:
    """query (S, H, 1, D), keys/values (S, H_kv, L, D), mask (S, 1, 1, L) bool ->
    (S, 1, H, D): softmax(q k^T * scale) v over the columns `mask` keeps, per slot and head
    (head h reads KV head h // (H / H_kv)). Every slot's mask keeps at least one column.
    Needs prepare() first."""
    return torch.ops.dask_rl.slot_decode_attention(query, keys, values, mask, scale)


def failed_in(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from, came from this kernel: Triton's
    compiler or launcher, a frame of this file, or the custom op named in Inductor's message."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if type(error).__module__.split(".")[0] == "triton" or "slot_decode_attention" in str(error):
            return True
        frame = error.__traceback__
        while frame is not None:
            if frame.tb_frame.f_code.co_filename == __file__:
                return True
            frame = frame.tb_next
        error = error.__cause__ or error.__context__
    return False


_ready = False


def _define_op() -> bool:
    """Define the Triton kernel and register the custom op around it (False without Triton:
    CPU-only installs)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return False

    @triton.jit
    def kernel(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, lse_ptr,
               q_slot, q_head, k_slot, k_head, k_col, v_slot, v_head, v_col, mask_slot,
               out_slot, out_head, out_split, lse_slot, lse_head,
               scale, length, columns_per_split,
               GROUP: tl.constexpr, BLOCK_GROUP: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr):
        slot, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows, dims = tl.arange(0, BLOCK_GROUP), tl.arange(0, DIM)
        in_group = rows < GROUP
        heads = kv_head * GROUP + rows
        query = tl.load(q_ptr + slot * q_slot + heads[:, None] * q_head + dims[None, :],
                        mask=in_group[:, None], other=0.0)
        top = tl.full([BLOCK_GROUP], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_GROUP], tl.float32)
        acc = tl.zeros([BLOCK_GROUP, DIM], tl.float32)
        first = split * columns_per_split
        last = tl.minimum(first + columns_per_split, length)
        k_base = k_ptr + slot * k_slot + kv_head * k_head
        v_base = v_ptr + slot * v_slot + kv_head * v_head
        for start in range(first, last, BLOCK):
            columns = start + tl.arange(0, BLOCK)
            kept = tl.load(mask_ptr + slot * mask_slot + columns, mask=columns < last, other=0) != 0
            if tl.max(kept.to(tl.int32), axis=0) > 0:
                key = tl.load(k_base + columns[:, None] * k_col + dims[None, :], mask=kept[:, None], other=0.0)
                # float32 whatever type the launcher gives `scale` (Inductor passes a float64).
                scores = (tl.dot(query, tl.trans(key)) * scale).to(tl.float32)
                scores = tl.where(kept[None, :], scores, float("-inf"))
                new_top = tl.maximum(top, tl.max(scores, axis=1))
                weights = tl.exp(scores - new_top[:, None])
                rescale = tl.exp(top - new_top)
                value = tl.load(v_base + columns[:, None] * v_col + dims[None, :], mask=kept[:, None], other=0.0)
                acc = acc * rescale[:, None] + tl.dot(weights.to(value.dtype), value)
                total = total * rescale + tl.sum(weights, axis=1)
                top = new_top
        # A split whose columns the mask keeps none of: output 0, log-sum-exp -inf (weight 0).
        out = acc / tl.maximum(total, 1e-30)[:, None]
        tl.store(out_ptr + slot * out_slot + kv_head * out_head + split * out_split
                 + rows[:, None] * DIM + dims[None, :], out, mask=in_group[:, None])
        tl.store(lse_ptr + slot * lse_slot + kv_head * lse_head + split * BLOCK_GROUP + rows,
                 top + tl.log(total), mask=in_group)

    @torch.library.triton_op("dask_rl::slot_decode_attention", mutates_args=())
    def op(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
           scale: float) -> torch.Tensor:
        slots, heads, _, dim = query.shape
        kv_heads, length = keys.shape[1], keys.shape[2]
        group = heads // kv_heads
        query = query.reshape(slots, heads, dim)
        if query.stride(-1) != 1:
            query = query.contiguous()
        flags = mask.reshape(slots, length)
        blocks = triton.cdiv(length, BLOCK_COLUMNS)
        splits = max(1, min(blocks, triton.cdiv(PROGRAMS_WANTED, slots * kv_heads)))
        columns_per_split = triton.cdiv(blocks, splits) * BLOCK_COLUMNS
        splits = triton.cdiv(length, columns_per_split)
        block_group = max(16, triton.next_power_of_2(group))
        out = torch.empty((slots, kv_heads, splits, block_group, dim), dtype=torch.float32, device=query.device)
        lse = torch.empty((slots, kv_heads, splits, block_group), dtype=torch.float32, device=query.device)
        torch.library.wrap_triton(kernel)[(slots, kv_heads, splits)](
            query, keys, values, flags, out, lse,
            query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
            values.stride(0), values.stride(1), values.stride(2), flags.stride(0),
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1),
            scale, length, columns_per_split,
            GROUP=group, BLOCK_GROUP=block_group, DIM=dim, BLOCK=BLOCK_COLUMNS)
        out, lse = out[:, :, :, :group], lse[:, :, :, :group]
        # Merge the splits: each weighs exp(its log-sum-exp - the largest).
        weights = torch.exp(lse - lse.amax(dim=2, keepdim=True))
        merged = (out * weights[..., None]).sum(2) / weights.sum(2)[..., None]
        return merged.reshape(slots, 1, heads, dim).to(query.dtype)

    return True
