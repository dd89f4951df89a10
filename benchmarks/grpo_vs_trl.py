"""The same GRPO work through dask-rl and through TRL's GRPOTrainer, one after the other in
one run on one GPU: steady step time, completion tokens/s, peak GPU memory of all processes
(NVML), and the ratios.

    python benchmarks/grpo_vs_trl.py --prompts-per-step 8            # 8 x 8 samples a step
    python benchmarks/grpo_vs_trl.py --prompts-per-step 32           # batch 256
    python benchmarks/grpo_vs_trl.py --prompts-per-step 32 --new-tokens 1024 --end-probability 0.005
    python benchmarks/grpo_vs_trl.py --prompts-per-step 32 --new-tokens 1024 --end-probability 0.005 \
        --partial-rollouts --max-staleness 2

The last is the long-tail workload: on both sides the model ends a response with
probability 0.005 at every token (its EOS logit replaced in a hook on the output embedding,
benchmarks/shapes.py end_with_probability), so lengths are geometric with a mean near 200,
cut at 1024, as reasoning tasks' are. Useful tokens count the response tokens up to each end.
With --partial-rollouts dask-rl's rollout ends once a step's groups are complete and carries
the rest into the next step (a step then trains on at least --prompts-per-step groups: compare
tokens/s as well as step time).

The work: the Qwen2-0.5B shape with random bf16 weights (benchmarks/shapes.py), prompts of
128 tokens, 8 samples per prompt, 256 new tokens (--new-tokens) at temperature 1, KL weight
0, a Python reward function. dask-rl: every role on GPU 0 (reward on a CPU worker), the
cuda_graph rollout engine, max_staleness 1 (--max-staleness), weight sync "auto" (CUDA IPC here),
micro_batch_size from --micro-batches (default: auto, memory-sized).
TRL: GRPOTrainer with its defaults (HF generate, gradient checkpointing on) and the same
batch: micro-batches of 16, one optimizer step per generated batch.
dask-rl runs first: its driver never opens the GPU, so NVML sees only its workers; TRL
then runs in this process after dask-rl's workers are gone.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampling import Sampler  # noqa: E402
from shapes import (  # noqa: E402
    add_engine_options, engine_options, decode_seconds, end_with_probability, save_qwen2_05b,
    word_prompts,
)

SAMPLES = 8
PROMPT_TOKENS = 128
MICRO_BATCH = 16   # TRL's per-device batch
EOS_ID = 1         # benchmarks/shapes.py's <eos>


def even_words(prompt: str, response: str) -> float:
    """Share of the response's words whose id is even: cheap, deterministic, in [0, 1]."""
    words = response.split()
    return sum(w[-1:] in "02468" for w in words) / max(1, len(words))


class GpuMemory(Sampler):
    """Peak of the summed per-process GPU memory (NVML) on one GPU, sampled every 50 ms; also
    the device's used memory above what it was at the start (`device_peak`), which counts
    what per-process figures may miss (an MPS server holds its clients' contexts)."""

    def __init__(self, index: int = 0):
        import pynvml

        super().__init__(0.05)
        pynvml.nvmlInit()
        self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        self.peak = 0
        self.at_peak: dict[int, int] = {}       # pid -> bytes when the sum peaked
        self.process_peaks: dict[int, int] = {}  # pid -> its own peak
        self._device_start = self._device_used()
        self.device_peak = 0

    def used(self) -> dict[int, int]:
        return {p.pid: p.usedGpuMemory or 0 for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)}

    def _device_used(self) -> int:
        return self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used

    def sample(self) -> None:
        self.device_peak = max(self.device_peak, self._device_used() - self._device_start)
        used = self.used()
        for pid, nbytes in used.items():
            self.process_peaks[pid] = max(nbytes, self.process_peaks.get(pid, 0))
        if sum(used.values()) > self.peak:
            self.peak, self.at_peak = sum(used.values()), used


def steady(seconds: list[float], tokens: list[int], warmup: int) -> dict[str, float]:
    """The median step, and the mean useful tokens a step over it: a step that compiled a
    decode graph for a slot count met late (partial rollouts meet some after the warm-up)
    moves neither."""
    s, t = seconds[warmup:], tokens[warmup:]
    # Also each step's own rate, and their median: long-tailed steps hold up to 2x the tokens
    # of others, and the step time follows them.
    return {"step_seconds": statistics.median(s), "tokens_per_second": statistics.mean(t) / statistics.median(s),
            "step_tokens_per_second": statistics.median(n / x for n, x in zip(t, s)),
            "step_seconds_all": s, "tokens_all": t}


