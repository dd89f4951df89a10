"""A rollout role's engine options in the resource file: `vllm_args` (vLLM's engine
arguments, checked against the engine's own fields and ranges) and `cuda_graph_args` (the
cuda_graph engine's options and its decode slots). Pure. resources.validate's _Parser calls
these for every rollout section (local, job-queue or hosted), passing itself for the errors
(its .error makes the one ResourceConfigError naming the key, the value and the fix)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from resources import vllm_keys
from resources.config import CUDA_GRAPH_ARGS, CUDA_GRAPH_MAX_BATCH, did_you_mean
from resources.file_values import MISSING, is_int, is_positive_number, show
from resources.vllm_keys import SET_BY_DASK_RL

__all__ = ["MAX_ENGINE_COUNT", "parse_cuda_graph_args", "parse_vllm_args"]

# vLLM's counts (max_model_len, max_num_seqs, ...) reach its kernels as 32-bit integers.
MAX_ENGINE_COUNT = 2**31 - 1
# vLLM engine arguments that are a fraction or a count: a bad value would otherwise fail only
# once the engine starts on a worker, after every other role has loaded its model.
_ENGINE_FRACTIONS = {"gpu_memory_utilization": "e.g. 0.85"}
_ENGINE_COUNTS = {"max_model_len": "e.g. 4096", "max_num_seqs": "e.g. 256", "max_num_batched_tokens": "e.g. 8192"}


def _bad_engine_number(key: str, value: Any) -> tuple[str, str] | None:
    """(problem, fix) for a vllm_args value out of its range, else None."""
    if key in _ENGINE_FRACTIONS and not (is_positive_number(value) and value <= 1):
        return "expected a fraction of the GPU's memory in (0, 1]", f"use {_ENGINE_FRACTIONS[key]}"
    if key in _ENGINE_COUNTS and not (is_int(value) and 1 <= value <= MAX_ENGINE_COUNT):
        return (f"expected an integer from 1 to {MAX_ENGINE_COUNT} (vLLM takes it as a 32-bit integer)",
                f"use {_ENGINE_COUNTS[key]}")
    if isinstance(value, float) and not math.isfinite(value):
        return "not a finite number", "use a finite number, or remove the key to take vLLM's default"
    return None


def parse_vllm_args(parser: Any, role: str, args: Any, strategy: str) -> tuple[tuple[str, object], ...]:
    """A rollout section's `vllm_args` (MISSING: none given) as the role's engine arguments."""
    path = f"{role}.vllm_args"
    if args is MISSING:
        return ()
    if strategy != "vllm":
        raise parser.error(path, args, f"vllm_args only apply to strategy vllm, not {strategy!r}",
                           "remove vllm_args, or set strategy: vllm")
    if not isinstance(args, Mapping) or not all(isinstance(k, str) for k in args):
        raise parser.error(path, args, "not a mapping of vLLM engine arguments",
                           "write e.g. vllm_args: {gpu_memory_utilization: 0.85}")
    for key in args:  # caught here, not as a TypeError once the engine starts on a worker
        if key in SET_BY_DASK_RL:
            raise parser.error(f"{path}.{key}", args[key], "set by dask-rl's rollout engine",
                               SET_BY_DASK_RL[key])
        if not vllm_keys.accepts(key):
            hint = did_you_mean(key, sorted(vllm_keys.ENGINE_KEYS))
            raise parser.error(f"{path}.{key}", MISSING, f"not an argument vLLM's engine accepts{hint}",
                               "use a field of vllm.engine.arg_utils.EngineArgs (vllm "
                               f"{vllm_keys.VLLM_VERSION}: resources/vllm_keys.py lists them), e.g. "
                               "max_model_len, gpu_memory_utilization, enforce_eager")
        problem = _bad_engine_number(key, args[key])
        if problem:
            raise parser.error(f"{path}.{key}", args[key], *problem)
    # Each rollout worker owns exactly one GPU, so a tensor-parallel engine cannot start.
    if args.get("tensor_parallel_size", 1) != 1:
        raise parser.error(f"{path}.tensor_parallel_size", args["tensor_parallel_size"],
                           "each rollout worker gets one GPU",
                           "use 1, and list more device_ids to run more engines")
    return tuple(args.items())


def parse_cuda_graph_args(parser: Any, role: str, args: Any, strategy: str) -> tuple[tuple[str, object], ...]:
    """A rollout section's `cuda_graph_args` (MISSING: none given) as the engine's options."""
    path, example = f"{role}.cuda_graph_args", "write e.g. cuda_graph_args: {decode_attention: sdpa}"
    if args is MISSING:
        return ()
    if strategy != "cuda_graph":
        raise parser.error(path, args, f"cuda_graph_args only apply to strategy cuda_graph, not {strategy!r}",
                           "remove cuda_graph_args, or set strategy: cuda_graph")
    if not isinstance(args, Mapping):
        raise parser.error(path, args, "not a mapping of the cuda_graph engine's options", example)
    slots_key, slots_default, slots_most = CUDA_GRAPH_MAX_BATCH
    options = [*CUDA_GRAPH_ARGS, slots_key]
    for key, value in args.items():
        if key == slots_key:
            if not (is_int(value) and 1 <= value <= slots_most):
                raise parser.error(f"{path}.{key}", value,
                                   f"expected a number of decode slots from 1 to {slots_most}",
                                   f"use e.g. {key}: 128 (the default is {slots_default})")
            continue
        if key not in CUDA_GRAPH_ARGS:
            raise parser.error(f"{path}.{key}", MISSING,
                               f"not an option of the cuda_graph engine{did_you_mean(key, options)}",
                               f"use {' or '.join(options)}")
        default, other = (show(v) for v in CUDA_GRAPH_ARGS[key])
        if type(value) is not type(CUDA_GRAPH_ARGS[key][0]) or value not in CUDA_GRAPH_ARGS[key]:
            raise parser.error(f"{path}.{key}", value, f"not {default} or {other}",
                               f"use {key}: {default} (the default) or {other}")
    return tuple(args.items())
