"""Forward passes over rollouts that several roles share (actor, reference, critic)."""

from __future__ import annotations

import logging
import weakref

import torch

from pipeline.algorithms import entropy_from_logits, logprobs_from_logits
from pipeline.models import position_ids
from pipeline.packing import SHARED_PROMPTS, pack_rows, pack_shared_prompts, response_slots, unpack_responses
from pipeline.records import on_device
from pipeline.roles.shared_attention import (
    SHARED_PROMPT_ATTENTION, PromptsThenResponses, attend_with_shared_prompts, tiles_inputs,
)
from pipeline.vocab_scores import projected_scores
from resources.allocator import free_bytes, in_chunks, rows_per_micro_batch

logger = logging.getLogger("dask_rl")


# Response tokens projected onto the vocabulary at once. A (tokens, V) float32 block is what
# the loss holds per chunk, several times over in its backward pass (the bf16 logits, their
# float32 copy, the exponentials, the gradients): 512 x 152k (Qwen2's vocabulary) is 0.3 GB
# a block, where a whole 16 x 256-token micro-batch at once would be 2.5 GB. On an H200 with
# the 0.5B model, 512 instead of 1024 took the actor's peak from 10.3 to 8.5 GiB at the same
# step time (benchmarks/gpu_memory_variants.sh).
LOGIT_CHUNK_TOKENS = 512
# The same for a compiled model (train.compile_model), whose fused projection keeps fewer
# float32 copies of a chunk: on one H100, GRPO at batch 256 (256 new tokens, the 0.5B shape)
# stepped in 1.70-1.77 s at 2048 tokens against 2.20 s at 512, for 0.8 GiB more peak memory
# (1.66 s and 1.5 GiB more at 4096; benchmarks/grpo_vs_trl.py --logit-chunk). A micro-batch
# smaller than a chunk projects only its own tokens, so halving micro-batches after an
# out-of-memory error still shrinks the chunk.
COMPILED_LOGIT_CHUNK_TOKENS = 2048

# Models that cannot share prompts (an attention the tiles do not cover): they pack whole
# rows, and the reason is logged once.
_NOT_SHARING: weakref.WeakSet = weakref.WeakSet()

# model -> (rows per chunk that fitted after an out-of-memory error, free bytes then).
_FITTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Models whose logits are exactly lm_head(base_model(...)): checked once per model object.
_SEPARABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Models trained compiled (compile_for_training): their projection onto the vocabulary runs compiled too.
_COMPILED: weakref.WeakSet = weakref.WeakSet()


def compile_for_training(model) -> None:
    """Compile `model`'s transformer blocks in place, and its projection onto the vocabulary,
    with torch.compile (dynamic shapes: packed micro-batches and the last chunk of response
    tokens vary). Eagerly a block's element-wise work (norms, rotary, activations, residuals)
    is one kernel each and the projection's float32 log-softmax and entropy several passes
    over a (tokens, vocabulary) block; compiled, they fuse. On an H100 one packed update of
    the 0.5B shape took 1.41 s with compiled blocks and 1.37 s with a compiled projection,
    against 2.11 s eagerly (benchmarks/packed_update.py)."""
    compile_blocks(model)
    _COMPILED.add(model)


def compile_blocks(model) -> None:
    """Each of `model`'s transformer blocks compiled in place, with dynamic shapes."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    blocks = [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]
    # The blocks share their code: each one's first call with a cache, grad mode or shape
    # is a recompile of the same function, more than Dynamo's default limit of 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16 * len(blocks))
    for block in blocks:
        block.compile(dynamic=True)


def warm_up_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(ids, attention mask, prompt length) of a small made-up batch shaped as an update's, on
    the CPU as an update's rows come:
    left-padded prompts, responses of different lengths cut by padding, more response tokens
    than one projection chunk and not a multiple of it. Run through a compiled model it
    compiles what the update's first micro-batch would (dynamic shapes: real lengths reuse it)."""
    prompt, responses = 37, (COMPILED_LOGIT_CHUNK_TOKENS + 91, 203)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (len(responses), prompt + max(responses)), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0                          # a left-padded prompt
    mask[1, prompt + responses[1]:] = 0      # a shorter response
    return ids, mask, prompt


