"""Generation with transformers' `generate`: the engine for CPU and for small GPU runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pipeline.algorithms import logprobs_from_logits
from pipeline.engines.budget import fitting_rows, free_for_generation, sequence_bytes
from pipeline.engines.sampling import filter_logits, filters_active, stop_string_end
from pipeline.records import GenerationRequest, Rollout
from resources.allocator import LOW_FREE_MEMORY, in_chunks, report


def repeat_prompts(request: GenerationRequest) -> tuple[list[list[int]], list[int]]:
    """Each prompt and its group id, `samples_per_prompt` times in a row."""
    n = request.samples_per_prompt
    return ([p for p in request.prompt_ids for _ in range(n)], [g for g in request.group_ids for _ in range(n)])


def left_pad(prompts: list[list[int]], pad_id: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts -> (B, P) ids and attention mask, left-padded so every response starts at P
    (P = the longest prompt, or `width`)."""
    width = max(len(p) for p in prompts) if width is None else width
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
    return ids, mask


def stop_ids_of(request: GenerationRequest, eos_id: int | None) -> tuple[int, ...]:
    """The ids that end a response: the engine's EOS id and the request's stop ids."""
    return tuple(dict.fromkeys(i for i in (eos_id, *request.stop_token_ids) if i is not None))


def require_decode(decode: Callable | None, stop_strings: tuple[str, ...]) -> None:
    if stop_strings and decode is None:
        raise ValueError(f"the request has stop strings {list(stop_strings)} but the engine has no tokenizer to read "
                         f"the text with. Fix: build the engine with decode=tokenizer.decode (the rollout role does)")


def stop_string_ends(responses: torch.Tensor, stop_ids: tuple[int, ...], decode: Callable | None,
                     stop_strings: tuple[str, ...]) -> torch.Tensor:
    """(B, R) ids -> (B,) the index of the token that completes a stop string in each row's
    text before its first stop id, -1 where none does."""
    ends = torch.full((responses.shape[0],), -1, dtype=torch.long)
    if not stop_strings:
        return ends
    require_decode(decode, stop_strings)
    is_stop = torch.isin(responses, torch.tensor(stop_ids, dtype=responses.dtype))
    for row in range(responses.shape[0]):
        first_id = int(is_stop[row].nonzero()[0]) if is_stop[row].any() else responses.shape[1]
        ends[row] = stop_string_end(responses[row, :first_id].tolist(), decode, stop_strings)
    return ends


