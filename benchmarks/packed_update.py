"""One actor optimizer step on one GPU, padded vs packed (issue 21).

Qwen2-0.5B's shape in bf16 with random weights, 256 rows: prompts of 128 tokens, responses
of geometric length (mean 215, cut at 1024, seeded), the actor's real loss path (Trainable
.optimizer_step over ActorRole's loss: forward, backward, AdamW) with gradient checkpointing
as train.gradient_checkpointing defaults to. Two ways:

- padded: micro-batches of 16 rows of the full (P+R) width (train.micro_batch_size: 16,
  pack_sequences: false);
- packed: the auto token budget (micro_batch_size: auto) over packed rows;
- packed, no checkpointing: the same with train.gradient_checkpointing: false, whose budget
  holds fewer tokens (activations are kept) but whose backward recomputes nothing;
- packed, <= N tokens: the auto budget capped lower (--token-caps): what a smaller, cheaper
  micro-batch costs in time;
- packed, compiled blocks (--compile-blocks): the auto budget with each transformer block
  compiled by torch.compile (dynamic shapes), to see what eager kernel launches and unfused
  element-wise work cost;
- packed, compile_model (--compile-model): the blocks and the passes over the logits
  compiled, as train.compile_model (the default) runs the actor on a GPU;
- packed, compile_model, autograd projection (--autograd-projection): the same with each
  chunk of logits differentiated op by op under checkpointing, as before
  pipeline/vocab_scores.py (which keeps three numbers a token and makes the logits'
  gradient in one pass);
- packed, compile_model, shared prompts (--share-prompts): the same with train.share_prompts,
  each group of --samples rows (one prompt) run as its prompt once and then its responses,
  attended in two dense tiles a layer (pipeline/roles/shared_attention.py).

--samples N gives every N consecutive rows one prompt, as a GRPO group's samples have (1:
every row its own); `--max-response 256 --mean-response 1e9` makes every response 256 tokens.

--profile runs the auto packed step once more under torch.profiler and prints the operators
that took the most device time, and the host operators the GPU sat idle waiting on.

--max-gpu-memory-gib G caps the process's torch allocations at G GiB, as a role's
max_gpu_memory_gib does; the table then also says how often the allocator freed its whole
cache to retry an allocation over the cap, and how often it asked the driver for memory.

Each is run three times (the first step warms kernels up and, for the budget, measures bytes
per token; the second can still compile blocks again for shapes the first did not meet, and
its seconds are printed apart); the third is reported: seconds, tokens computed / real
tokens, peak GPU memory, micro-batches. Peak memory is torch's allocated and reserved bytes. A table on stdout and, with --json PATH, one JSON line.

    python benchmarks/packed_update.py --json packed_update.json     # < 2 minutes on an H100
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shapes import geometric_lengths, padded_rows, qwen2_05b_config, share_prompts  # noqa: E402
from benchmarks.vocab_scores import autograd_projection  # noqa: E402
from pipeline.packing import SHARED_PROMPTS, computed_tokens, pack_shared_prompts, plan_packing  # noqa: E402
from pipeline.records import Experience  # noqa: E402
from pipeline.roles import forward  # noqa: E402
from pipeline.roles.actor import ActorRole, PolicyStep  # noqa: E402
from pipeline.roles.training import Trainable  # noqa: E402
from resources.allocator import limit_gpu_memory  # noqa: E402


def experience(rows: int, prompt: int, response: int, mean: float, vocab: int, seed: int,
               samples: int = 1) -> Experience:
    responses = geometric_lengths(rows, mean, response, seed=seed)
    ids, mask = share_prompts(*padded_rows([prompt] * rows, responses, vocab, prompt_width=prompt,
                                           response_width=response, seed=seed), prompt, samples)
    real = mask[:, prompt:].float()
    generator = torch.Generator().manual_seed(seed + 1)
    return Experience(input_ids=ids, attention_mask=mask, response_mask=real,
                      behavior_logprobs=(torch.randn(real.shape, generator=generator) * 0.1 - 2.0) * real,
                      ref_logprobs=torch.zeros_like(real), advantages=torch.randn(real.shape, generator=generator) * real,
                      returns=torch.zeros_like(real), old_values=torch.zeros_like(real), prompt_length=prompt)


def run(trainable: Trainable, batch: Experience, micro_batch_size, pack: bool | str) -> dict:
    """One optimizer step; what it computed and cost."""
    step = PolicyStep(clip_ratio=0.2, kl_coef_in_loss=0.0, temperature=1.0, micro_batch_size=micro_batch_size,
                      epochs=1, is_cap=2.0, normalizers=(float(batch.response_mask.sum()),), next_version=1,
                      snapshot_dir="", pack_sequences=bool(pack))
    role = types.SimpleNamespace(device=trainable.device)
    computed = []

    def loss(model, chunk):
        rows = chunk[0]
        if pack == SHARED_PROMPTS:
            computed.append(pack_shared_prompts(rows.input_ids, rows.attention_mask, rows.prompt_length)
                            .plan.computed_tokens)
        else:
            computed.append(plan_packing(rows.attention_mask.sum(-1).tolist()).computed_tokens if pack
                            else rows.input_ids.numel())
        return ActorRole._loss(role, model, chunk, step, step.normalizers[0], None, pack)

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats()
    start = time.perf_counter()
    stats = trainable.optimizer_step(lambda rows: (batch.select(rows), None), len(batch), loss,
                                     max_rows=micro_batch_size, tokens_per_row=batch.input_ids.shape[1],
                                     row_tokens=computed_tokens(batch, pack))
    torch.cuda.synchronize()
    seconds, after = time.perf_counter() - start, torch.cuda.memory_stats()
    # An allocation over the cap (--max-gpu-memory-gib) first frees torch's whole cache and
    # tries again: many retries and driver allocations mean the allocator works at the cap.
    return {"seconds": seconds, "computed_tokens": sum(computed),
            "alloc_retries": after.get("num_alloc_retries", 0) - before.get("num_alloc_retries", 0),
            "device_allocs": after.get("num_device_alloc", 0) - before.get("num_device_alloc", 0),
            "grad_norm": stats["grad_norm"], "policy_loss": stats["policy_loss"], "entropy_sum": stats["entropy_sum"],
            "real_tokens": int(batch.attention_mask.sum()), "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            "micro_batches": len(computed), "token_budget": trainable.micro_batch_tokens}


def profile(trainable: Trainable, batch: Experience, micro_batch_size, pack: bool, rows: int = 25) -> None:
    """One more step under torch.profiler: the operators with the most device time, then
    the GPU's idle time and the host operators it waited on (benchmarks/gpu_gaps.py)."""
    import tempfile

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    from benchmarks.gpu_gaps import gaps_report

    with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(trainable, batch, micro_batch_size, pack)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60))
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        gaps_report(trace.name)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--max-response", type=int, default=1024)
    parser.add_argument("--mean-response", type=float, default=215.0)
    parser.add_argument("--layers", type=int, default=24, help="fewer for a quick try")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token-caps", type=int, nargs="*", default=[8192, 16384, 65536],
                        help="also run packed with the auto budget capped at each (micro_batch_size: auto "
                             "caps at 32768 real tokens)")
    parser.add_argument("--compile-blocks", action="store_true", help="also run packed with compiled blocks")
    parser.add_argument("--autograd-projection", action="store_true",
                        help="also run compile_model with the logits differentiated op by op (before vocab_scores)")
    parser.add_argument("--compile-model", action="store_true",
                        help="also run packed as train.compile_model does (blocks and projection compiled)")
    parser.add_argument("--share-prompts", action="store_true",
                        help="also run compile_model with train.share_prompts (see --samples)")
    parser.add_argument("--samples", type=int, default=1, help="consecutive rows that share a prompt")
    parser.add_argument("--profile", action="store_true",
                        help="profile one step of the packed way (and of the compile_model ways, if run)")
    parser.add_argument("--only", nargs="*", help="run only the ways whose name starts with one of these")
    parser.add_argument("--max-gpu-memory-gib", type=float,
                        help="cap this process's torch allocations as a role's max_gpu_memory_gib does")
    parser.add_argument("--json", help="append the result as one JSON line to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/packed_update.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    if args.max_gpu_memory_gib:
        limit_gpu_memory(args.max_gpu_memory_gib)
    from transformers import Qwen2ForCausalLM

    config = qwen2_05b_config(args.layers)
    batch = experience(args.rows, args.prompt, args.max_response, args.mean_response, config.vocab_size, args.seed,
                       args.samples)
    torch.manual_seed(args.seed)
    initial = Qwen2ForCausalLM(config).to(torch.bfloat16)    # built once (random init of 0.5B takes a while)
    results = {}
    ways = [("padded", 16, False, True, None), ("packed", "auto", True, True, None),
            ("packed, no checkpointing", "auto", True, False, None)]
    ways += [(f"packed, <= {cap} tokens", "auto", True, True, cap) for cap in args.token_caps]
    if args.compile_blocks:
        ways += [("packed, compiled blocks", "auto", True, True, None)]
    if args.compile_model:
        ways += [("packed, compile_model", "auto", True, True, None)]
    if args.autograd_projection:
        ways += [("packed, compile_model, autograd projection", "auto", True, True, None)]
    if args.share_prompts:
        ways += [("packed, compile_model, shared prompts", "auto", SHARED_PROMPTS, True, None)]
    projected_scores = forward.projected_scores
    if args.only:
        ways = [way for way in ways if way[0].startswith(tuple(args.only))]
    for name, micro_batch_size, pack, checkpointing, cap in ways:
        def build(compiled_blocks="blocks" in name):
            model = copy.deepcopy(initial)
            if compiled_blocks:
                forward.compile_blocks(model)
            if pack == SHARED_PROMPTS:
                forward.choose_packing(model, True, True)   # the attention tiles
            return model
        forward.projected_scores = autograd_projection if "autograd projection" in name else projected_scores
        trainable = Trainable(build, lr=1e-6, strategy="none", device="cuda", gradient_checkpointing=checkpointing,
                              compile_model="compile_model" in name, role_name="actor")
        if cap:
            trainable.allocator.max_tokens = cap
        began = time.perf_counter()
        run(trainable, batch, micro_batch_size, pack)            # warm-up; the budget measures bytes per token
        warm_up = time.perf_counter() - began
        second = run(trainable, batch, micro_batch_size, pack)["seconds"]   # may meet shapes the warm-up did not
        results[name] = {**run(trainable, batch, micro_batch_size, pack), "warm_up_seconds": warm_up,
                         "second_seconds": second}
        if args.profile and name in ("packed", "packed, compile_model", "packed, compile_model, shared prompts"):
            profile(trainable, batch, micro_batch_size, pack)
        del trainable
        torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}: {args.rows} rows, prompt {args.prompt}, responses geometric mean "
          f"{args.mean_response:g} cut at {args.max_response}, {args.layers} layers, bf16")
    if args.max_gpu_memory_gib:
        print(f"torch capped at {args.max_gpu_memory_gib:g} GiB (set_per_process_memory_fraction)")
    print(f"{'':38} {'seconds':>8} {'computed/real':>14} {'peak GiB':>9} {'reserved':>9} {'micro-batches':>14} "
          f"{'warm-up s':>10} {'second run s':>13} {'retries':>8} {'driver allocs':>14}")
    for name, r in results.items():
        print(f"{name:38} {r['seconds']:8.2f} {r['computed_tokens'] / r['real_tokens']:14.2f} {r['peak_gib']:9.1f} "
              f"{r['reserved_gib']:9.1f} {r['micro_batches']:14d} {r['warm_up_seconds']:10.1f} "
              f"{r['second_seconds']:13.2f} {r['alloc_retries']:8d} {r['device_allocs']:14d}")
    if "padded" in results and "packed" in results:
        print(f"speed-up {results['padded']['seconds'] / results['packed']['seconds']:.2f}x")
    record = {"benchmark": "packed_update", "device": torch.cuda.get_device_name(), **vars(args), **results}
    if args.json:
        with open(args.json, "a") as out:
            out.write(json.dumps(record) + "\n")
    return record


if __name__ == "__main__":
    main()
