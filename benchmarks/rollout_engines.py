"""Rollout engines alone on one GPU: dask-rl's cuda_graph engine against transformers'
`generate` with its compiled static cache, on the Qwen2-0.5B shape (random bf16 weights),
prompts of 128 tokens, 256 new tokens, sampling at temperature 1; plus how far the engine's
logprobs are from the actor's training forward on the same tokens.

    python benchmarks/rollout_engines.py --batches 64 256

Prints one line per engine and batch: seconds, completion tokens/s, ms per decode step,
peak GPU memory of this process. EOS is disabled for the timing (a random model would end
sequences at random), so every row generates exactly --new-tokens tokens.

Long-tailed lengths (continuous batching): `--long-tail 0.004 0.0075` times the cuda_graph
engine on responses that end with that probability at every token (geometric lengths, mean
~1/p, cut at --new-tokens), after a full-length run of the same shape, and prints decode
steps, mean length, useful tokens/s, and the share of decode slots that held a live row:

    python benchmarks/rollout_engines.py --batches 256 --new-tokens 1024 --long-tail 0.004 0.0075 --skip-generate

With `--partial N` the same lengths run as train.partial_rollouts runs them: groups of
--samples-per-prompt, each request holding the rows the one before carried plus new groups,
ending once batch / samples groups are complete; N requests are timed after two that fill the
carry, and useful tokens/s counts what each request generated (carried rows' tokens once):

    python benchmarks/rollout_engines.py --batches 256 --new-tokens 1024 --long-tail 0.004 0.0075 --partial 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import (  # noqa: E402
    add_engine_options, engine_options, end_with_probability, mean_geometric_length, partial_requests, save_qwen2_05b,
)

from pipeline.engines import continuous  # noqa: E402
from pipeline.engines.cuda_graph import CudaGraphEngine  # noqa: E402
from pipeline.models import load_causal_lm  # noqa: E402
from pipeline.records import GenerationRequest  # noqa: E402
from pipeline.roles.forward import response_logprobs  # noqa: E402

NO_EOS = -1  # an id no token has: nothing ends early
ENGINE_OPTIONS: dict = {}   # every engine's options from the command line (--decode-attention, --unfused)


def cuda_graph_engine(model, **kwargs) -> CudaGraphEngine:
    return CudaGraphEngine(model, **ENGINE_OPTIONS, **kwargs)


def timed(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up call (which compiles)."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def request(batch: int, prompt: int, new: int, seed: int = 0, samples: int = 1) -> GenerationRequest:
    """`batch` sequences: batch / samples random prompts, `samples` of each."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, 151936, (batch // samples, prompt), generator=generator).tolist()
    return GenerationRequest(prompts, list(range(batch // samples)), samples, new, 1.0, seed)


def report(name: str, batch: int, seconds: float, new: int) -> None:
    tokens = batch * new
    print(f"{name:<34} batch {batch:>4}: {seconds:6.2f} s  {tokens / seconds:>9,.0f} tokens/s  "
          f"{1000 * seconds / new:5.2f} ms/step  peak {torch.cuda.max_memory_allocated() / 2**30:5.1f} GiB",
          flush=True)


def bench_engine(model, batch: int, prompt: int, new: int, repeats: int, samples: int = 1,
                 prefills: tuple[str, ...] = ("shared",)) -> None:
    """Full-length requests of `batch` sequences, `samples` of each prompt; each of `prefills`
    timed: "shared" (a prompt computed once for its samples, the engine's way) or "each row"
    (every row's prompt computed, as before the engine shared them)."""
    engine = cuda_graph_engine(model, pad_id=0, eos_id=NO_EOS, device="cuda", max_batch_size=batch)
    req = request(batch, prompt, new, samples=samples)
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    engine.generate(req, 0)
    print(f"cuda_graph first call (compiles) batch {batch}: {time.perf_counter() - start:.1f} s", flush=True)
    distinct = continuous.distinct_prefixes
    for way in prefills:
        continuous.distinct_prefixes = distinct if way == "shared" else (lambda rows: [[i] for i in range(len(rows))])
        try:
            seconds = timed(lambda: engine.generate(req, 0), repeats)
        finally:
            continuous.distinct_prefixes = distinct
        stats = engine.last_stats
        report(f"dask-rl cuda_graph, prefill {way}", batch, seconds, new)
        print(f"  {samples} samples a prompt: prefill {stats['prefill_ms']:.1f} ms of device time, "
              f"{stats['prefill_tokens']:,} tokens computed in {stats['prefill_passes']} passes", flush=True)


def bench_long_tail(model, batch: int, prompt: int, new: int, probabilities: list[float], repeats: int) -> list:
    """Useful tokens/s of the cuda_graph engine at full length and at each end probability."""
    engine = cuda_graph_engine(model, pad_id=0, eos_id=1, device="cuda", max_batch_size=batch)
    # One hook before anything compiles, its probability a device tensor set for each run:
    # torch.compile would not see a hook added after it compiled (0: EOS never sampled).
    end = torch.zeros((), device="cuda")
    hook = end_with_probability(model, 1, end)
    rows = []
    try:
        for probability in [0.0, *probabilities]:
            end.fill_(probability)
            rows.append(_long_tail_row(engine, batch, prompt, new, probability, repeats))
    finally:
        hook.remove()
    _below_full_length(rows, "")
    return rows


def _below_full_length(rows: list[dict], what: str) -> None:
    """Each long-tail row's useful tokens/s against the first row's (full length)."""
    full = rows[0]["useful_tokens_per_second"]
    for row in rows[1:]:
        kv = (f" ({row['kv']}, refill at 1/{row['refill_share']}, {row['prefill']} prefill, {row['looks']} looks)"
              if "kv" in row else "")
        print(f"  {what}end probability {row['end_probability']}{kv}: {full / row['useful_tokens_per_second']:.2f}x "
              f"below the full-length rate", flush=True)


def _time_spent(seconds: list[float], stats: list[dict]) -> dict:
    """Where a request's time went, means over requests: prefill passes (device time; tokens
    computed and real), host work at sync points (the device waits), and the rest (decode)."""
    def mean(key):
        return statistics.mean(s[key] for s in stats)
    spent = {"prefill_s": mean("prefill_ms") / 1e3, "host_s": mean("host_ms") / 1e3,
             "prefill_passes": mean("prefill_passes"), "prefill_tokens": mean("prefill_tokens"),
             "prefill_real_tokens": mean("prefill_real_tokens"), "prefill_shared": mean("prefill_shared")}
    spent["decode_s"] = statistics.mean(seconds) - spent["prefill_s"] - spent["host_s"]
    print(f"  a request's time: prefill {spent['prefill_s']:.3f} s ({spent['prefill_passes']:.0f} passes, "
          f"{spent['prefill_tokens']:,.0f} tokens computed for {spent['prefill_real_tokens']:,.0f}, "
          f"{spent['prefill_shared']:.0f} rows reusing a prompt computed for another), host at sync "
          f"points {spent['host_s']:.3f} s, decode and the rest {spent['decode_s']:.3f} s", flush=True)
    return spent


def _long_tail_row(engine, batch: int, prompt: int, new: int, probability: float, repeats: int) -> dict:
    engine.generate(request(batch, prompt, new, seed=2), 0)   # compiles the graphs of this shape (and its smaller slot counts)
    times, stats, tokens = [], [], []
    for repeat in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        rollout = engine.generate(request(batch, prompt, new, seed=3 + repeat), 0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        stats.append(dict(engine.last_stats))
        tokens.append(int(rollout.response_mask.sum()))
    seconds, useful = sum(times), sum(tokens)
    row = {"end_probability": probability, "batch": batch, "max_new_tokens": new,
           "expected_mean_length": mean_geometric_length(probability, new) if probability else new,
           "mean_length": useful / (batch * repeats), "decode_steps": statistics.mean(s["decode_steps"] for s in stats),
           "seconds": seconds / repeats, "useful_tokens_per_second": useful / seconds,
           "slot_use": statistics.mean(s["slot_use"] for s in stats), "step_ms": stats[-1]["step_ms"]}
    print(f"cuda_graph batch {batch}, end probability {probability:<6}: mean length {row['mean_length']:6.1f} "
          f"(expected {row['expected_mean_length']:.0f}), {row['decode_steps']:6.0f} decode steps, "
          f"{row['seconds']:5.2f} s, {row['useful_tokens_per_second']:>8,.0f} useful tokens/s, "
          f"slot use {row['slot_use']:.2f}; ms a decode step at each slot count: "
          + ", ".join(f"{slots}: {ms:.2f}" for slots, ms in row["step_ms"].items()), flush=True)
    row["time_spent"] = _time_spent(times, stats)
    return row


def bench_partial(model, batch: int, prompt: int, new: int, probabilities: list[float], samples: int,
                  requests: int, max_staleness: int, request_groups: int, kv_modes: list[str],
                  refill_shares: list[int], prefill_modes: list[str] = ("eager",),
                  looks: list[str] = ("lagged",), fill: int = 2) -> list:
    """Useful tokens/s of the cuda_graph engine over `requests` consecutive partial
    rollouts (after `fill` that build the carry), at full length and at each end probability,
    once for each of `kv_modes`, "prefill" (a carried row is prefilled again) and "keep" (a
    row still in its slot decodes on there, train.partial_keep_kv), and each of
    `refill_shares` (continuous.REFILL_SHARE: free slots wait for 1/share of the slots) and
    `prefill_modes`, "eager" or "compiled" (the engine's compile_prefill), and `looks`,
    "lagged" (act on the last look, continuous.LAGGED_LOOKS) or "present" (wait at each)."""
    device = next(model.parameters()).device
    engine = cuda_graph_engine(model, pad_id=0, eos_id=1, device=str(device), max_batch_size=batch)
    prefill_models = {"eager": engine.prefill_model}
    if "compiled" in prefill_modes:
        prefill_models["compiled"] = cuda_graph_engine(model, pad_id=0, eos_id=1, device=str(device),
                                                     compile_prefill=True).prefill_model
    end = torch.zeros((), device=device)   # hooked once, before anything compiles (see bench_long_tail)
    hook = end_with_probability(model, 1, end)
    groups, rows, default_share = batch // samples, [], continuous.REFILL_SHARE
    try:
        for probability in [0.0, *probabilities]:
            end.fill_(probability)
            # A whole request first compiles every slot count these lengths meet (256 down to
            # 8): a partial request may reach a smaller one only in a timed request.
            engine.generate(request(batch, prompt, new, seed=2), 0)
            for kv in kv_modes[:1] if probability == 0 else kv_modes:   # full length: no row is left
                for share in refill_shares[:1] if probability == 0 else refill_shares:
                    ways = [(mode, look) for mode in prefill_modes for look in looks]
                    for mode, look in ways[:1] if probability == 0 else ways:   # full length: one way
                        continuous.REFILL_SHARE, continuous.LAGGED_LOOKS = share, look == "lagged"
                        engine.prefill_model = prefill_models[mode]
                        rows.append(_partial_row(engine, batch, prompt, new, probability, samples, requests,
                                                 max_staleness, request_groups, kv, fill, mode, look))
    finally:
        hook.remove()
        continuous.REFILL_SHARE, continuous.LAGGED_LOOKS = default_share, True
    _below_full_length(rows, "partial, ")
    return rows


def _partial_row(engine, batch: int, prompt: int, new: int, probability: float, samples: int, requests: int,
                 max_staleness: int, request_groups: int, kv: str, fill: int, prefill: str = "eager",
                 looks: str = "lagged") -> dict:
    groups = batch // samples
    runs = [(seconds, dict(engine.last_stats), len(rollout) - len(carried))
            for version, rollout, carried, seconds in partial_requests(
                engine, lambda version, draws: request(len(draws), prompt, new, seed=version).prompt_ids,
                groups, samples, new, max_staleness, request_groups, fill + requests, keep_kv=kv == "keep")
            if version >= fill]
    seconds = sum(run[0] for run in runs)
    row = {"end_probability": probability, "kv": kv, "prefill": prefill, "looks": looks, "refill_share": continuous.REFILL_SHARE, "batch": batch,
           "samples_per_prompt": samples,
           "max_new_tokens": new, "max_staleness": max_staleness, "request_groups": request_groups,
           "requests": requests,
           "seconds": seconds / requests,
           "useful_tokens_per_second": sum(run[1]["tokens"] for run in runs) / seconds,
           "slot_use": statistics.mean(run[1]["slot_use"] for run in runs),
           "trained_rows": statistics.mean(run[2] for run in runs),
           "carried_rows": statistics.mean(run[1]["carried_out"] for run in runs),
           "continued_rows": statistics.mean(run[1]["continued"] for run in runs),
           "decode_steps": statistics.mean(run[1]["decode_steps"] for run in runs),
           "request_seconds": [round(run[0], 3) for run in runs],
           "step_ms": [run[1]["step_ms"] for run in runs]}
    print(f"cuda_graph partial rollouts batch {batch} ({groups} x {samples}, max_staleness "
          f"{max_staleness}, carried rows: {kv}, refill at 1/{continuous.REFILL_SHARE}, {prefill} prefill, {looks} looks), end probability "
          f"{probability:<6}: {row['seconds']:5.2f} s a "
          f"request, {row['decode_steps']:6.0f} decode steps, "
          f"{row['useful_tokens_per_second']:>8,.0f} useful tokens/s, slot use {row['slot_use']:.2f}, "
          f"{row['trained_rows']:.0f} rows trained, {row['carried_rows']:.0f} carried and "
          f"{row['continued_rows']:.0f} decoded on in their slots a request; "
          f"seconds of each request {row['request_seconds']}", flush=True)
    row["time_spent"] = _time_spent([run[0] for run in runs], [run[1] for run in runs])
    return row


def bench_generate(model, batch: int, prompt: int, new: int, repeats: int) -> None:
    model.set_attn_implementation("sdpa")   # transformers' own attention, as `generate` users get it
    ids = torch.tensor(request(batch, prompt, new).prompt_ids, device="cuda")
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                  top_p=1.0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                  cache_implementation="static")
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model.generate(**kwargs)
    print(f"generate static first call (compiles) batch {batch}: {time.perf_counter() - start:.1f} s", flush=True)
    report("transformers generate, static+compile", batch, timed(lambda: model.generate(**kwargs), repeats), new)


def logprob_agreement(model, batch: int = 64, prompt: int = 128, new: int = 256) -> None:
    """The engine's behaviour logprobs against the actor's training forward (bf16, one pass)."""
    engine = cuda_graph_engine(model, pad_id=0, eos_id=1, device="cuda")
    rollout = engine.generate(request(batch, prompt, new, seed=1), 0)
    with torch.no_grad():
        actor = torch.cat([response_logprobs(model, rollout.input_ids[r].cuda(), rollout.attention_mask[r].cuda(),
                                             rollout.prompt_length, 1.0).float().cpu()
                           for r in (slice(0, batch // 2), slice(batch // 2, batch))])
    mask = rollout.response_mask.bool()
    diff = (rollout.behavior_logprobs - actor)[mask].abs()
    ratio = (rollout.behavior_logprobs - actor)[mask].exp()
    print(f"logprobs vs actor forward (bf16, {int(mask.sum())} tokens): mean |diff| {diff.mean():.4f}, "
          f"max {diff.max():.4f}; ratio exp(diff) mean {ratio.mean():.4f}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-generate", action="store_true", help="time the cuda_graph engine only")
    parser.add_argument("--long-tail", type=float, nargs="*", default=[],
                        help="end probabilities per token for the long-tail runs (none: skip them)")
    parser.add_argument("--partial", type=int, default=0, metavar="N",
                        help="time the long-tail lengths as N consecutive partial rollouts")
    parser.add_argument("--samples-per-prompt", type=int, default=8,
                        help="group size of the partial rollouts and (with --prefills) the full-length requests")
    parser.add_argument("--prefills", nargs="+", choices=["shared", "each row"], default=None,
                        help="full-length requests of --samples-per-prompt samples a prompt, each way timed: a "
                             "prompt prefilled once for its samples (shared) or once a row (default: distinct "
                             "prompts, one sample each)")
    parser.add_argument("--request-groups", type=int, default=2,
                        help="partial rollouts: a request holds this many times a step's groups")
    parser.add_argument("--max-staleness", type=int, default=2,
                        help="partial rollouts: versions a row may span (1: a carried row ends in the next request)")
    parser.add_argument("--kv", nargs="+", choices=["prefill", "keep"], default=["prefill", "keep"],
                        help="partial rollouts: a carried row is prefilled again, or (keep) a row still in its "
                             "slot decodes on there (train.partial_keep_kv); each is timed")
    parser.add_argument("--refill-share", type=int, nargs="+", default=[continuous.REFILL_SHARE],
                        help="partial rollouts: free slots are refilled once 1/N of the slots are free; each N timed")
    parser.add_argument("--prefill", nargs="+", choices=["eager", "compiled"], default=["eager"],
                        help="partial rollouts: prefill passes eager or compiled (the engine's compile_prefill); "
                             "each is timed")
    parser.add_argument("--looks", nargs="+", choices=["lagged", "present"], default=["lagged"],
                        help="partial rollouts: act on the last look (the default) or wait for the present at "
                             "each; each is timed")
    parser.add_argument("--json", help="write the long-tail rows to this file")
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "dask-rl-qwen2-0.5b"))
    add_engine_options(parser)
    args = parser.parse_args(argv)
    ENGINE_OPTIONS.update(engine_options(args))
    model = load_causal_lm(save_qwen2_05b(args.model_dir), device="cuda", dtype=torch.bfloat16).eval()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    if args.long_tail and args.partial:
        rows = [row for batch in args.batches
                for row in bench_partial(model, batch, args.prompt, args.new_tokens, args.long_tail,
                                         args.samples_per_prompt, args.partial, args.max_staleness,
                                         args.request_groups, args.kv, args.refill_share, args.prefill,
                                         args.looks)]
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return 0
    if args.long_tail:
        rows = [row for batch in args.batches
                for row in bench_long_tail(model, batch, args.prompt, args.new_tokens, args.long_tail, args.repeats)]
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return 0
    for batch in args.batches:
        if args.prefills:
            bench_engine(model, batch, args.prompt, args.new_tokens, args.repeats, args.samples_per_prompt,
                         tuple(args.prefills))
        else:
            bench_engine(model, batch, args.prompt, args.new_tokens, args.repeats)
    logprob_agreement(model)
    if not args.skip_generate:
        for batch in args.batches:
            bench_generate(model, batch, args.prompt, args.new_tokens, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