def held_roles(dask_worker) -> dict:
    """On a worker (through client.run, which passes `dask_worker`): role -> its role object,
    for the roles this worker holds."""
    from pipeline.roles.host import role_state

    held = dask_worker.state.total_resources
    return {role: role_state(role, dask_worker) for role in ("rollout", "actor", "reference") if role in held}


def end_responses_with_probability(probability: float, dask_worker=None) -> list[str]:
    """On a worker: hook the rollout engine's and the actor's model (those it holds)."""
    model_of = {"rollout": lambda r: r.engine.model, "actor": lambda r: r.trainer.model, "reference": lambda r: r.model}
    roles = held_roles(dask_worker)
    for role, state in roles.items():
        end_with_probability(model_of[role](state), EOS_ID, probability)
    return list(roles)


def engine_stats(dask_worker=None) -> dict | None:
    """On a worker: the rollout engine's figures of its last request (cuda_graph)."""
    rollout = held_roles(dask_worker).get("rollout")
    return None if rollout is None else dict(getattr(rollout.engine, "last_stats", {}))


def run_dask_rl(model_dir: str, prompts: list[str], args, micro_batch) -> dict[str, float]:
    import torch

    from pipeline import HybridTrainer
    from pipeline.events import role_of
    from pipeline.roles.host import load_times
    from resources import load_resource_config
    from resources.cluster import live_workers

    if args.driver_threads:   # the driver's own torch ops (joining shards, advantages): A/B its thread pool
        torch.set_num_threads(args.driver_threads)
    gpu = {"device_type": "cuda", "device_ids": [0]}
    slots = {"max_batch_size": args.max_slots} if args.max_slots else {}
    rollout = {**gpu, "strategy": "cuda_graph", "cuda_graph_args": {**engine_options(args), **slots}}
    if args.hosted_rollout:   # in the actor's process, on its tensors (a hosted engine never fuses)
        options = {**{k: v for k, v in engine_options(args).items() if k != "fuse_projections"}, **slots}
        rollout = {"hosted_by": "actor", "strategy": "cuda_graph", **({"cuda_graph_args": options} if options else {})}
    cap = {"max_gpu_memory_gib": args.max_gpu_memory_gib} if args.max_gpu_memory_gib else {}
    config = load_resource_config({
        "actor": {**gpu, "strategy": "none", **cap}, "rollout": rollout,
        "reward": {"device_type": "cpu", "workers": 1}, "allow_shared_devices": True, "gpu_sharing": args.gpu_sharing,
        "comm_backend": "nccl", "timeout_seconds": 600})
    seconds, tokens, rows, phases, staleness, step_ends = [], [], [], [], [], []
    with GpuMemory() as memory:
        start, start_wall = time.perf_counter(), time.time()
        trainer = HybridTrainer(model_dir, even_words, config, algorithm="grpo", prompts=prompts,
                                samples_per_prompt=SAMPLES, prompts_per_step=args.prompts_per_step,
                                max_new_tokens=args.new_tokens, kl_coef=0.0, max_staleness=args.max_staleness,
                                dtype="bfloat16",
                                partial_rollouts=args.partial_rollouts, partial_request_groups=args.request_groups,
                                partial_keep_kv=args.partial_keep_kv,
                                gradient_checkpointing=not args.no_gradient_checkpointing,
                                share_prompts=args.share_prompts,
                                micro_batch_size=micro_batch, actor_lr=1e-6, temperature=1.0, show_progress=False,
                                dashboard_address=":0", output_dir=f"{args.work_dir}/dask-rl-mb{micro_batch}")
        started = time.perf_counter() - start
        print(f"dask-rl: cluster and models ready in {started:.1f} s", flush=True)

        driver_collections: list[tuple[float, float]] = []
        stop_watching = watch_full_collections(driver_collections)

        def on_step(record):
            collected = "".join(f", full GC {pause:.2f}" for _, pause in driver_collections)
            driver_collections.clear()
            seconds.append(record.seconds)
            step_ends.append(time.time())
            tokens.append(record.tokens)
            rows.append(record.rows)
            phases.append(record.phases)
            staleness.append(record.staleness)   # partial rollouts trade it for shorter rollouts
            print(f"dask-rl step {record.step}: {record.seconds:.2f} s, {record.tokens} tokens in {rows[-1]} rows, "
                  + ", ".join(f"{k} {v:.2f}" for k, v in record.phases.items()) + collected, flush=True)

        client = trainer.fleet.client
        client.run(watch_worker_collections)
        boot = worker_start_times(client, start_wall)
        print("dask-rl: worker processes up (after their imports) at "
              + ", ".join(f"{name} {t:.1f} s" for name, t in sorted(boot.items())), flush=True)
        loads = {role: times for roles in client.run(load_times).values() for role, times in roles.items()}
        print("dask-rl: roles built (imports, model, engine): "
              + ", ".join(f"{role} from {began - start_wall:.1f} s for {took:.1f} s ({waited:.1f} s waiting "
                          f"for the imports)" for role, (began, took, waited) in sorted(loads.items())), flush=True)
        if args.logit_chunk:
            client.run(set_logit_chunk, args.logit_chunk)
        if args.end_probability:
            print(f"dask-rl: responses end with probability {args.end_probability} a token on "
                  f"{client.run(end_responses_with_probability, args.end_probability)}", flush=True)
        slot_use, engine_seconds = [], []
        try:
            def on_step_with_slots(record):
                on_step(record)
                for stats in client.run(engine_stats).values():
                    if stats and "slot_use" in stats:
                        slot_use.append(stats["slot_use"])
                        engine_seconds.append(decode_seconds(stats["decode_steps_at"], stats["step_ms"]))
                        print(f"  rollout engine, its last request: {engine_seconds[-1]:.2f} s decoding in "
                              f"{stats['slots']} slots, slot use {slot_use[-1]:.2f}", flush=True)

            if args.driver_profile:   # where the driver's own thread spends a step (waits show as lock acquires)
                import cProfile
                import pstats

                with cProfile.Profile() as profile:
                    trainer.train(args.dask_steps, on_step=on_step_with_slots)
                with open(args.driver_profile, "w") as out:
                    stats = pstats.Stats(profile, stream=out)
                    stats.sort_stats("tottime").print_stats(30)
                    stats.sort_stats("cumtime").print_stats("pipeline", 40)
                print(f"dask-rl: the driver's profile is in {args.driver_profile}", flush=True)
            else:
                trainer.train(args.dask_steps, on_step=on_step_with_slots)
            # address -> its roles ("actor+rollout" for a hosted rollout)
            roles = {address: role_of(w["resources"]) for address, w in live_workers(client).items()}
            torch_memory = {roles.get(address, address): stats for address, stats in
                            client.run(torch_gpu_memory).items() if stats}
            steady_from = step_ends[args.warmup - 1] if 0 < args.warmup <= len(step_ends) else 0.0
            for address, collections in client.run(worker_collections).items():
                pauses = [pause for _, pause in collections]
                in_steady = [pause for end, pause in collections if end > steady_from]
                if pauses:
                    print(f"dask-rl {roles.get(address, address)}: {len(pauses)} full garbage collections, "
                          f"{sum(pauses):.2f} s in all, longest {max(pauses):.2f} s; in the steady steps "
                          f"{len(in_steady)}, {sum(in_steady):.2f} s", flush=True)
        finally:
            stop_watching()   # TRL's part runs in this process next
            trainer.close()
    result = steady(seconds, tokens, args.warmup)
    result["update_seconds"] = statistics.median(p.get("update", 0.0) for p in phases[args.warmup:])
    result["rollout_seconds"] = statistics.median(p.get("wait_rollout", 0.0) for p in phases[args.warmup:])
    # Partial rollouts train prompts_per_step groups a step on average, not in every step.
    result["mean_response_tokens"] = sum(tokens[args.warmup:]) / max(1, sum(rows[args.warmup:]))
    result["rows_per_step"] = statistics.mean(rows[args.warmup:] or rows)
    result["slot_use"] = statistics.mean(slot_use[args.warmup:]) if slot_use[args.warmup:] else None
    result["staleness"] = statistics.mean(staleness[args.warmup:] or staleness)   # versions, mean over rows
    # The rollout's own GPU time: on one shared GPU the update runs while the next batch
    # decodes, and the two processes take turns on the GPU.
    result["engine_seconds"] = statistics.median(engine_seconds[args.warmup:]) if engine_seconds[args.warmup:] else None
    pids = {stats["pid"]: role for role, stats in torch_memory.items()}
    for role, stats in sorted(torch_memory.items()):
        print(f"dask-rl {role}: torch peak allocated {stats['max_allocated'] / 2**30:.2f} GiB, peak reserved "
              f"{stats['max_reserved'] / 2**30:.2f} GiB (since the update's last micro-batch reset them); "
              f"allocator retries {stats['alloc_retries']}, device allocations {stats['device_allocs']} and frees "
              f"{stats['device_frees']}, out-of-memory errors {stats['ooms']}, graphs "
              f"compiled {stats['compiled_graphs']} (whole run); "
              f"NVML process peak {memory.process_peaks.get(stats['pid'], 0) / 2**30:.2f} GiB, at the summed peak "
              f"{memory.at_peak.get(stats['pid'], 0) / 2**30:.2f} GiB", flush=True)
    others = {pid: b for pid, b in memory.at_peak.items() if pid not in pids}
    if others:
        print(f"dask-rl: other processes at the summed peak: {sum(others.values()) / 2**30:.2f} GiB", flush=True)
    print(f"dask-rl: device memory used above the start at most {memory.device_peak / 2**30:.2f} GiB", flush=True)
    return {**result, "peak_gib": memory.peak / 2**30, "device_peak_gib": memory.device_peak / 2**30,
            "start_seconds": started,
            "first_step_seconds": seconds[0], "boot_seconds": boot, "load_times": loads,
            "at_peak_gib": {pids.get(pid, str(pid)): b / 2**30 for pid, b in memory.at_peak.items()},
            "torch_memory": torch_memory}


