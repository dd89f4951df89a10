"""One layer's attention in the update, a group's prompt shared or not (train.share_prompts).

The batch-256 fixed-length update (32 groups of 8 rows, prompts of 128 tokens, responses of
256) profiled on an H200 spent 138 ms of GPU time in FlexAttention's forward and 50 ms in
its backward with shared prompts, against 16 and 35 ms in cuDNN's attention for whole rows
(benchmarks/packed_update.py --profile), for 27% fewer tokens. The update has since dropped
FlexAttention for the last way below, in pipeline/roles/shared_attention.py's tiles (there
with the gathers, and the responses in tiles of similar lengths). This times the attention
alone, for one micro-batch of --groups groups, the Qwen2-0.5B shape (14 query heads, 2 KV
heads, head size 64, bf16), forward and backward, milliseconds of GPU time a call:

- flex: FlexAttention over pack_shared_prompts' rows with the block mask of the pairs the
  update's tiles compute (SharedPromptRows.visible), compiled static and with dynamic shapes (the update compiles
  its blocks dynamic=True), key/value heads passed as they are (enable_gqa);
- flex, keys/values repeated: the same with the key/value heads repeated to 14 first, as
  transformers' FlexAttention integration does when the query heads are not a power of two
  (Qwen2-0.5B's 14);
- sdpa whole rows: each row of 384 tokens on its own, causal (what packing whole rows costs
  at best: no mask, no row attends to another);
- sdpa, prompts once, then responses: the shared prompt's attention in ordinary kernels,
  each prompt on its own (causal), then each response's queries over its prompt's keys and
  its own (causal from the bottom right); the gather of a prompt's keys for each response is
  left out.

    python benchmarks/shared_attention.py --groups 11      # < 1 minute on an H100
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shapes import padded_rows, share_prompts  # noqa: E402
from pipeline.packing import pack_shared_prompts  # noqa: E402

HEADS, KV_HEADS, DIM = 14, 2, 64


def gpu_ms(function, repeats: int = 20) -> float:
    """Milliseconds of GPU time a call, after two warm-up calls."""
    for _ in range(2):
        function()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        function()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def forward_and_backward(attend, *inputs) -> tuple[float, float] | str:
    """(forward ms, forward + backward ms) of attend(*inputs), or why it failed."""
    try:
        return _forward_and_backward(attend, *inputs)
    except Exception as error:   # a way the kernel refuses is a finding too: print it, time the rest
        return f"{type(error).__name__}: {str(error).splitlines()[0][:150]}"


def _forward_and_backward(attend, *inputs) -> tuple[float, float]:
    leaves = [t.detach().requires_grad_() for t in inputs]
    with torch.no_grad():
        outputs = attend(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    grads = [torch.randn_like(out) for out in outputs]

    def forward():
        with torch.no_grad():
            attend(*leaves)

    def both():
        out = attend(*leaves)
        torch.autograd.backward(out if isinstance(out, tuple) else (out,), grads)
        for leaf in leaves:
            leaf.grad = None

    return gpu_ms(forward), gpu_ms(both)


def prompts_then_responses(prompt_q, prompt_k, prompt_v, response_q, response_k, response_v):
    """Each prompt once (causal), then each response's queries over its prompt's keys and
    its own (causal from the bottom right: query i sees the prompt and responses 0..i)."""
    from torch.nn.attention.bias import causal_lower_right

    lengths = response_q.shape[2], response_k.shape[2]   # each response's queries and keys
    repeat = HEADS // KV_HEADS
    prompts = F.scaled_dot_product_attention(prompt_q, prompt_k, prompt_v, is_causal=True, enable_gqa=True)
    responses = F.scaled_dot_product_attention(response_q, response_k.repeat_interleave(repeat, 1),
                                               response_v.repeat_interleave(repeat, 1),
                                               attn_mask=causal_lower_right(*lengths))
    return prompts, responses


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=11, help="groups in the micro-batch (32 768 tokens: ~11)")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--response", type=int, default=256)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/shared_attention.py needs a CUDA GPU")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    rows = args.groups * args.samples
    ids, mask = padded_rows([args.prompt] * rows, [args.response] * rows, 1000, prompt_width=args.prompt,
                            response_width=args.response)
    ids, mask = share_prompts(ids, mask, args.prompt, args.samples)
    shared = pack_shared_prompts(ids.cuda(), mask.cuda(), args.prompt)
    packed_rows, width = shared.input_ids.shape

    def visible(row, head, query, key):
        return shared.visible(row, head, query, key)

    block_mask = create_block_mask(visible, packed_rows, None, width, width, device="cuda")
    print(f"{torch.cuda.get_device_name()}: {args.groups} groups of {args.samples} rows, prompt {args.prompt}, "
          f"responses {args.response}: shared {packed_rows} x {width} tokens; whole rows {rows} x "
          f"{args.prompt + args.response}; block mask {block_mask.sparsity():.1f}% sparse")

    def tensors(batch, length, heads):
        return torch.randn(batch, heads, length, DIM, device="cuda", dtype=torch.bfloat16)

    q = tensors(packed_rows, width, HEADS)
    k, v = tensors(packed_rows, width, KV_HEADS), tensors(packed_rows, width, KV_HEADS)
    results = {}
    for name, dynamic in (("flex, static compile", False), ("flex, dynamic compile", True)):
        torch._dynamo.reset()
        compiled = torch.compile(flex_attention, dynamic=dynamic)
        results[name] = forward_and_backward(
            lambda q, k, v: compiled(q, k, v, block_mask=block_mask, enable_gqa=True), q, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=True)
    repeat = HEADS // KV_HEADS
    results["flex, dynamic, keys/values repeated"] = forward_and_backward(
        lambda q, k, v: compiled(q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1),
                                 block_mask=block_mask), q, k, v)
    whole = args.prompt + args.response
    rq, rk, rv = tensors(rows, whole, HEADS), tensors(rows, whole, KV_HEADS), tensors(rows, whole, KV_HEADS)
    results["sdpa whole rows (causal)"] = forward_and_backward(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), rq, rk, rv)
    # The same attention in ordinary kernels: the prompts once, then the responses' queries
    # over keys of their prompt (gathered per response: not timed here) and their own.
    pq, pk, pv = (tensors(args.groups, args.prompt, heads) for heads in (HEADS, KV_HEADS, KV_HEADS))
    aq = tensors(rows, args.response, HEADS)
    ak, av = tensors(rows, whole, KV_HEADS), tensors(rows, whole, KV_HEADS)
    results["sdpa, prompts once, then responses"] = forward_and_backward(prompts_then_responses, pq, pk, pv, aq, ak, av)
    print(f"{'':40} {'forward ms':>11} {'forward + backward ms':>22}")
    for name, result in results.items():
        print(f"{name:40} {result}" if isinstance(result, str) else f"{name:40} {result[0]:11.3f} {result[1]:22.3f}")


if __name__ == "__main__":
    main()
