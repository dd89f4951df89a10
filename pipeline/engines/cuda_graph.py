"""Generation on a CUDA GPU without vLLM: a decode loop over a preallocated KV cache whose
steps replay as CUDA graphs.

Why not `model.generate`: it keeps (or would have to keep) every step's full-vocabulary
logits to return logprobs, and even with transformers' compiled static cache it spends most
of a decode step launching kernels from Python. Here:

- the KV cache is a transformers StaticCache allocated once per (batch, length) bucket,
  and a decode step reads it as stored: grouped-query heads are packed onto the cache's
  KV heads instead of copying it once per query head (gqa_decode.py);
- each decode step (the model's forward for one token, temperature / min-p / top-k /
  top-p sampling and the sampled token's unfiltered logprob) is one function compiled by
  torch.compile in "reduce-overhead" mode, which captures it as a CUDA graph and replays it;
- only the sampled token and its logprob leave the step (B values each), never the logits;
- sequences stop at any of the request's stop ids (a device tensor: no host sync) and,
  checked on the host every EOS_CHECK_EVERY steps, at its stop strings; the loop exits
  once every sequence has ended, and the rollout is cut exactly at each row's stop;
- prompt lengths are rounded up to a multiple of `prompt_bucket` and batches to a power of
  two, so a run compiles a bounded number of graphs (one per bucket pair seen);
- the batch is sized from the GPU's free memory before every request, so memory another
  process takes mid-run shrinks the next batch (and its KV cache) instead of failing it;
- new policy weights are copied into the existing parameter tensors, so the captured
  graphs keep pointing at valid memory and serve the new version without a recompile.

On a CPU (tests) the same loop runs eagerly.
"""

from __future__ import annotations

import inspect
import logging
import math
from typing import Callable

import torch

from pipeline.engines.budget import HEADROOM, fitting_rows, kv_bytes_per_token, power_of_two_below, sequence_bytes
from pipeline.engines.gqa_decode import use_packed_gqa
from pipeline.engines.hf import assemble_rollout, left_pad, repeat_prompts, require_decode, stop_ids_of
from pipeline.engines.sampling import filter_logits, filters_active, stop_string_end
from pipeline.records import GenerationRequest, Rollout
from resources.allocator import LOW_FREE_MEMORY, free_bytes, in_chunks, release_cached, report

logger = logging.getLogger("dask_rl")

# How often (in decode steps) the loop asks the GPU whether every sequence has ended. Each
# ask is a device-to-host sync; 8 steps of overshoot cost less than a sync every step.
EOS_CHECK_EVERY = 8


