"""Seconds per weight sync, actor -> rollout, for each transport of pipeline/weights.py.

One JSON line per transport. The state dict is Qwen2-0.5B-shaped (494 M parameters, bf16,
lm_head tied to the embedding: ~0.99 GB) with random values; `--size small` is a 2-layer
model of the same width for a quick check.

    PYTHONPATH=$PWD python benchmarks/weight_sync.py --size small --repeats 3
    PYTHONPATH=$PWD python benchmarks/weight_sync.py --device cuda --repeats 5

Transports: shm (safetensors under /dev/shm, publish + load in one process), dask (bytes
from one LocalCluster worker process to another over TCP, the fallback), gloo (a
BroadcastChannel between two processes), and with CUDA: cuda_ipc (publish here, open and
clone in a child process on the same GPU) and nccl (BroadcastChannel, needs 2 GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from pipeline import weights


def build_state(size: str, device: str = "cpu", fill: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """A Qwen2-0.5B-shaped bf16 state dict (ties kept), random when `fill`, else uninitialised or meta."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24 if size == "full" else 2, num_attention_heads=14,
                         num_key_value_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        params = Qwen2ForCausalLM(config).to(torch.bfloat16).state_dict(keep_vars=True)   # tied: one object
    detached = {id(t): t.detach() for t in params.values()}
    meta = {name: detached[id(t)] for name, t in params.items()}
    if device == "meta":
        return meta
    generator = torch.Generator(device).manual_seed(seed)
    made: dict[int, torch.Tensor] = {}
    for t in meta.values():
        if id(t) not in made:
            real = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = real.normal_(generator=generator) if fill else real
    return {name: made[id(t)] for name, t in meta.items()}


def nbytes(state) -> int:
    seen = {id(t): t.numel() * t.element_size() for t in state.values()}
    return sum(seen.values())


def report(transport: str, args, times: list[float], size_bytes: int, **extra) -> None:
    seconds = statistics.median(times)
    print(json.dumps({"transport": transport, "size": args.size, "device": args.device, "bytes": size_bytes,
                      "seconds_per_sync": round(seconds, 4), "gb_per_s": round(size_bytes / seconds / 1e9, 2),
                      "repeats": len(times), "all_seconds": [round(t, 4) for t in times], **extra}), flush=True)


def skip(transport: str, args, reason: str) -> None:
    print(json.dumps({"transport": transport, "size": args.size, "device": args.device, "skipped": reason}),
          flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- shm ---------------------------------------------------------------------------------------

def bench_shm(args, state) -> None:
    directory = weights.default_snapshot_dir(f"bench-{os.getpid()}")
    times, publish_s, receive_s = [], [], []
    try:
        for version in range(1, args.repeats + 1):
            start = time.perf_counter()
            handle = weights.publish(state, version, directory, keep=1)
            middle = time.perf_counter()
            got = weights.receive(handle)
            end = time.perf_counter()
            times.append(end - start), publish_s.append(middle - start), receive_s.append(end - middle)
        assert torch.equal(got["model.embed_tokens.weight"].view(torch.int16),
                           state["model.embed_tokens.weight"].cpu().view(torch.int16))
    finally:
        for path in directory.glob("*"):
            path.unlink()
        directory.rmdir()
    report("shm", args, times, nbytes(state), publish_seconds=round(statistics.median(publish_s), 4),
           receive_seconds=round(statistics.median(receive_s), 4), where=str(directory.parent))


# -- dask TCP ----------------------------------------------------------------------------------

def _dask_make(size: str) -> dict:
    """Worker A: the state as raw bytes (bf16 has no numpy dtype), ties sent once."""
    state = build_state(size)
    seen, out = set(), {}
    for name, t in state.items():
        if id(t) not in seen:
            seen.add(id(t))
            out[name] = (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy())
    return out


def _dask_same(data: dict) -> dict:
    return data   # a new key for the same bytes on worker A, so every repeat transfers anew


def _dask_consume(data: dict) -> int:
    """Worker B: rebuild bf16 tensors over the received bytes."""
    state = {name: torch.from_numpy(array).view(getattr(torch, dtype)).reshape(shape)
             for name, (dtype, shape, array) in data.items()}
    return sum(t.numel() * t.element_size() for t in state.values())


def bench_dask(args) -> None:
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                      memory_limit=0) as cluster, Client(cluster) as client:
        client.wait_for_workers(2, timeout=120)
        a, b = sorted(client.scheduler_info()["workers"])
        base = client.submit(_dask_make, args.size, workers=[a], pure=False)
        base.result()
        times, size = [], 0
        for _ in range(args.repeats):
            here = client.submit(_dask_same, base, workers=[a], pure=False)
            here.result()
            start = time.perf_counter()
            size = client.submit(_dask_consume, here, workers=[b], pure=False).result()
            times.append(time.perf_counter() - start)
            del here
    report("dask", args, times, size, note="worker to worker TCP, task overhead included")


