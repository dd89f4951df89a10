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

With --partial N it also runs N consecutive partial rollouts (train.partial_rollouts) of the
same sequences as groups of --samples-per-prompt, at each --max-staleness, and prints their
slot use, decode steps and tokens a request; with --step-ms, the decode seconds and useful
tokens/s predicted on that GPU (decode steps only: re-prefilling the carried rows is not in
the step table):

    python benchmarks/slot_use.py --end-probability 0.004 --shrink-share 2 --partial 4 \
        --step-ms 256:4.21 128:2.915 64:2.355 32:2.23 16:2.168 8:2.123

--looks lagged present runs each way of looking (continuous.LAGGED_LOOKS): acting on the last
look's copy costs decode steps, which this counts; what it saves (the device waiting for the
host at each look) is not on a CPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shapes import decode_seconds, end_with_probability, partial_requests  # noqa: E402
from pipeline.engines import continuous  # noqa: E402
from pipeline.engines.cuda_graph import CudaGraphEngine  # noqa: E402
from pipeline.models import create_tiny_model, load_causal_lm, load_tokenizer  # noqa: E402
from pipeline.records import GenerationRequest  # noqa: E402


@torch.no_grad()
def measure(engine, request: GenerationRequest) -> dict:
    """One request through the slot loop (the engine looks at the device every
    EOS_CHECK_EVERY steps, as on a GPU) -> its stats."""
    rollout = engine.generate(request, 0)
    return {**engine.last_stats, "mean_length": engine.last_stats["tokens"] / len(rollout)}


def measure_partial(engine, prompts: list[list[int]], samples: int, new: int, max_staleness: int,
                    requests: int, request_groups: int, fill: int) -> dict:
    """`requests` consecutive partial rollouts of len(prompts) groups a step (after `fill`
    that build the carry), as train.partial_rollouts runs them -> mean stats a request."""
    groups = len(prompts)
    runs = [dict(engine.last_stats) for version, *_ in partial_requests(
                engine, lambda version, draws: [prompts[draw % groups] for draw in draws], groups, samples, new,
                max_staleness, request_groups, fill + requests)
            if version >= fill]
    steps_at = {slots: sum(run["decode_steps_at"].get(slots, 0) for run in runs) / requests
                for slots in {slots for run in runs for slots in run["decode_steps_at"]}}
    return {"slot_use": sum(run["slot_use"] for run in runs) / requests,
            "decode_steps": sum(run["decode_steps"] for run in runs) / requests,
            "tokens": sum(run["tokens"] for run in runs) / requests, "decode_steps_at": steps_at,
            "carried_out": sum(run["carried_out"] for run in runs) / requests,
            "tokens_each": [run["tokens"] for run in runs]}


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
    parser.add_argument("--partial", type=int, default=0, metavar="N",
                        help="also N consecutive partial rollouts of sequences / samples-per-prompt groups")
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--max-staleness", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--fill", type=int, default=2, help="partial rollouts: requests run before the timed ones")
    parser.add_argument("--looks", nargs="+", choices=["lagged", "present"], default=["lagged"],
                        help="act on the last look (the engine's default) or on the present; each is run")
    parser.add_argument("--request-groups", type=int, default=2,
                        help="partial rollouts: a request holds this many times a step's groups")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    directory = create_tiny_model(Path(tempfile.mkdtemp(prefix="slot-use-")) / "tiny", seed=0)
    model, tokenizer = load_causal_lm(directory), load_tokenizer(directory)
    eos = tokenizer.eos_token_id
    engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=eos, device="cpu",
                             max_batch_size=args.sequences, check_every=continuous.EOS_CHECK_EVERY)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, len(tokenizer), (args.sequences, args.prompt), generator=generator).tolist()
    request = GenerationRequest(prompts, list(range(args.sequences)), 1, args.new_tokens, 1.0, seed=1)
    for probability, looks in [(p, look) for p in args.end_probability for look in args.looks]:
        continuous.LAGGED_LOOKS = looks == "lagged"
        print(f"{looks} looks:", flush=True)
        hook = end_with_probability(model, eos, probability)
        try:
            for share in args.shrink_share:
                continuous.SHRINK_SHARE = share
                row = measure(engine, request)
                print(f"p {probability}, shrink at 1/{share} live: mean length {row['mean_length']:.1f}, "
                      f"{row['decode_steps']} decode steps, slot use {row['slot_use']:.2f}; decode steps at "
                      + ", ".join(f"{slots} slots: {steps}" for slots, steps in sorted(row["decode_steps_at"].items(),
                                                                                     reverse=True)), flush=True)
                step_ms = dict(args.step_ms)
                for floor in (8, 16, 32, 64) if step_ms else ():
                    counts = len({max(slots, floor) for slots in row["decode_steps_at"]})
                    print(f"  tail floor {floor:2d} slots: {decode_seconds(row['decode_steps_at'], step_ms, floor):.3f} s "
                          f"decoding predicted, {counts} decode graphs", flush=True)
            continuous.SHRINK_SHARE = 2
            groups = args.sequences // args.samples_per_prompt
            for staleness in args.max_staleness if args.partial else ():
                row = measure_partial(engine, prompts[:groups], args.samples_per_prompt, args.new_tokens, staleness,
                                      args.partial, args.request_groups, args.fill)
                print(f"p {probability}, partial rollouts ({groups} groups of {args.samples_per_prompt} a step, "
                      f"max_staleness {staleness}, requests of {args.request_groups}x): "
                      f"{row['decode_steps']:.0f} decode steps and {row['tokens']:.0f} tokens a request "
                      f"({row['tokens_each']}), slot use {row['slot_use']:.2f}, {row['carried_out']:.0f} rows carried",
                      flush=True)
                if step_ms:   # decode only: a carried row's prefill is not in the table
                    seconds = decode_seconds(row["decode_steps_at"], step_ms)
                    full = max(step_ms) * 1000 / step_ms[max(step_ms)]
                    print(f"  {seconds:.3f} s decoding a request predicted: {row['tokens'] / seconds:,.0f} useful "
                          f"tokens/s, {full / (row['tokens'] / seconds):.2f}x below the full-length rate "
                          f"({full:,.0f})", flush=True)
        finally:
            hook.remove()
            continuous.LAGGED_LOOKS = True


if __name__ == "__main__":
    main()