def response_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      prompt_length: int, temperature: float, pack: bool = False) -> torch.Tensor:
    """(B, P+R) ids -> (B, R) log-probabilities of the response tokens under `model`.

    The logits at position t predict token t+1, so columns P-1 .. P+R-2 score the response.
    The prompt's columns are never projected onto the vocabulary, and the response's are
    projected LOGIT_CHUNK_TOKENS at a time; with gradients on, each chunk's logits are
    recomputed in the backward pass instead of being kept (memory: one chunk, not B x R x V).

    `pack`: the rows' real tokens run packed (pipeline/packing.py) and only real response
    tokens are projected; padded response positions are then exactly 0. SHARED_PROMPTS:
    packed too, and rows with the same prompt compute it once (pack_shared_prompts).
    """
    return _response_scores(model, input_ids, attention_mask, prompt_length, temperature, None, pack)[0]


def response_logprobs_and_entropy(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                  prompt_length: int, temperature: float,
                                  entropy_grad: bool, pack: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """As response_logprobs, plus (B, R) float32 entropy of softmax(logits / temperature) at each
    response position, from the same logits (the log-probs are computed exactly as there).
    Without `entropy_grad` the entropy is detached: a figure, no backward cost."""
    return _response_scores(model, input_ids, attention_mask, prompt_length, temperature, entropy_grad, pack)


def _response_scores(model, input_ids, attention_mask, prompt_length: int, temperature: float,
                     entropy_grad: bool | None, pack: bool | str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs, entropy or None); entropy_grad None: no entropy. The rows may come on the
    CPU: they are packed there and only then sent to the model's device (on_device)."""
    device = _device_of(model)
    separable = _separable(model, input_ids, attention_mask, prompt_length, temperature, device)
    compiled = model in _COMPILED
    if pack:
        return _packed_scores(model, separable, compiled, input_ids, attention_mask, prompt_length, temperature,
                              entropy_grad, pack, device)
    input_ids, attention_mask = on_device(input_ids, device), on_device(attention_mask, device)
    targets = input_ids[:, prompt_length:]
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask))
    if not separable:
        logits = model(**inputs, logits_to_keep=targets.shape[1] + 1).logits[:, :-1]
        return _project_logits(logits, targets, temperature, entropy_grad)
    hidden = model.base_model(**inputs).last_hidden_state[:, prompt_length - 1:-1]
    return _chunked_scores(model.get_output_embeddings(), hidden, targets, temperature, entropy_grad, compiled)