# -- broadcast channel (gloo, nccl) in child processes -------------------------------------------

def channel_rank(args) -> None:
    """Child: one rank of a BroadcastChannel; the receiver prints its timings."""
    device = "cuda" if args.backend == "nccl" else "cpu"
    channel = weights.BroadcastChannel(args.init, args.rank, 2, args.backend, timeout_seconds=300)
    layout = weights.tensor_layout(build_state(args.size, "meta"))
    state = build_state(args.size, device) if args.rank == 0 else None
    times = []
    for version in range(args.repeats + 1):   # version 0 warms up (connections, allocator)
        barrier = torch.zeros(1, device=channel.device)
        channel._broadcast(barrier).wait()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        if args.rank == 0:
            channel.send(state, version)
        else:
            got = channel.receive(layout, device, version)
            if device == "cuda":
                torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if args.rank != 0:
        print(json.dumps({"times": times[1:], "bytes": nbytes(got)}), flush=True)
    channel.close()


def bench_channel(args, backend: str) -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    for rank in (0, 1):
        env = dict(os.environ)
        if backend == "nccl":
            env["CUDA_VISIBLE_DEVICES"] = str(rank)
        cmd = [sys.executable, __file__, "--size", args.size, "--repeats", str(args.repeats), "--_rank", str(rank),
               "--_init", init, "--_backend", backend]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=900) for p in procs]
    if any(p.returncode for p in procs):
        skip(backend, args, "failed: " + " | ".join(err.strip()[-800:] for _, err in outs))
        return
    result = json.loads(outs[1][0].strip().splitlines()[-1])
    report(backend, args, result["times"], result["bytes"], note="two processes, receiver's time")


# -- cuda_ipc ----------------------------------------------------------------------------------

def ipc_child() -> None:
    """Child: open each published version and clone it; prints the timings."""
    handles = pickle.loads(sys.stdin.buffer.read())
    times = []
    for handle in handles:
        torch.cuda.synchronize()
        start = time.perf_counter()
        got = weights.receive(handle)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    print(json.dumps({"times": times[1:], "bytes": nbytes(got)}), flush=True)


def bench_cuda_ipc(args, state) -> None:
    handles, publish_s = [], []
    for version in range(args.repeats + 1):   # version 0 warms up
        torch.cuda.synchronize()
        start = time.perf_counter()
        handles.append(weights.publish(state, version, "", keep=args.repeats + 1, transport="cuda_ipc"))
        publish_s.append(time.perf_counter() - start)
    child = subprocess.run([sys.executable, __file__, "--_ipc-child"], input=pickle.dumps(handles),
                           capture_output=True, timeout=900)
    if child.returncode:
        skip("cuda_ipc", args, "failed: " + child.stderr.decode().strip()[-800:])
        return
    result = json.loads(child.stdout.decode().strip().splitlines()[-1])
    times = [p + r for p, r in zip(publish_s[1:], result["times"])]
    report("cuda_ipc", args, times, result["bytes"], publish_seconds=round(statistics.median(publish_s[1:]), 4),
           receive_seconds=round(statistics.median(result["times"]), 4),
           handle_bytes=len(pickle.dumps(handles[-1])), note="publish (copy) + open and clone in another process")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=("full", "small"), default="full")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--only", nargs="*", help="transports to run (default: all)")
    parser.add_argument("--_rank", type=int, dest="rank", help=argparse.SUPPRESS)
    parser.add_argument("--_init", dest="init", help=argparse.SUPPRESS)
    parser.add_argument("--_backend", dest="backend", help=argparse.SUPPRESS)
    parser.add_argument("--_ipc-child", action="store_true", dest="ipc_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ipc_child:
        return ipc_child()
    if args.rank is not None:
        return channel_rank(args)

    wanted = set(args.only or ("shm", "dask", "gloo", "cuda_ipc", "nccl"))
    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        skip("all", args, "--device cuda but no CUDA here")
        return
    state = build_state(args.size, args.device)
    if "shm" in wanted:
        bench_shm(args, state)
    if "dask" in wanted:
        try:
            bench_dask(args)
        except ImportError as error:
            skip("dask", args, f"distributed not installed: {error}")
    if "gloo" in wanted:
        bench_channel(args, "gloo")
    if "cuda_ipc" in wanted:
        if args.device != "cuda":
            skip("cuda_ipc", args, "needs --device cuda" + ("" if cuda else " and CUDA"))
        else:
            bench_cuda_ipc(args, state)
    if "nccl" in wanted:
        if not cuda or torch.cuda.device_count() < 2:
            skip("nccl", args, f"needs 2 GPUs, this machine has {torch.cuda.device_count() if cuda else 0}")
        else:
            bench_channel(args, "nccl")


if __name__ == "__main__":
    main()