def sample_tokens(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) logits -> (B,) sampled tokens and (B,) their float32 logprobs.

    Tokens are sampled from log_softmax(logits / temperature) after the top-k / top-p /
    min-p filters (engines/sampling.py). The logprob returned is the unfiltered
    log_softmax(logits / temperature) of the sampled token: what the actor's loss
    evaluates, so on-policy ratios start at exactly 1 whatever the filters.
    Sampling is an exponential race (argmax_i p_i / E_i with E_i ~ Exp(1) picks i with
    probability p_i): one pass over the (filtered) logits, and it runs inside a CUDA graph.
    """
    scaled = logits.float() / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    allowed = filter_logits(scaled, top_k, top_p, min_p) if filters_active(top_k, top_p, min_p) else scaled
    race = allowed - torch.empty_like(logp).exponential_().log()  # a shift of `allowed` picks the same
    tokens = race.argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def bucket_batch(rows: int) -> int:
    """Rows rounded up to a power of two (at least 8): few distinct graph shapes."""
    return max(8, 1 << math.ceil(math.log2(max(rows, 1))))


def bucket_length(length: int, step: int) -> int:
    return max(step, -(-length // step) * step)


class CudaGraphEngine:
    """Samples with a CUDA-graph decode loop; the same interface as HFEngine.

    Args:
        model: a transformers causal LM already on its device (bf16 on GPUs). The engine
            owns it from here: its attention switches to gqa_decode's packed form (SDPA
            models; the same results, one read of the KV cache per decode step).
        max_batch_size: rows decoded together at most; a larger request runs in chunks.
            Before every request the batch is lowered to what the GPU's free memory holds
            (KV cache at full length plus sampling workspace), and an out-of-memory error
            halves it; both are reported as degradations.
        prompt_bucket: prompts are left-padded to a multiple of this many tokens.
        compile: capture decode steps as CUDA graphs (default: on CUDA devices).
        decode: token ids -> text (the tokenizer's), for requests with stop strings.
    Sampling filters (top-k / top-p / min-p) come with each request.
    """

    def __init__(self, model, *, pad_id: int, eos_id: int, device: str, max_batch_size: int = 256,
                 prompt_bucket: int = 64, compile: bool | None = None, decode: Callable | None = None):
        self.model = model.eval()
        use_packed_gqa(model)
        self.pad_id, self.eos_id, self.device, self.decode = pad_id, eos_id, device, decode
        self.max_batch_size = bucket_batch(max_batch_size)
        self.prompt_bucket = prompt_bucket
        self.compiled = torch.device(device).type == "cuda" if compile is None else compile
        self._caches: dict[tuple[int, int], object] = {}   # (batch, length) -> StaticCache
        self._cache_bytes: dict[tuple[int, int], int] = {}  # what each holds once filled
        self.batch = self.max_batch_size     # sequences decoded together in the current request
        self._planned: int | None = None    # the last plan, so a change is reported once
        # transformers renamed forward's `past_key_values` to `cache` (5.2x); take either.
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        # Dynamo specialises on the Python floats/ints it sees (temperature, filters) and on
        # the cache object: one graph per bucket pair and temperature, within its limit.
        self._decode = (torch.compile(self._decode_step, mode="reduce-overhead", dynamic=False)
                        if self.compiled else self._decode_step)

    @torch.no_grad()
    def generate(self, request: GenerationRequest, policy_version: int) -> Rollout:
        require_decode(self.decode, request.stop_strings)
        prompts, groups = repeat_prompts(request)
        torch.manual_seed(request.seed)
        width = bucket_length(max(len(p) for p in prompts), self.prompt_bucket)
        # Batch from the memory free now, re-read for every request; an out-of-memory
        # error still halves it and redoes the chunk that failed.
        self.batch = self._plan(len(prompts), width, width + request.max_new_tokens)

        def run(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
            ids, mask = left_pad(prompts[rows], self.pad_id, width=width)
            return self._generate_chunk(ids, mask, request)

        parts, _ = in_chunks(run, len(prompts), self.batch, what="generation", device=self.device,
                             unit="sequences per batch", on_shrink=self._shrink)
        responses, logprobs = [tokens for tokens, _ in parts], [lps for _, lps in parts]
        width_r = max(r.shape[1] for r in responses)
        responses = torch.cat([torch.nn.functional.pad(r, (0, width_r - r.shape[1]), value=self.pad_id)
                               for r in responses])
        logprobs = torch.cat([torch.nn.functional.pad(lp, (0, width_r - lp.shape[1])) for lp in logprobs])
        ids, mask = left_pad(prompts, self.pad_id, width=width)
        return assemble_rollout(ids, mask, responses, logprobs, groups, stop_ids_of(request, self.eos_id),
                                policy_version, pad_id=self.pad_id, decode=self.decode,
                                stop_strings=request.stop_strings)

    def _plan(self, sequences: int, prompt_length: int, length: int) -> int:
        """Sequences per batch: a power of two, at most max_batch_size, that fits the memory
        free now with this engine's own KV caches counted as free (they make room)."""
        dtype = next(self.model.parameters()).dtype
        per_sequence = sequence_bytes(self.model.config, dtype, prompt_length, length)
        free = free_bytes(self.device)
        wanted = min(self.max_batch_size, bucket_batch(sequences))
        if free is None:
            return wanted
        held = sum(self._cache_bytes.values())
        batch = power_of_two_below(fitting_rows(free + held, per_sequence, wanted))
        if batch < wanted and batch != self._planned:
            report("generation", wanted, batch, "sequences per batch", LOW_FREE_MEMORY,
                   f"{(free + held) / 2**30:.2f} GiB free for {per_sequence / 2**20:.1f} MiB a sequence "
                   f"of {length} tokens")
        elif batch != self._planned and self._planned is not None:
            logger.info("dask-rl: cuda_graph engine: %d sequences per batch again (%.2f GiB free)", batch,
                        (free + held) / 2**30)
        self._planned = batch
        return batch

    def _shrink(self, batch: int) -> None:
        """After an out-of-memory error: drop every KV cache (they were sized for larger
        batches), decode `batch` sequences at a time from now on."""
        self.batch = batch
        self._caches.clear()
        self._cache_bytes.clear()

    def _generate_chunk(self, ids: torch.Tensor, mask: torch.Tensor, request: GenerationRequest
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, P) left-padded prompts -> (B, T) responses (pad after a stop id; a stop string
        may be overshot by up to EOS_CHECK_EVERY tokens, cut by assemble_rollout) and their logprobs."""
        max_new_tokens, temperature = request.max_new_tokens, request.temperature
        filters = (request.top_k, request.top_p, request.min_p)
        rows, width = ids.shape
        # The shape bucket, never above the planned batch (which is a power of two >= rows).
        batch = min(bucket_batch(rows), self.batch)
        if batch > rows:  # filler rows repeat the first prompt; their samples are dropped
            ids = torch.cat([ids, ids[:1].expand(batch - rows, -1)])
            mask = torch.cat([mask, mask[:1].expand(batch - rows, -1)])
        length = width + max_new_tokens
        cache = self._cache(batch, length)
        cache.reset()  # zeroes keys/values and, where transformers tracks it, the write position
        dev = self.device
        attention = torch.zeros((batch, length), dtype=torch.long, device=dev)
        attention[:, :width] = mask.to(dev)
        lengths = attention.sum(-1, keepdim=True)  # (B, 1) real prompt tokens
        # Prefill: the whole prompt in one eager forward, writing cache positions 0..P-1.
        logits = self.model(input_ids=ids.to(dev), attention_mask=attention,
                            position_ids=(attention[:, :width].cumsum(-1) - 1).clamp(min=0),
                            cache_position=torch.arange(width, device=dev), use_cache=True, logits_to_keep=1,
                            **{self._cache_arg: cache}).logits[:, -1]
        token, logprob = sample_tokens(logits, temperature, *filters)
        stop_ids = torch.tensor(stop_ids_of(request, self.eos_id), dtype=torch.long, device=dev)
        tokens = torch.full((batch, max_new_tokens), self.pad_id, dtype=torch.long, device=dev)
        logprobs = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=dev)
        done = torch.zeros(batch, dtype=torch.bool, device=dev)
        # Cache positions live on the device: a fresh host tensor every step would be a
        # synchronous copy that stalls the CPU until the GPU has caught up.
        positions = torch.arange(width, length, device=dev)
        steps = max_new_tokens
        for t in range(max_new_tokens):
            tokens[:, t] = token.masked_fill(done, self.pad_id)
            logprobs[:, t] = logprob.masked_fill(done, 0.0)
            done |= torch.isin(token, stop_ids)
            check = t % EOS_CHECK_EVERY == EOS_CHECK_EVERY - 1
            if check and request.stop_strings:  # a host sync, at the steps that sync anyway
                done[:rows] |= self._string_stopped(tokens[:rows, :t + 1], done[:rows], request.stop_strings)
            if t == max_new_tokens - 1 or (check and bool(done[:rows].all())):
                steps = t + 1
                break
            attention[:, width + t] = 1
            if self.compiled:
                torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are consumed
            token, logprob = self._decode(token[:, None].clone(), lengths + t, positions[t:t + 1], attention,
                                          cache, temperature, *filters)
        return tokens[:rows, :steps].cpu(), logprobs[:rows, :steps].cpu()

    def _decode_step(self, token, position_ids, cache_position, attention, cache, temperature: float,
                     top_k: int, top_p: float, min_p: float):
        logits = self.model(input_ids=token, attention_mask=attention, position_ids=position_ids,
                            cache_position=cache_position, use_cache=True, **{self._cache_arg: cache}).logits[:, -1]
        return sample_tokens(logits, temperature, top_k, top_p, min_p)

    def _string_stopped(self, tokens: torch.Tensor, done: torch.Tensor, stop_strings: tuple[str, ...]
                        ) -> torch.Tensor:
        """(B,) on the device: the rows not done yet whose text now holds a stop string.

        Only the tokens since the last check can complete one, so a tail window is decoded
        (the last EOS_CHECK_EVERY tokens plus as many before them as the longest string has
        characters, and two spare for a character split across tokens); a hit is confirmed
        on the whole row with the function assemble_rollout cuts with, so both agree."""
        window = EOS_CHECK_EVERY + max(len(s) for s in stop_strings) + 2
        host, ended = tokens.cpu(), done.cpu().clone()
        for row in (~ended).nonzero().flatten().tolist():
            tail = host[row, -window:].tolist()
            if any(s in self.decode(tail) for s in stop_strings):
                ended[row] = stop_string_end(host[row].tolist(), self.decode, stop_strings) >= 0
        return ended.to(done.device)

    def _cache(self, batch: int, length: int):
        """The StaticCache for this bucket pair; allocated on first use, then reused. When
        the memory free now cannot hold a new one, the caches of other shapes go first."""
        from transformers import StaticCache

        key = (batch, length)
        if key not in self._caches:
            need = kv_bytes_per_token(self.model.config, next(self.model.parameters()).dtype) * batch * length
            free = free_bytes(self.device)
            if free is not None and free < need / HEADROOM and self._caches:
                logger.info("dask-rl: cuda_graph engine: dropping %d KV caches to make room", len(self._caches))
                self._caches.clear()
                self._cache_bytes.clear()
                release_cached(self.device)
            logger.info("dask-rl: cuda_graph engine: new KV cache for batch %d x %d tokens", batch, length)
            self._caches[key] = StaticCache(config=self.model.config, max_cache_len=length)
            self._cache_bytes[key] = need
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


def _is_tied_alias(model, name: str) -> bool:
    """True for an output embedding that shares the input embedding's tensor."""
    output = model.get_output_embeddings()
    return (output is not None and name.endswith("weight") and output.weight is model.get_input_embeddings().weight
            and name.startswith(next(n for n, m in model.named_modules() if m is output)))