def response_mask_until_stop(responses: torch.Tensor, stop_ids: tuple[int, ...],
                             string_ends: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, R) ids -> (B, R) float response mask and (B,) bool `clipped`: the one place every
    engine's rows end.

    A row ends at its first stop: a token in `stop_ids` (kept: it is trained on, as EOS
    always was) or the token at `string_ends[row]` (>= 0), the one that completes a stop
    string (kept too; the tokens after it are masked out). The mask is 1 up to and including
    that token and 0 after it. A row without any stop is `clipped`: engines only leave a row
    unstopped when it reached max_new_tokens (or the model's context), and its mask is all 1.
    """
    is_stop = torch.isin(responses, torch.tensor(stop_ids, dtype=responses.dtype))
    if string_ends is not None:
        rows = (string_ends >= 0).nonzero().flatten()
        is_stop[rows, string_ends[rows]] = True
    is_stop = is_stop.long()
    stops_before = is_stop.cumsum(-1) - is_stop  # how many stops strictly precede each position
    return (stops_before == 0).float(), is_stop.sum(-1) == 0


def assemble_rollout(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
                     logprobs: torch.Tensor, group_ids: list[int], stop_ids: tuple[int, ...], policy_version: int,
                     *, pad_id: int, decode: Callable | None = None, stop_strings: tuple[str, ...] = (),
                     engine_string_ends: torch.Tensor | None = None, partial: PartialRows | None = None
                     ) -> Rollout:
    """A Rollout from left-padded prompts (B, P) and right-padded responses with their
    sampled tokens' logprobs (B, R); the same record whatever engine generated it. Tokens
    past each row's stop (an engine may overshoot a stop string) become padding.

    `engine_string_ends` (B,): where an engine with its own stop-string search (vLLM, with
    its own tokenizer) ended rows, -1 elsewhere. A row ends at the earlier of that and what
    `decode` finds, so a row the engine ended is never taken for an unfinished one.

    `partial`: the rows a partial rollout ended before they did, which hold `lengths` tokens
    (no stop among them), and each row's first token's version."""
    ends = stop_string_ends(responses, stop_ids, decode, stop_strings)
    if engine_string_ends is not None:
        both = (ends >= 0) & (engine_string_ends >= 0)
        ends = torch.where(both, torch.minimum(ends, engine_string_ends), torch.maximum(ends, engine_string_ends))
    response_mask, clipped = response_mask_until_stop(responses, stop_ids, ends)
    if partial is not None:  # an unfinished row is neither stopped nor clipped: its tokens so far
        so_far = (torch.arange(responses.shape[1]) < partial.lengths[:, None]).float()
        response_mask = torch.where(partial.unfinished[:, None], so_far, response_mask)
        clipped = clipped & ~partial.unfinished
    responses = responses.masked_fill(response_mask == 0, pad_id)
    return Rollout(
        input_ids=torch.cat([prompt_ids, responses], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask.long()], dim=1),
        response_mask=response_mask,
        behavior_logprobs=logprobs * response_mask,
        group_ids=torch.tensor(group_ids, dtype=torch.long),
        policy_version=policy_version,
        prompt_length=prompt_ids.shape[1],
        clipped=clipped,
        unfinished=None if partial is None else partial.unfinished,
        born=None if partial is None else partial.born,
    )


@dataclass(frozen=True)
class PartialRows:
    """What a partial rollout adds to a record: (B,) bool unfinished rows, (B,) int64 tokens
    each row holds, (B,) int64 version of each row's first token (-1: none)."""

    unfinished: torch.Tensor
    lengths: torch.Tensor
    born: torch.Tensor


def partial_refusal(engine: str) -> str:
    """Why `engine` cannot run partial rollouts, and the fix."""
    return (f"train.partial_rollouts: the {engine} rollout engine generates every row to its end. Fix: set "
            f"rollout.strategy: cuda_graph in the resource file (it runs eagerly on a CPU), or turn "
            f"partial_rollouts off.")


def refuse_partial(request: GenerationRequest, engine: str) -> None:
    """Partial rollouts need an engine that ends a request by groups and continues rows."""
    if request.partial:
        raise ValueError(partial_refusal(engine))


class FilterLogits:
    """generate's sampling filters as the other engines apply them (engines/sampling.py); a
    logits processor for `generate` (transformers is imported lazily, as everywhere here).
    generate runs custom processors before its temperature warper: the filter is computed on
    scores / temperature and masks the raw scores (-inf stays -inf once divided)."""

    def __init__(self, temperature: float, top_k: int, top_p: float, min_p: float):
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        kept = filter_logits(scores.float() / self.temperature, self.top_k, self.top_p, self.min_p)
        return scores.masked_fill(kept.isneginf(), float("-inf"))


class StopAtStrings:
    """A stopping criterion for `generate`: ends a row once its response text contains a stop string."""

    def __init__(self, prompt_width: int, decode: Callable, stop_strings: tuple[str, ...]):
        self.prompt_width, self.decode, self.stop_strings = prompt_width, decode, stop_strings

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        texts = [self.decode(row[self.prompt_width:].tolist()) for row in input_ids]
        return torch.tensor([any(s in text for s in self.stop_strings) for text in texts], device=input_ids.device)


class HFEngine:
    """Samples with plain `model.generate`, returning the sampled tokens' logprobs.

    `generate` is not asked for its logits: keeping every step's full-vocabulary logits
    costs B x R x V floats (20 GiB for 64 x 256 tokens of a 150k vocabulary). The sampled
    tokens' logprobs come from one forward pass over prompt + response afterwards, `rows`
    sequences at a time, the same computation as the actor's loss.

    On a GPU the batch is sized from its free memory before every request, and an
    out-of-memory error halves it (generation and scoring); both are reported.
    `decode` (token ids -> text, the tokenizer's) is needed for requests with stop strings.
    """

    def __init__(self, model, *, pad_id: int, eos_id: int, device: str, rows: int = 16,
                 decode: Callable[[list[int]], str] | None = None, reserve: Callable[[], int] | None = None):
        self.model = model.eval()
        self.reserve = reserve   # as CudaGraphEngine's: left out of the memory batches are planned in
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.device = device
        self.rows = rows
        self.decode = decode

    @torch.no_grad()
    def generate(self, request: GenerationRequest, policy_version: int) -> Rollout:
        require_decode(self.decode, request.stop_strings)
        refuse_partial(request, "hf")
        prompts, groups = repeat_prompts(request)
        ids, mask = left_pad(prompts, self.pad_id)
        torch.manual_seed(request.seed)
        # All sequences at once when the GPU's free memory holds them (read for every
        # request), else fewer per call; an out-of-memory error halves the batch again.
        per_sequence = sequence_bytes(self.model.config, next(self.model.parameters()).dtype, ids.shape[1],
                                      ids.shape[1] + request.max_new_tokens, cache_copies=2)
        batch = fitting_rows(free_for_generation(self.device, self.reserve), per_sequence, len(prompts))
        if batch < len(prompts):
            report("generation", len(prompts), batch, "sequences per batch", LOW_FREE_MEMORY,
                   f"{per_sequence / 2**20:.1f} MiB a sequence of {ids.shape[1] + request.max_new_tokens} tokens")
        parts, _ = in_chunks(lambda r: self._sample(ids[r], mask[r], request), len(prompts), batch,
                             what="generation", device=self.device, unit="sequences per batch")
        width = max(part.shape[1] for part in parts)
        responses = torch.cat([torch.nn.functional.pad(part, (0, width - part.shape[1]), value=self.pad_id)
                               for part in parts])
        scored, _ = in_chunks(lambda r: self._logprobs(ids[r], mask[r], responses[r], request.temperature),
                              len(prompts), self.rows, what="rollout logprobs", device=self.device)
        return assemble_rollout(ids, mask, responses, torch.cat(scored), groups, stop_ids_of(request, self.eos_id),
                                policy_version, pad_id=self.pad_id, decode=self.decode,
                                stop_strings=request.stop_strings)

    def _sample(self, ids: torch.Tensor, mask: torch.Tensor, request: GenerationRequest) -> torch.Tensor:
        """(B, P) left-padded prompts -> (B, T) sampled responses on the CPU (pad after a stop)."""
        filters = ([FilterLogits(request.temperature, request.top_k, request.top_p, request.min_p)]
                   if filters_active(request.top_k, request.top_p, request.min_p) else [])
        stops = [StopAtStrings(ids.shape[1], self.decode, request.stop_strings)] if request.stop_strings else []
        from transformers import LogitsProcessorList, StoppingCriteriaList

        sequences = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
            do_sample=True, temperature=request.temperature, top_k=0, top_p=1.0,
            max_new_tokens=request.max_new_tokens, pad_token_id=self.pad_id,
            eos_token_id=list(stop_ids_of(request, self.eos_id)), logits_processor=LogitsProcessorList(filters),
            stopping_criteria=StoppingCriteriaList(stops),
        )
        return sequences[:, ids.shape[1]:].cpu()

    def _logprobs(self, ids: torch.Tensor, mask: torch.Tensor, responses: torch.Tensor,
                  temperature: float) -> torch.Tensor:
        """(B, R) log softmax(logits / temperature) of the sampled tokens: the distribution
        the actor's loss evaluates (never filtered by top-k/top-p/min-p), so ratios start at
        1 on-policy. Tokens after a stop are scored too and masked out by the response mask."""
        full = torch.cat([ids, responses], dim=1).to(self.device)
        attention = torch.cat([mask, torch.ones_like(responses)], dim=1).to(self.device)
        logits = self.model(input_ids=full, attention_mask=attention,
                            position_ids=(attention.cumsum(-1) - 1).clamp(min=0)).logits
        width = ids.shape[1]
        return logprobs_from_logits(logits[:, width - 1:-1], full[:, width:], temperature).cpu()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state, strict=False)
