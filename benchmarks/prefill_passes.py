"""What one prefill pass of the cuda_graph engine costs, by its size: the forward that
continuous.SlotRun._prefill runs when free slots take new prompts (prompts left-padded to
--width, with the engine's prefill mask, written into a slot cache, the first token's logits
only).

With partial_keep_kv a long-tailed request's new prompts arrive in one pass per refill, about
4 k tokens each, and on an H100 eight such passes took 0.26 s against 0.09 s for one pass of
32 k tokens (benchmarks/RESULTS.md, session 12). This times passes of each --rows on their own,
eager and (with --compile) as the engine's compile_prefill runs them (torch.compile, dynamic
shapes, no CUDA graphs), so the fixed cost of a pass and what compiling saves read off one table:

    python benchmarks/prefill_passes.py --rows 16 32 64 128 256 --compile

Prints, per mode and row count: milliseconds a pass (median of --repeats, device time from
CUDA events on a GPU), tokens a pass and milliseconds per 1 k tokens. `--layers 2` on a CPU
is a quick check that it runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import save_qwen2_05b  # noqa: E402

from pipeline.engines.prefill import prefill_mask  # noqa: E402
from pipeline.engines.cuda_graph import CudaGraphEngine  # noqa: E402
from pipeline.models import load_causal_lm  # noqa: E402


def time_pass(forward, cache, rows: int, width: int, ring: int, device: str,
              repeats: int) -> tuple[float, torch.Tensor]:
    """Median milliseconds of one prefill forward of `rows` prompts of `width` tokens, and
    the first tokens' logits it computed (the same prompts in every mode)."""
    ids = torch.randint(2, 1000, (rows, width), device=device, generator=torch.Generator(device).manual_seed(rows))
    mask = torch.ones_like(ids)
    slots = torch.arange(rows, device=device)
    columns = torch.arange(width, device=device) + ring - width
    times = []
    for _ in range(repeats + 1):   # the first one warms up (and compiles this shape)
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        with torch.no_grad():
            logits = forward(input_ids=ids, attention_mask=prefill_mask(mask),
                    position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                    use_cache=False, logits_to_keep=1, slot_cache=cache, slot_rows=slots,
                    slot_columns=columns).logits[:, -1].float()
        if device == "cuda":
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times[1:]), logits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--width", type=int, default=128, help="prompt tokens a row (the pass's width)")
    parser.add_argument("--new-tokens", type=int, default=1024, help="the ring holds width + this many columns")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--compile", action="store_true", help="also time the forward under torch.compile")
    parser.add_argument("--model-dir", default=None)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = args.model_dir or str(Path(tempfile.gettempdir()) / f"dask-rl-qwen2-0.5b-{args.layers}l")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = load_causal_lm(save_qwen2_05b(model_dir, layers=args.layers), device=device, dtype=dtype).eval()
    engine = CudaGraphEngine(model, pad_id=0, eos_id=1, device=device, max_batch_size=max(args.rows),
                             compile_prefill=args.compile)
    ring = args.width + args.new_tokens
    cache = engine._cache(engine.max_batch_size, ring)
    modes = {"eager": engine.model}
    if args.compile:
        modes["compiled"] = engine.prefill_model
    print(f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}, torch {torch.__version__}, "
          f"{args.layers} layers, prompts of {args.width} tokens", flush=True)
    logits = {}
    for mode, forward in modes.items():
        for rows in args.rows:
            ms, logits[mode, rows] = time_pass(forward, cache, rows, args.width, ring, device, args.repeats)
            tokens = rows * args.width
            print(f"prefill pass, {mode:8}: {rows:4d} rows, {tokens:6d} tokens, {ms:8.2f} ms a pass, "
                  f"{1e3 * ms / tokens:6.3f} ms per 1 k tokens", flush=True)
    if args.compile:   # the compiled forward must compute what the eager one does
        worst = max(float((logits["compiled", rows] - logits["eager", rows]).abs().max()) for rows in args.rows)
        print(f"compiled against eager: largest |logit difference| {worst:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