def _packed_scores(model, separable: bool, compiled: bool, input_ids, attention_mask, prompt_length: int,
                   temperature: float, entropy_grad: bool | None, pack: bool | str,
                   device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """_response_scores over the packed real tokens: the hidden states that predict real
    response tokens are gathered (T of them), scored, and scattered back to (B, R).

    The packing is worked out where the rows are: on the CPU its data-dependent sizes
    (lengths, bins, the tiles) cost the GPU no wait, as they would where each one is read
    back from the device; the packed tensors then go over in copies queued behind its work."""
    if pack == SHARED_PROMPTS:
        shared = pack_shared_prompts(input_ids, attention_mask, prompt_length)
        inputs = on_device(shared_prompt_inputs(model, shared), device)
        predictors, outputs = shared.predictors, shared.outputs
    else:
        packed = pack_rows(input_ids, attention_mask)
        inputs = on_device(packed.model_inputs(), device)
        predictors, outputs = response_slots(packed, attention_mask, prompt_length)
    targets = on_device(input_ids[:, prompt_length:].reshape(-1)[outputs], device)
    predictors, outputs = on_device(predictors, device), on_device(outputs, device)
    if separable:
        hidden = model.base_model(**inputs).last_hidden_state
        scores = _chunked_scores(model.get_output_embeddings(), hidden.flatten(0, 1)[predictors], targets,
                                 temperature, entropy_grad, compiled)
    else:
        logits = model(**inputs).logits.flatten(0, 1)[predictors]
        scores = _project_logits(logits, targets, temperature, entropy_grad)
    shape = (input_ids.shape[0], input_ids.shape[1] - prompt_length)
    return tuple(None if part is None else unpack_responses(part, outputs, shape) for part in scores)


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def _low_precision(model) -> bool:
    """Whether `model` computes in 16 bits: its checks against another way of computing the
    same logprobs then allow for bf16/fp16 rounding."""
    return next(model.parameters()).dtype in (torch.bfloat16, torch.float16)


def choose_packing(model, pack_sequences: bool, share_prompts: bool) -> bool | str:
    """The packing of `model`'s forwards: SHARED_PROMPTS where prompts are to be shared and
    the model attends with SHARED_PROMPT_ATTENTION (switched to it here) and, on two made-up
    rows of one prompt, gives the padded rows' logprobs; else `pack_sequences`, its
    attention as it was and the reason logged once."""
    if not (pack_sequences and share_prompts) or model in _NOT_SHARING:
        return pack_sequences
    if getattr(model.config, "_attn_implementation", None) != SHARED_PROMPT_ATTENTION:
        before = getattr(model.config, "_attn_implementation", None)
        try:
            attend_with_shared_prompts(model)
            _check_shared_prompts(model)
        except (ValueError, ImportError, RuntimeError) as error:   # e.g. sliding-window layers
            _NOT_SHARING.add(model)
            if before and getattr(model.config, "_attn_implementation", None) != before:
                model.set_attn_implementation(before)
            logger.warning("dask-rl: train.share_prompts cannot run on %s (%s); the actor packs whole rows instead",
                           type(model).__name__, error)
            return pack_sequences
    return SHARED_PROMPTS


def _check_shared_prompts(model) -> None:
    """Raises RuntimeError unless two rows of one prompt give the same response logprobs
    with the prompt shared as padded (bf16 rounding aside)."""
    ids = torch.tensor([[0, 2, 3, 4, 5, 6], [0, 2, 3, 4, 6, 0]]) % model.config.vocab_size
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0]])   # one left-padded prompt, two responses
    modes = [(module, module.training) for module in model.modules()]   # e.g. checkpointing blocks left on
    model.eval()
    try:   # eagerly: compiled blocks would compile for these two rows' shapes
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            padded = response_logprobs(model, ids, mask, 4, 1.0)
            shared = response_logprobs(model, ids, mask, 4, 1.0, pack=SHARED_PROMPTS)
    finally:
        for module, training in modes:
            module.training = training
    real = mask[:, 4:].bool().to(padded.device)
    if not torch.allclose(shared[real], padded[real], rtol=0, atol=5e-2 if _low_precision(model) else 1e-4):
        raise RuntimeError("its logprobs with a shared prompt differ from the padded rows'")


def shared_prompt_inputs(model, shared) -> dict:
    """Keyword arguments of a transformers forward over SharedPromptRows: the attention tiles
    (PromptsThenResponses), which transformers passes down to every attention call, the model
    switched to the attention that reads them if it is not yet (a forward asked for
    SHARED_PROMPTS directly)."""
    if getattr(model.config, "_attn_implementation", None) != SHARED_PROMPT_ATTENTION:
        attend_with_shared_prompts(model)
    return dict(input_ids=shared.input_ids, position_ids=shared.position_ids, use_cache=False,
                **tiles_inputs(PromptsThenResponses.of(shared)))


def _chunked_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B, R, H) final hidden states, (B, R) tokens -> (B, R) float32 logprobs, chunk by chunk."""
    return _chunked_scores(head, hidden, targets, temperature, None)[0]


def _chunked_scores(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                    entropy_grad: bool | None, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(..., H) final hidden states, (...) tokens -> float32 logprobs and entropy (None when
    entropy_grad is None) shaped as `targets`, LOGIT_CHUNK_TOKENS tokens' logits at a time
    (vocab_scores.projected_scores; for a `compiled` model its passes over the logits run
    through torch.compile, COMPILED_LOGIT_CHUNK_TOKENS at a time)."""
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    chunk = COMPILED_LOGIT_CHUNK_TOKENS if compiled else LOGIT_CHUNK_TOKENS
    parts = [projected_scores(head, flat_hidden[start:start + chunk], flat_targets[start:start + chunk],
                              temperature, entropy_grad, compiled)
             for start in range(0, flat_targets.shape[0], chunk)]
    logprobs = torch.cat([p[0] for p in parts]).view(targets.shape)
    if entropy_grad is None:
        return logprobs, None
    return logprobs, torch.cat([p[1] for p in parts]).view(targets.shape)


