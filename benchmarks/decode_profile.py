"""Where a captured decode step's time goes, at several slot counts, on one GPU.

A decode step of the cuda_graph engine on the Qwen2-0.5B shape took 2.1 ms at 8 slots and
4.2 ms at 256 on an H100 (rollout_engines.py), against about 0.35 ms to read the weights
once: most of a small step is something other than memory traffic. This profiles the
decode steps of one request at each slot count (the tail never moves into fewer slots,
rows end with probability --end-probability a token, so a request is short) and prints the
GPU time a step, the kernels a step, and the kernels that take the most time.

    python benchmarks/decode_profile.py --slots 8 256
    python benchmarks/decode_profile.py --slots 256 --unfused    # projections unfused, to compare
    python benchmarks/decode_profile.py --slots 256 --sampler race   # the sampler before (an exponential race)

Each slot count is one decode graph to compile (from Inductor's cache where it has it).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import (  # noqa: E402
    add_engine_options, engine_options, end_with_probability, save_qwen2_05b, word_prompts,
)

from pipeline.engines import continuous, cuda_graph  # noqa: E402
from pipeline.engines.cuda_graph import CudaGraphEngine  # noqa: E402
from pipeline.engines.sampling import filter_logits, filters_active  # noqa: E402
from pipeline.models import load_causal_lm, load_tokenizer  # noqa: E402
from pipeline.records import GenerationRequest  # noqa: E402


def race_sample_tokens(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                       min_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The engines' sampler until 2026-12-07: argmax_i p_i / E_i with E_i ~ Exp(1), one random
    number a logit, and the log-softmax of the whole row."""
    scaled = logits.float() / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    allowed = filter_logits(scaled, top_k, top_p, min_p) if filters_active(top_k, top_p, min_p) else scaled
    tokens = (allowed - torch.empty_like(logp).exponential_().log()).argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def profile_slots(model, tokenizer, slots: int, args) -> None:
    cuda = args.device == "cuda"
    engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, device=args.device,
                             max_batch_size=slots, fewest_slots=slots,
                             **engine_options(args))
    prompts = [tokenizer(text)["input_ids"] for text in word_prompts(slots, args.prompt)]
    request = GenerationRequest(prompts, list(range(slots)), 1, args.new_tokens, 1.0, seed=0)
    engine.generate(request, 0)   # compiles this slot count's graph
    wait = torch.cuda.synchronize if cuda else (lambda: None)
    wait()
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        engine.generate(request, 0)
        wait()
    steps = engine.last_stats["decode_steps"]
    # Kernels only: (name, launches, ms in all), from the profiler's averages by name.
    # (On a CPU, --device cpu: the operators' own CPU time, a check that the script runs.)
    own_time = "self_device_time_total" if cuda else "self_cpu_time_total"
    kernels = [(row.key, row.count, getattr(row, own_time) / 1e3) for row in prof.key_averages()
               if getattr(row, own_time) > 0]
    total, count = sum(ms for *_, ms in kernels), sum(n for _, n, _ in kernels)
    prefill = engine.last_stats["prefill_ms"]
    print(f"{slots} slots: {steps} decode steps, {engine.last_stats['step_ms']} ms a step by the wall clock; "
          f"GPU {(total - prefill) / steps:.3f} ms a decode step (prefill {prefill:.1f} ms left out), "
          f"about {count / steps:.0f} kernels a step (prefill's included)", flush=True)
    for name, launches, ms in sorted(kernels, key=lambda row: -row[2])[:args.top]:
        print(f"  {ms / steps:7.4f} ms a step  {launches / steps:6.1f} a step  {name[:110]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[8, 256])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=1024, help="sets the ring length, as in the benchmarks")
    parser.add_argument("--end-probability", type=float, default=0.05, help="short requests: a few dozen steps")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--device", default="cuda", help="cpu: a quick check that the script runs (eager, no graphs)")
    parser.add_argument("--layers", type=int, default=24, help="fewer for a quick check")
    parser.add_argument("--sampler", choices=["inverse", "race"], default="inverse",
                        help="inverse: dask-rl's (one uniform a row); race: an exponential race over every "
                             "logit, the sampler before")
    add_engine_options(parser)
    args = parser.parse_args(argv)
    if args.sampler == "race":
        continuous.sample_tokens = cuda_graph.sample_tokens = race_sample_tokens
    name = "dask-rl-qwen2-0.5b" if args.layers == 24 else f"dask-rl-qwen2-0.5b-{args.layers}-layers"
    directory = save_qwen2_05b(Path(tempfile.gettempdir()) / name, layers=args.layers)
    model = load_causal_lm(directory, device=args.device, dtype=torch.bfloat16)
    tokenizer = load_tokenizer(directory)
    end_with_probability(model, tokenizer.eos_token_id, args.end_probability)
    for slots in args.slots:
        profile_slots(model, tokenizer, slots, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
