"""Slot use and decode steps of the cuda_graph engine's slot loop on long-tailed lengths,
measured on the CPU (eager, a tiny model): both depend only on the response lengths and the
scheduling (refills, when the tail moves into fewer slots, a look at the device every
continuous.EOS_CHECK_EVERY steps as on a GPU), not on the device. Each token ends a response
with probability p (benchmarks/shapes.py end_with_probability), as in the GPU benchmark.

    python benchmarks/slot_use.py            # 256 x up to 1024 new tokens, p 0.004 and 0.0075; ~30 s on 2 cores

Prints, per p and per shrink rule (SHRINK_SHARE 2 = halve, 4 = quarter): mean length, decode
steps, slot use, and the decode steps spent at each slot count. With --step-ms (a GPU's
milliseconds a decode step at each slot count, as rollout_engines.py prints them) it also
predicts the request's decode seconds on that GPU if the tail stopped shrinking at a floor
of 8, 16, 32 or 64 slots: the steps below the floor run at the floor's step time (the
longest row sets the number of steps either way), and each slot count at or above the floor
is one decode graph to compile.

    python benchmarks/slot_use.py --end-probability 0.004 --shrink-share 2 \
        --step-ms 256:4.21 128:2.915 64:2.355 32:2.23 16:2.168 8:2.123     # an H100, 12-06
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shapes import decode_seconds, end_with_probability  # noqa: E402
from pipeline.engines import continuous  # noqa: E402
from pipeline.engines.cuda_graph import CudaGraphEngine, bucket_length  # noqa: E402
from pipeline.engines.hf import repeat_prompts  # noqa: E402
from pipeline.models import create_tiny_model, load_causal_lm, load_tokenizer  # noqa: E402
from pipeline.records import GenerationRequest  # noqa: E402


@torch.no_grad()
def measure(engine, request: GenerationRequest, slots: int) -> dict:
    """One request through the slot loop, with a look at the device every EOS_CHECK_EVERY
    steps as on a GPU (the engine looks every step on a CPU)."""
    prompts, _ = repeat_prompts(request)
    width = bucket_length(max(len(p) for p in prompts), engine.prompt_bucket)
    torch.manual_seed(request.seed)
    run = continuous.SlotRun(engine, prompts, width, request, slots)
    run.check_every = continuous.EOS_CHECK_EVERY
    run.run()
    return {**run.stats, "mean_length": run.stats["tokens"] / len(prompts)}


def step_time(text: str) -> tuple[int, float]:
    slots, ms = text.split(":")
    return int(slots), float(ms)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--end-probability", type=float, nargs="+", default=[0.004, 0.0075])
    parser.add_argument("--shrink-share", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--step-ms", type=step_time, nargs="*", default=[], metavar="SLOTS:MS",
                        help="a GPU's milliseconds a decode step at each slot count, e.g. 256:4.21 128:2.92")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    directory = create_tiny_model(Path(tempfile.mkdtemp(prefix="slot-use-")) / "tiny", seed=0)
    model, tokenizer = load_causal_lm(directory), load_tokenizer(directory)
    eos = tokenizer.eos_token_id
    engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=eos, device="cpu",
                             max_batch_size=args.sequences)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, len(tokenizer), (args.sequences, args.prompt), generator=generator).tolist()
    request = GenerationRequest(prompts, list(range(args.sequences)), 1, args.new_tokens, 1.0, seed=1)
    for probability in args.end_probability:
        hook = end_with_probability(model, eos, probability)
        try:
            for share in args.shrink_share:
                continuous.SHRINK_SHARE = share
                row = measure(engine, request, args.sequences)
                print(f"p {probability}, shrink at 1/{share} live: mean length {row['mean_length']:.1f}, "
                      f"{row['decode_steps']} decode steps, slot use {row['slot_use']:.2f}; decode steps at "
                      + ", ".join(f"{slots} slots: {steps}" for slots, steps in sorted(row["decode_steps_at"].items(),
                                                                                     reverse=True)), flush=True)
                step_ms = dict(args.step_ms)
                for floor in (8, 16, 32, 64) if step_ms else ():
                    counts = len({max(slots, floor) for slots in row["decode_steps_at"]})
                    print(f"  tail floor {floor:2d} slots: {decode_seconds(row['decode_steps_at'], step_ms, floor):.3f} s "
                          f"decoding predicted, {counts} decode graphs", flush=True)
        finally:
            hook.remove()


if __name__ == "__main__":
    main()
