"""How many groups a partial-rollout step trains, on the CPU (eager, a tiny model): the
groups, rows and tokens each step trains, the rows it carries and the engine's slot use,
request by request. These depend only on the response lengths and the scheduling, not on
the device. Each token ends a response with probability p (benchmarks/shapes.py
end_with_probability), as in the GPU benchmark's long tail.

    python benchmarks/partial_step_size.py      # 32 groups x 8 a step, up to 1024 new tokens, p 0.005,
                                                # max_staleness 3, requests of 6x, one batch ahead; ~5 min

`--draws top-up` draws as dask-rl did before: each request topped up to request_groups x
prompts_per_step groups. `--draws step` (today's partial.new_groups): the first request draws
that many, each later one prompts_per_step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shapes import end_with_probability, partial_requests  # noqa: E402
from pipeline.engines import continuous  # noqa: E402
from pipeline.engines.cuda_graph import CudaGraphEngine  # noqa: E402
from pipeline.models import create_tiny_model, load_causal_lm, load_tokenizer  # noqa: E402
from pipeline.partial import finish_born_before, trained_groups  # noqa: E402


def top_up(prompts_per_step: int, carried, request_groups: int) -> int:
    """The draws before: every request holds request_groups x prompts_per_step groups."""
    return max(prompts_per_step, request_groups * prompts_per_step - len({row.group_id for row in carried}))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=32, help="prompts_per_step")
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--end-probability", type=float, default=0.005)
    parser.add_argument("--max-staleness", type=int, default=3)
    parser.add_argument("--request-groups", type=int, default=6)
    parser.add_argument("--ahead", type=int, default=1, help="batches generated ahead (1: gpu_sharing mps)")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--steady-from", type=int, default=6, help="requests left out of the means")
    parser.add_argument("--draws", nargs="+", choices=["step", "top-up"], default=["step", "top-up"])
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    directory = create_tiny_model(Path(tempfile.mkdtemp(prefix="partial-step-")) / "tiny", seed=0)
    model, tokenizer = load_causal_lm(directory), load_tokenizer(directory)
    engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, device="cpu",
                             max_batch_size=args.groups * args.samples_per_prompt,
                             check_every=continuous.EOS_CHECK_EVERY)
    end_with_probability(model, tokenizer.eos_token_id, args.end_probability)
    prompts = torch.randint(3, len(tokenizer), (args.groups, args.prompt),
                            generator=torch.Generator().manual_seed(0)).tolist()
    print(f"{args.groups} groups x {args.samples_per_prompt} a step, up to {args.new_tokens} new tokens, end "
          f"probability {args.end_probability}, max_staleness {args.max_staleness}, requests of "
          f"{args.request_groups}x, {args.ahead} batch(es) ahead", flush=True)
    for rule in args.draws:
        rows = []
        for version, rollout, carried, _ in partial_requests(
                engine, lambda version, draws: [prompts[d % args.groups] for d in draws], args.groups,
                args.samples_per_prompt, args.new_tokens, args.max_staleness, args.request_groups, args.requests,
                keep_kv=True, ahead=args.ahead, draw_count=top_up if rule == "top-up" else None):
            trained = trained_groups(rollout, args.groups, finish_born_before(version, args.max_staleness, args.ahead))
            lengths = rollout.response_mask[torch.isin(rollout.group_ids, trained)].sum(-1)
            stats = engine.last_stats
            rows.append((len(trained), len(lengths), int(lengths.sum()), stats["slot_use"], stats["decode_steps"]))
            print(f"  {rule}, request {version}: {len(trained)} groups ({len(lengths)} rows, mean response "
                  f"{lengths.float().mean():.0f}, {int(lengths.sum())} tokens) trained, {len(carried)} rows carried, "
                  f"slot use {stats['slot_use']:.2f}, {stats['decode_steps']} decode steps", flush=True)
        steady = rows[args.steady_from:]
        means = [statistics.mean(row[i] for row in steady) for i in range(5)]
        print(f"{rule}: requests {args.steady_from}-{args.requests - 1}: {means[0]:.1f} groups ({means[1]:.0f} rows, "
              f"{means[2]:.0f} tokens) trained a step (prompts_per_step {args.groups}), slot use {means[3]:.2f}, "
              f"{means[4]:.0f} decode steps, {means[2] / means[4]:.0f} trained tokens a decode step", flush=True)


if __name__ == "__main__":
    main()
