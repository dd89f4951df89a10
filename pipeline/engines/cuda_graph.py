"""Generation on a CUDA GPU without vLLM: a decode loop over continuously refilled slots
whose steps replay as CUDA graphs.

Why not `model.generate`: it keeps (or would have to keep) every step's full-vocabulary
logits to return logprobs, and even with transformers' compiled static cache it spends most
of a decode step launching kernels from Python. Here:

- each of S decode slots holds one sequence, and a slot whose sequence ended takes the next
  waiting one (continuous batching, continuous.py): on long-tailed response lengths the
  decode steps serve live rows instead of waiting for a static batch's longest row; once
  none wait, the live rows move into fewer slots, so the tail decodes at a smaller batch;
- the KV cache is one ring per slot batch (slots.py), read as stored: grouped-query heads
  are packed onto the cache's KV heads instead of copying it once per query head
  (gqa_decode.py); on a GPU a Triton kernel reads only the blocks of the ring a slot's window
  covers (decode_kernel.py; `decode_attention`);
- each decode step (the model's forward for one token, temperature / min-p / top-k /
  top-p sampling and the sampled token's unfiltered logprob) is one function compiled by
  torch.compile in "reduce-overhead" mode, which captures it as a CUDA graph and replays it;
- only the sampled token and its logprob leave the step (S values each), never the logits;
- sequences stop at any of the request's stop ids (a device tensor: no host sync) and,
  checked on the host every continuous.EOS_CHECK_EVERY steps, at its stop strings; the rollout is cut
  exactly at each row's stop;
- prompt lengths are rounded up to a multiple of `prompt_bucket` and slots to a power of
  two, so a run compiles a bounded number of graphs (one per slot count and ring length);
- the slots are sized from the GPU's free memory before every request, so memory another
  process takes mid-run shrinks the next request's slots (and its KV cache) instead of
  failing it;
- new policy weights are copied into the existing parameter tensors, so the captured
  graphs keep pointing at valid memory and serve the new version without a recompile.

On a CPU (tests) the same loop runs eagerly.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from pipeline.engines import decode_kernel
from pipeline.engines.budget import (
    HEADROOM, fitting_slots, free_for_generation, held_bytes, power_of_two_below, prefill_bytes,
)
from pipeline.engines.continuous import FEWEST_CAPTURED_SLOTS, PREFILL_PASS_TOKENS, SlotRun, bucket_batch
from pipeline.engines.fused_projections import fuse_projections as fuse_layer_projections
from pipeline.engines.held_rows import HeldRows
from pipeline.engines.hf import (
    PartialRows, assemble_rollout, left_pad, repeat_prompts, require_decode, stop_ids_of,
)
from pipeline.engines.prefill import bucket_length
from pipeline.engines.sampling import sample_tokens
from pipeline.engines.slots import SlotCache, slot_cache_bytes, use_slot_attention
from pipeline.records import GenerationRequest, Rollout
from resources.allocator import (
    KERNEL_FAILED, LOW_FREE_MEMORY, OUT_OF_MEMORY, MicroBatchAllocator, first_line, release_cached,
    report,
)
from resources.config import CUDA_GRAPH_ARGS

logger = logging.getLogger("dask_rl")


class CudaGraphEngine:
    """Samples with a CUDA-graph decode loop over continuously refilled slots; the same
    interface as HFEngine.

    Args:
        model: a transformers causal LM already on its device (bf16 on GPUs). The engine
            owns it from here: its attention switches to slots.slot_attention (SDPA maths;
            one read of the KV cache per decode step).
        max_batch_size: decode slots at most. A request of more sequences runs through
            the slots: a slot whose sequence ended takes the next waiting one. Before every
            request the slots are lowered to what the GPU's free memory holds (KV cache at
            full length plus sampling workspace), and an out-of-memory error halves them;
            both are reported as degradations.
        prompt_bucket: prompts are left-padded to a multiple of this many tokens.
        compile: capture decode steps as CUDA graphs (default: on CUDA devices).
        fewest_slots: the tail of a request moves into fewer slots, down to this many
            (default: continuous.FEWEST_CAPTURED_SLOTS when compiling, where each slot count
            is a graph to compile, else 8).
        compile_prefill: prefill passes through torch.compile too (dynamic shapes, no
            graphs; default off: measured at full length only, 0.060 against 0.097 s for a
            32 k-token pass on an H100).
        decode_attention: "kernel", decode_kernel.py's Triton kernel on GPUs where it applies
            (else SDPA); "sdpa", SDPA always (a way back should the kernel fail on a GPU).
        fuse_projections: each layer's query/key/value and gate/up projections as one
            product each (fused_projections.py; the model is changed in place, its weights'
            names kept).
        decode: token ids -> text (the tokenizer's), for requests with stop strings.
        check_every: decode steps between two looks at the device (default: a GPU's
            continuous.EOS_CHECK_EVERY, every step on a CPU, where looking costs nothing).
        reserve: bytes another role in this process will allocate beyond what it holds now
            (a hosted rollout's host: its next update), left out of the memory the slots
            and KV caches are planned in; read before every request.
    Sampling filters (top-k / top-p / min-p) come with each request. `last_stats` holds the
    last request's decode steps (in all and at each slot count), tokens, slot use and
    milliseconds a decode step at each slot count.
    """

    def __init__(self, model, *, pad_id: int, eos_id: int, device: str, max_batch_size: int = 256,
                 prompt_bucket: int = 64, compile: bool | None = None, decode: Callable | None = None,
                 check_every: int | None = None, fewest_slots: int | None = None,
                 compile_prefill: bool = False, decode_attention: str = "kernel", fuse_projections: bool = True,
                 reserve: Callable[[], int] | None = None):
        self.model = model.eval()
        self.reserve = reserve   # bytes a role sharing this process needs beyond what it holds
        use_slot_attention(model)
        if decode_attention not in CUDA_GRAPH_ARGS["decode_attention"]:
            raise ValueError(f"decode_attention: {decode_attention!r} is not one of "
                             f"{', '.join(CUDA_GRAPH_ARGS['decode_attention'])}")
        self.attention_kernel = decode_attention == "kernel"
        if fuse_projections:
            fuse_layer_projections(model)
        self.pad_id, self.eos_id, self.device, self.decode = pad_id, eos_id, device, decode
        self.max_batch_size = bucket_batch(max_batch_size)
        self.prompt_bucket = prompt_bucket
        self.compiled = torch.device(device).type == "cuda" if compile is None else compile
        self.fewest_slots = bucket_batch(fewest_slots or (FEWEST_CAPTURED_SLOTS if self.compiled else 1))
        self.check_every = check_every   # None: every continuous.EOS_CHECK_EVERY steps on CUDA, every step on CPU
        self._caches: dict[tuple[int, int], SlotCache] = {}   # (slots, length) -> its cache
        self.batch = self.max_batch_size     # decode slots of the current request
        self._planned: int | None = None    # the last plan, so a change is reported once
        self._held: HeldRows | None = None  # the rows the last partial request left in the slots
        self.last_stats: dict = {}
        if self.compiled:
            # One graph per (slots, ring length) pair and temperature: shrinking slots and
            # evaluation requests add pairs, more than Dynamo's default of 8 a function.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # Dynamo specialises on the Python floats/ints it sees (temperature, filters) and on
        # the cache object: one graph per cache and temperature.
        self._decode = (torch.compile(self._decode_step, mode="reduce-overhead", dynamic=False)
                        if self.compiled else self._decode_step)
        # Prefill passes run the model eagerly unless compiled too (dynamic shapes, no graphs:
        # one compile serves every rows x width).
        self.prefill_model = torch.compile(self.model, dynamic=True) if compile_prefill else self.model

    @torch.no_grad()
    def generate(self, request: GenerationRequest, policy_version: int) -> Rollout:
        require_decode(self.decode, request.stop_strings)
        prompts, groups = repeat_prompts(request)
        carried = request.carried   # a partial rollout's unfinished groups go first
        prompts, groups = [row.prompt_ids for row in carried] + prompts, [row.group_id for row in carried] + groups
        width = bucket_length(max(len(p) for p in prompts), self.prompt_bucket)
        _require_full_attention(self.model.config, width + request.max_new_tokens)
        # Slots from the memory free now, re-read for every request; an out-of-memory error
        # halves them and runs the request again.
        self.batch = self._plan(len(prompts), width, width + request.max_new_tokens)
        while True:
            torch.manual_seed(request.seed)
            failure = kernel_failure = None
            try:
                responses, logprobs, partial = self._generate_in_slots(prompts, groups, width, request,
                                                                       policy_version)
                break
            except torch.OutOfMemoryError as error:
                failure = first_line(error)
            except Exception as error:   # the Triton decode kernel failing to compile or run on this GPU
                if not (self.attention_kernel and decode_kernel.failed_in(error)):
                    raise
                kernel_failure = first_line(error)
            # Outside the except block: its traceback held the failed attempt's tensors.
            if kernel_failure is not None:
                self._decode_with_sdpa(kernel_failure)
                continue
            failed_at = self.batch
            self._shrink(MicroBatchAllocator.backoff(failed_at))
            release_cached(self.device)
            report("generation", failed_at, self.batch, "sequences per batch", OUT_OF_MEMORY, failure)
        ids, mask = left_pad(prompts, self.pad_id, width=width)
        return assemble_rollout(ids, mask, responses, logprobs, groups, stop_ids_of(request, self.eos_id),
                                policy_version, pad_id=self.pad_id, decode=self.decode,
                                stop_strings=request.stop_strings, partial=partial)

    def _plan(self, sequences: int, prompt_length: int, length: int) -> int:
        """Decode slots: a power of two, at most max_batch_size, that fits the memory free
        now with this engine's own KV caches counted as free (they make room)."""
        dtype = next(self.model.parameters()).dtype
        per_sequence = held_bytes(self.model.config, dtype, length)
        free = free_for_generation(self.device, self.reserve)
        wanted = min(self.max_batch_size, bucket_batch(sequences))
        if free is None:
            return wanted
        held = sum(cache.nbytes for cache in self._caches.values())
        batch = power_of_two_below(fitting_slots(free + held, per_sequence,
                                                 prefill_bytes(self.model.config, dtype, prompt_length),
                                                 max(1, PREFILL_PASS_TOKENS // prompt_length), wanted))
        if batch < wanted and batch != self._planned:
            kept = f" beside {self.reserve() / 2**30:.2f} GiB kept for the update" if self.reserve else ""
            report("generation", wanted, batch, "sequences per batch", LOW_FREE_MEMORY,
                   f"{(free + held) / 2**30:.2f} GiB free{kept} for {per_sequence / 2**20:.1f} MiB a sequence "
                   f"of {length} tokens")
        elif batch != self._planned and self._planned is not None:
            logger.info("dask-rl: cuda_graph engine: %d sequences per batch again (%.2f GiB free)", batch,
                        (free + held) / 2**30)
        self._planned = batch
        return batch

    def _decode_with_sdpa(self, failure: str) -> None:
        """The Triton decode kernel failed here: SDPA from now on (the request runs again;
        Dynamo sees the caches' switch change and traces their decode steps anew)."""
        self.attention_kernel = False
        for cache in self._caches.values():
            cache.attention_kernel = False
        report("decode attention", 1, 0, "Triton kernels a layer", KERNEL_FAILED,
               f"SDPA from now on (rollout.cuda_graph_args: {{decode_attention: sdpa}} starts there): {failure}")

    def _shrink(self, batch: int) -> None:
        """After an out-of-memory error: drop every KV cache (they were sized for more
        slots), decode with `batch` slots from now on."""
        self.batch = batch
        self._caches.clear()

    def _generate_in_slots(self, prompts: list[list[int]], groups: list[int], width: int,
                           request: GenerationRequest, policy_version: int
                           ) -> tuple[torch.Tensor, torch.Tensor, PartialRows | None]:
        """Every prompt's response through the slots -> (N, T) responses (pad after a stop
        id; a stop string may be overshot by up to continuous.EOS_CHECK_EVERY tokens, cut by
        assemble_rollout) and their logprobs, on the CPU; for a partial rollout, its rows."""
        # The held rows are this request's to continue or lose: any request writes the slots.
        held, self._held = self._held, None
        run = SlotRun(self, prompts, width, request, min(self.batch, bucket_batch(len(prompts))), groups, held)
        tokens, logprobs = run.run()
        self.last_stats, self._held = run.stats, run.held
        if not request.partial:
            return tokens, logprobs, None
        born = torch.where(run.started, policy_version, -1)   # a row's first token is of this version...
        for i, row in enumerate(request.carried):              # ...unless it came with tokens
            if row.born is not None:
                born[i] = row.born
        return tokens, logprobs, PartialRows(run.unfinished, run.lengths[:run.sink].cpu(), born)

    def _decode_step(self, token, position_ids, column, mask, cache, temperature: float, top_k: int,
                     top_p: float, min_p: float):
        logits = self.model(input_ids=token, attention_mask=mask, position_ids=position_ids, use_cache=False,
                            slot_cache=cache, slot_columns=column).logits[:, -1]
        return sample_tokens(logits, temperature, top_k, top_p, min_p)

    def _cache(self, slots: int, length: int) -> SlotCache:
        """The slot cache for this pair; allocated on first use, then reused. Fewer slots
        over a ring already allocated live within it; a larger cache replaces the ring's
        others. When the memory free now cannot hold a new one, the caches of other shapes
        go first."""
        key = (slots, length)
        if key in self._caches:
            return self._caches[key]
        dtype = next(self.model.parameters()).dtype
        ring = [cache for (_, ring_length), cache in self._caches.items() if ring_length == length]
        largest = max(ring, key=lambda cache: cache.slots, default=None)
        if largest is not None and largest.slots > slots:
            self._caches[key] = SlotCache(self.model.config, slots, length, dtype, self.device, within=largest,
                                          attention_kernel=self.attention_kernel)
            return self._caches[key]
        for cache in ring:   # smaller ones, each its own allocation or within one: all go
            del self._caches[(cache.slots, length)]
        need = slot_cache_bytes(self.model.config, dtype, slots, length)
        free = free_for_generation(self.device, self.reserve)
        if free is not None and free < need / HEADROOM and self._caches:
            logger.info("dask-rl: cuda_graph engine: dropping %d KV caches to make room", len(self._caches))
            self._caches.clear()
            release_cached(self.device)
        logger.info("dask-rl: cuda_graph engine: new KV cache of %d slots x %d tokens", slots, length)
        self._caches[key] = SlotCache(self.model.config, slots, length, dtype, self.device,
                                      attention_kernel=self.attention_kernel)
        return self._caches[key]

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy new weights into the existing parameters (captured graphs stay valid)."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        missing = [name for name in params if name not in state]
        tied = {name for name in missing if _is_tied_alias(self.model, name)}
        if set(missing) - tied:
            raise KeyError(f"new weights lack {sorted(set(missing) - tied)[:5]}: publish the full state")
        with torch.no_grad():
            for name, param in params.items():
                if name in state:
                    param.copy_(state[name], non_blocking=True)
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)


def _require_full_attention(config, length: int) -> None:
    """The slots attend over a whole window (prompt and response); a model whose layers
    attend to a sliding window of fewer tokens would compute something else."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)   # what the model's forward goes by, where it has them
    slides = "sliding_attention" in layer_types if layer_types is not None else getattr(config, "use_sliding_window",
                                                                                            True)
    if not window or not slides or window >= length:
        return
    raise ValueError(f"the cuda_graph rollout engine attends to whole sequences, and this model's layers attend "
                     f"to the last {window} tokens only, fewer than a sequence here ({length}: prompt width and "
                     f"max_new_tokens). Fix: set the rollout role's strategy to hf or vllm, or keep prompts and "
                     f"max_new_tokens within {window} tokens")


def _is_tied_alias(model, name: str) -> bool:
    """True for an output embedding that shares the input embedding's tensor."""
    output = model.get_output_embeddings()
    return (output is not None and name.endswith("weight") and output.weight is model.get_input_embeddings().weight
            and name.startswith(next(n for n, m in model.named_modules() if m is output)))