def _project_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                    entropy_grad: bool | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    logprobs = logprobs_from_logits(logits, tokens, temperature)
    if entropy_grad is None:
        return logprobs, None
    scaled = (logits if entropy_grad else logits.detach()).float() / temperature
    return logprobs, entropy_from_logits(scaled)


def _separable(model, input_ids, attention_mask, prompt_length: int, temperature: float, device) -> bool:
    """Whether the model's logits are its output embedding applied to its base model's
    output. Most causal LMs are; some scale or soft-cap the logits in their own forward,
    and an FSDP-sharded model gathers its root parameters only in the root's forward: those
    take the whole-model path. Decided once per model, on its first row, by computing both."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):  # sharding changes the class of the same object: ask first
        return False
    if model in _SEPARABLE:
        return _SEPARABLE[model]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    separable = head is not None and getattr(model, "base_model", model) is not model
    if separable:
        ids, mask = input_ids[:1].to(device), attention_mask[:1].to(device)
        row = dict(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask))
        targets = ids[:, prompt_length:]
        with torch.no_grad():
            whole = logprobs_from_logits(model(**row, use_cache=False).logits[:, prompt_length - 1:-1], targets,
                                         temperature)
            hidden = model.base_model(**row, use_cache=False).last_hidden_state[:, prompt_length - 1:-1]
            split = _chunked_logprobs(head, hidden, targets, temperature)
        separable = torch.allclose(whole, split, rtol=0, atol=2e-2 if _low_precision(model) else 1e-4)
    _SEPARABLE[model] = separable
    return separable


def response_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    prompt_length: int, pack: bool = False) -> torch.Tensor:
    """(B, P+R) ids -> (B, R): V of the state before each response token is emitted
    (`pack`: over the packed real tokens, exactly 0 on padded response positions). The rows
    may come on the CPU, as for response_logprobs."""
    device = _device_of(critic)
    if not pack:
        return critic(on_device(input_ids, device), on_device(attention_mask, device))[:, prompt_length - 1:-1]
    packed = pack_rows(input_ids, attention_mask)
    predictors, outputs = (on_device(index, device) for index in response_slots(packed, attention_mask, prompt_length))
    values = critic(on_device(packed.input_ids, device), None,
                    positions=on_device(packed.position_ids, device)).flatten()[predictors]
    return unpack_responses(values, outputs, (input_ids.shape[0], input_ids.shape[1] - prompt_length))


@torch.no_grad()
def in_row_chunks(forward, model, batch, micro_batch_size: int | str, device, *args, what: str = "forward",
                  pack: bool = False) -> torch.Tensor:
    """(B, R) float32 `forward(model, input_ids, attention_mask, prompt_length, *args, pack=pack)`
    over a rollout or experience, `micro_batch_size` rows at a time (no gradients; "auto":
    allocator.AUTO_ROWS), on `device`: the reference's logprobs, the critic's values and the
    actor's proximal logprobs.

    A chunk that runs out of memory is halved and redone (reported as a degradation of
    `what`); rows are scored independently, so the result is the same."""
    def run(rows: slice) -> torch.Tensor:   # the forward sends the rows to the device (packed first, if so)
        return forward(model, batch.input_ids[rows], batch.attention_mask[rows],
                       batch.prompt_length, *args, pack=pack).float()

    micro_batch_size = rows_per_micro_batch(micro_batch_size)

    rows = micro_batch_size
    fitted, free_then = _FITTED.get(model, (micro_batch_size, None))
    if fitted < micro_batch_size:  # it ran out of memory before: start at what fitted...
        free_now = free_bytes(device)
        if free_now is None or free_then is None or free_now <= free_then:  # ...unless more is free now
            rows = fitted
    parts, used = in_chunks(run, len(batch), rows, what=what, device=device)
    if used < rows:
        _FITTED[model] = (used, free_bytes(device))
    elif rows == micro_batch_size:
        _FITTED.pop(model, None)
    return torch.cat(parts)