def worker_start_times(client, since: float) -> dict[str, float]:
    """Seconds from `since` (wall clock) to each worker's "Start worker" log line."""
    import datetime

    out = {}
    for address, lines in client.get_worker_logs().items():
        name, stamp = address, None
        for _, line in lines:
            if "Worker name:" in line:
                name = line.rsplit(" ", 1)[-1]
            if "Start worker at" in line:
                stamp = datetime.datetime.strptime(line.split(" - ")[0], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if stamp is not None:
            out[name] = stamp - since
    return out


def set_logit_chunk(tokens: int) -> None:
    from pipeline.roles import forward

    forward.LOGIT_CHUNK_TOKENS = forward.COMPILED_LOGIT_CHUNK_TOKENS = tokens


def torch_gpu_memory() -> dict | None:
    """This worker's torch allocator figures, if it used the GPU. The peaks are since the
    last reset_peak_memory_stats (a trainable role resets them for each micro-batch it
    measures); the retries (an allocation that freed the cache and tried again: a process at
    its cap or the device full), the allocator's calls to the driver for memory and back
    (many: it is freeing and taking memory as it goes), out-of-memory errors and graphs Dynamo
    compiled count the whole run."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    from torch._dynamo.utils import counters   # graphs Dynamo compiled in this process (recompiles show here)

    stats = torch.cuda.memory_stats()
    return {"pid": os.getpid(), "max_allocated": torch.cuda.max_memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved(), "reserved": torch.cuda.memory_reserved(),
            "alloc_retries": stats.get("num_alloc_retries", 0), "ooms": stats.get("num_ooms", 0),
            "device_allocs": stats.get("num_device_alloc", 0), "device_frees": stats.get("num_device_free", 0),
            "compiled_graphs": counters["stats"]["unique_graphs"]}


def watch_full_collections(pauses: list) -> Callable[[], None]:
    """Append (wall-clock end, seconds) of each full (generation-2) garbage collection in this
    process to `pauses`: one walks every object, ~0.2 s with torch and transformers imported,
    so a pause of that size in a step's phase may be one. Returns what stops it."""
    began = [0.0]

    def record(phase, info):
        if phase == "start":
            began[0] = time.perf_counter()
        elif info["generation"] == 2:
            pauses.append((time.time(), time.perf_counter() - began[0]))
    gc.callbacks.append(record)
    return lambda: gc.callbacks.remove(record)


def watch_worker_collections(dask_worker=None) -> None:
    dask_worker.full_collections = []
    watch_full_collections(dask_worker.full_collections)


def worker_collections(dask_worker=None) -> list[tuple[float, float]]:
    return list(getattr(dask_worker, "full_collections", []))


def run_trl(model_dir: str, prompts: list[str], args) -> dict[str, float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pipeline.models import load_tokenizer

    seconds: list[float] = []
    lengths: list[float] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - self.start)
            print(f"TRL step {len(seconds) - 1}: {seconds[-1]:.2f} s", flush=True)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                lengths.append(logs["completions/mean_length"])

    def reward(prompts, completions, **kwargs):
        return [even_words(p, c) for p, c in zip(prompts, completions)]

    batch = args.prompts_per_step * SAMPLES
    config = GRPOConfig(output_dir=args.work_dir + "/trl", per_device_train_batch_size=MICRO_BATCH,
                        gradient_accumulation_steps=batch // MICRO_BATCH, num_generations=SAMPLES,
                        max_completion_length=args.new_tokens, beta=0.0, learning_rate=1e-6, temperature=1.0,
                        max_steps=args.trl_steps, logging_steps=1, report_to="none", save_strategy="no",
                        disable_tqdm=True, seed=0, bf16=True)
    with GpuMemory() as memory:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        if args.end_probability:
            end_with_probability(model, EOS_ID, args.end_probability)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config,
                              train_dataset=Dataset.from_dict({"prompt": prompts}),
                              processing_class=load_tokenizer(model_dir), callbacks=[StepTimer()])
        trainer.train()
    # Useful tokens from TRL's logged mean completion length (a random model never samples
    # EOS by itself: full lengths without --end-probability).
    lengths = lengths or [float(args.new_tokens)] * len(seconds)
    tokens = [batch * length for length in lengths[:len(seconds)]]
    result = steady(seconds[:len(tokens)], tokens, args.warmup_trl)
    return {**result, "peak_gib": memory.peak / 2**30, "device_peak_gib": memory.device_peak / 2**30,
            "mean_response_tokens": statistics.mean(lengths[args.warmup_trl:] or lengths)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--dask-steps", type=int, default=12)
    parser.add_argument("--trl-steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2, help="dask-rl steps left out (compile, pipeline fill)")
    parser.add_argument("--warmup-trl", type=int, default=1)
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--micro-batches", nargs="+", default=["auto"],
                        type=lambda v: v if v == "auto" else int(v),
                        help="dask-rl's train.micro_batch_size (rows, or auto), one run each (TRL keeps 16)")
    parser.add_argument("--new-tokens", type=int, default=256, help="max_new_tokens on both sides")
    parser.add_argument("--end-probability", type=float, default=0.0,
                        help="each token ends the response with this probability (0: full lengths)")
    parser.add_argument("--max-staleness", type=int, default=1, help="dask-rl's train.max_staleness")
    parser.add_argument("--request-groups", type=int, default=2, help="dask-rl's train.partial_request_groups")
    parser.add_argument("--partial-keep-kv", action="store_true",
                        help="dask-rl with train.partial_keep_kv: a row still in its slot decodes on there")
    parser.add_argument("--hosted-rollout", action="store_true",
                        help="dask-rl's rollout hosted by the actor (rollout: {hosted_by: actor}): one process, "
                             "one copy of the weights")
    parser.add_argument("--max-slots", type=int, default=0,
                        help="the rollout engine's cuda_graph_args.max_batch_size (decode slots at most)")
    parser.add_argument("--max-gpu-memory-gib", type=float, default=None, metavar="GIB",
                        help="the actor's max_gpu_memory_gib (with --hosted-rollout: the rollout's too)")
    parser.add_argument("--partial-rollouts", action="store_true",
                        help="dask-rl with train.partial_rollouts: unfinished rows continue in the next step")
    add_engine_options(parser)
    parser.add_argument("--logit-chunk", type=int, default=0,
                        help="response tokens the actor projects onto the vocabulary at once (0: the default)")
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "dask-rl-qwen2-0.5b"))
    parser.add_argument("--work-dir", default=tempfile.mkdtemp(prefix="grpo-vs-trl-"))
    parser.add_argument("--driver-threads", type=int, default=0,
                        help="torch threads of the driver process (0: torch's default). On an H100 host the "
                             "fixed batch-256 steps spent 0.13-0.17 s now and then in the driver's wait_scores "
                             "and advantages phases, whose math takes about 1 ms")
    parser.add_argument("--driver-profile", metavar="PATH",
                        help="profile the driver process's training thread with cProfile and write the "
                             "functions with the most time to PATH")
    parser.add_argument("--worker-alloc-conf", default=None, metavar="CONF",
                        help="PYTORCH_CUDA_ALLOC_CONF for dask-rl's worker processes only (e.g. "
                             "expandable_segments:True); TRL's process starts CUDA after it is unset")
    parser.add_argument("--gpu-sharing", choices=("time_slice", "mps"), default="time_slice",
                        help="dask-rl's gpu_sharing (mps: start an MPS control daemon first)")
    parser.add_argument("--no-gradient-checkpointing", action="store_true",
                        help="dask-rl's actor without gradient checkpointing (TRL keeps it on)")
    parser.add_argument("--share-prompts", action="store_true",
                        help="dask-rl's actor computes a group's prompt once (train.share_prompts: true)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    model_dir = str(save_qwen2_05b(args.model_dir))
    steps = max(args.dask_steps, args.trl_steps) + 1
    prompts = word_prompts(args.prompts_per_step * steps, PROMPT_TOKENS)
    results = {}

    def keep(name: str, result: dict) -> None:
        # Written as each side ends: a run cut short by a time limit keeps what finished.
        results[name] = result
        print(f"{name}: steady step {result['step_seconds']:.2f} s, peak GPU memory (all processes) "
              f"{result['peak_gib']:.1f} GiB (device used above the start {result['device_peak_gib']:.1f} GiB)", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))

    for mb in args.micro_batches:
        if args.worker_alloc_conf:   # the workers inherit the driver's environment; the driver has no CUDA yet
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.worker_alloc_conf
        try:
            keep("dask-rl" if mb == args.micro_batches[0] else f"dask-rl, micro-batch {mb}",
                 run_dask_rl(model_dir, prompts, args, mb))
        finally:
            if args.worker_alloc_conf:
                del os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    if not args.skip_trl:
        keep("trl", run_trl(model_dir, prompts, args))
    batch = args.prompts_per_step * SAMPLES
    tail = f", end probability {args.end_probability} a token" if args.end_probability else ""
    print(f"\nGRPO, {args.prompts_per_step} prompts x {SAMPLES} samples x up to {args.new_tokens} new tokens "
          f"(batch {batch}){tail}, prompt {PROMPT_TOKENS} tokens, KL 0, micro-batch {args.micro_batches[0]}:")
    for name, r in results.items():
        extra = (f"  rows a step {r['rows_per_step']:.0f}  waiting for the rollout {r['rollout_seconds']:.2f} s  "
                 f"update {r['update_seconds']:.2f} s  slot use "
                 f"{r['slot_use'] or 0:.2f}  rollout engine {r['engine_seconds'] or 0:.2f} s  staleness "
                 f"{r['staleness']:.2f}" if "update_seconds" in r else "")
        print(f"  {name:<8} steady step {r['step_seconds']:6.2f} s  {r['tokens_per_second']:>8,.0f} useful tokens/s "
              f"({r['step_tokens_per_second']:,.0f} the median step's)  "
              f"mean response {r['mean_response_tokens']:6.1f}  peak GPU memory (all processes) "
              f"{r['peak_gib']:5.1f} GiB{extra}")
    for name, d in results.items():
        if name == "trl":
            continue
        print(f"  {name}: cluster start (workers + models) {d['start_seconds']:.1f} s; first step "
              f"(compiles the decode graph and the update) {d['first_step_seconds']:.1f} s")
        if "trl" in results:
            t = results["trl"]
            # Steps of long-tailed work hold different lengths on the two sides: the useful
            # tokens a second compare them per token.
            # TRL's steps can drift within its run (7.6 to 11.1 s on one H200): the fastest
            # steady steps of each side compared too, the ratio no drift can inflate.
            print(f"  {name}: ratio: step {t['step_seconds'] / d['step_seconds']:.2f}x faster "
                  f"({min(t['step_seconds_all']) / min(d['step_seconds_all']):.2f}x fastest against fastest), "
                  f"{d['tokens_per_second'] / t['tokens_per_second']:.2f}x the useful tokens/s, "
                  f"memory {d['peak_gib'] / t['peak_gib']:.2f}x TRL's")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
