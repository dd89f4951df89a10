"""Decode attention alone: SDPA (gqa_decode's packed form) against the Triton slot kernel.

One decode step's attention for one layer of the Qwen2-0.5B shape (14 query heads, 2 KV
heads, head size 64, bf16) over a slot ring, each function compiled with torch.compile as
the engine compiles it. Windows: `full`, every slot attends to all
columns up to the current one (a fixed-length batch near its end); `tail`, windows of
geometric lengths (mean --mean-window) at random places in the ring, wrapping (a long-
tailed batch). Prints microseconds of GPU time a call (24 calls to a CUDA graph, as a decode
step has 24 layers) and each side's largest difference to a float32 reference.

    python benchmarks/decode_attention.py --slots 256 32 8 --lengths 384 1152
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipeline.engines.decode_kernel import prepare, slot_decode_attention  # noqa: E402
from pipeline.engines.gqa_decode import packed_gqa_attention  # noqa: E402

HEADS, KV_HEADS, DIM = 14, 2, 64


class Layer:   # what packed_gqa_attention reads of an attention module
    num_key_value_groups = HEADS // KV_HEADS


def windows(slots: int, length: int, kind: str, mean: int, generator) -> torch.Tensor:
    mask = torch.zeros(slots, 1, 1, length, dtype=torch.bool)
    for slot in range(slots):
        if kind == "full":
            mask[slot, 0, 0, :] = True
            continue
        size = min(length, 1 + int(torch.distributions.Geometric(1 / mean).sample().item()))
        start = int(torch.randint(0, length, (1,), generator=generator))
        mask[slot, 0, 0, [(start + i) % length for i in range(size)]] = True
    return mask


def reference(query, keys, values, mask, scale):
    slots = query.shape[0]
    grouped = query.float().reshape(slots, KV_HEADS, HEADS // KV_HEADS, DIM)
    scores = torch.einsum("shgd,shld->shgl", grouped, keys.float()) * scale
    weights = scores.masked_fill(~mask.reshape(slots, 1, 1, -1), float("-inf")).softmax(-1)
    return torch.einsum("shgl,shld->shgd", weights, values.float()).reshape(slots, 1, HEADS, DIM)


def sdpa(query, keys, values, mask, scale):
    return packed_gqa_attention(Layer(), query, keys, values, mask, scaling=scale)[0]


def timed(function, inputs, repeats: int, calls: int = 24) -> tuple[float, torch.Tensor]:
    """Microseconds of GPU time a call: `calls` calls (a decode step's 24 layers) captured in
    one CUDA graph, replayed `repeats` times. One call a replay measured the replay's host
    overhead instead (55-60 us whatever the kernel, on an H100), as the kernels take less."""
    compiled = torch.compile(function, dynamic=False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # compile and warm up outside the capture
        for _ in range(3):
            out = compiled(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = compiled(*inputs)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (repeats * calls), out.clone()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[256, 32, 8])
    parser.add_argument("--lengths", type=int, nargs="+", default=[384, 1152])
    parser.add_argument("--windows", nargs="+", default=["full", "tail"], choices=["full", "tail"])
    parser.add_argument("--mean-window", type=int, default=350)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    if not prepare("cuda"):
        raise SystemExit("the Triton decode kernel needs an Ampere or newer NVIDIA GPU and Triton")
    generator = torch.Generator().manual_seed(0)
    scale = DIM ** -0.5
    print("slots  ring  windows   SDPA us  kernel us  SDPA/kernel  max diff SDPA / kernel")
    for length in args.lengths:
        for slots in args.slots:
            for kind in args.windows:
                query = torch.randn(slots, HEADS, 1, DIM, generator=generator).to("cuda", torch.bfloat16)
                keys, values = (torch.randn(slots, KV_HEADS, length, DIM, generator=generator).to("cuda", torch.bfloat16)
                                for _ in range(2))
                mask = windows(slots, length, kind, args.mean_window, generator).cuda()
                inputs = (query, keys, values, mask, scale)
                expected = reference(*inputs)
                sdpa_us, sdpa_out = timed(sdpa, inputs, args.repeats)
                kernel_us, kernel_out = timed(slot_decode_attention, inputs, args.repeats)
                print(f"{slots:5d} {length:5d}  {kind:7s} {sdpa_us:9.1f} {kernel_us:10.1f} {sdpa_us / kernel_us:11.2f}x"
                      f"   {(sdpa_out.float() - expected).abs().max():.4f} / {(kernel_out.float() - expected).abs().max():.4f}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
