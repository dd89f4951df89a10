"""Generation with transformers' `generate`: the engine for CPU and for small GPU runs."""

from __future__ import annotations

import torch

from pipeline.algorithms import logprobs_from_logits
from pipeline.engines.budget import fitting_rows, sequence_bytes
from pipeline.records import GenerationRequest, Rollout
from resources.allocator import LOW_FREE_MEMORY, free_bytes, in_chunks, report


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


def response_mask_until_eos(responses: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, R) ids -> (B, R) float mask: 1 up to and including the first EOS, 0 after it."""
    is_eos = (responses == eos_id).long()
    eos_before = is_eos.cumsum(-1) - is_eos  # how many EOS strictly precede each position
    return (eos_before == 0).float()


def assemble_rollout(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
                     logprobs: torch.Tensor, group_ids: list[int], eos_id: int, policy_version: int) -> Rollout:
    """A Rollout from left-padded prompts (B, P) and right-padded responses with their
    sampled tokens' logprobs (B, R); the same record whatever engine generated it."""
    response_mask = response_mask_until_eos(responses, eos_id)
    return Rollout(
        input_ids=torch.cat([prompt_ids, responses], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask.long()], dim=1),
        response_mask=response_mask,
        behavior_logprobs=logprobs * response_mask,
        group_ids=torch.tensor(group_ids, dtype=torch.long),
        policy_version=policy_version,
        prompt_length=prompt_ids.shape[1],
    )


class HFEngine:
    """Samples with plain `model.generate`, returning the sampled tokens' logprobs.

    `generate` is not asked for its logits: keeping every step's full-vocabulary logits
    costs B x R x V floats (20 GiB for 64 x 256 tokens of a 150k vocabulary). The sampled
    tokens' logprobs come from one forward pass over prompt + response afterwards, `rows`
    sequences at a time, the same computation as the actor's loss.

    On a GPU the batch is sized from its free memory before every request, and an
    out-of-memory error halves it (generation and scoring); both are reported.
    """

    def __init__(self, model, *, pad_id: int, eos_id: int, device: str, rows: int = 16):
        self.model = model.eval()
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.device = device
        self.rows = rows

    @torch.no_grad()
    def generate(self, request: GenerationRequest, policy_version: int) -> Rollout:
        prompts, groups = repeat_prompts(request)
        ids, mask = left_pad(prompts, self.pad_id)
        torch.manual_seed(request.seed)
        # All sequences at once when the GPU's free memory holds them (read for every
        # request), else fewer per call; an out-of-memory error halves the batch again.
        per_sequence = sequence_bytes(self.model.config, next(self.model.parameters()).dtype, ids.shape[1],
                                      ids.shape[1] + request.max_new_tokens, cache_copies=2)
        batch = fitting_rows(free_bytes(self.device), per_sequence, len(prompts))
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
        return assemble_rollout(ids, mask, responses, torch.cat(scored), groups, self.eos_id, policy_version)

    def _sample(self, ids: torch.Tensor, mask: torch.Tensor, request: GenerationRequest) -> torch.Tensor:
        """(B, P) left-padded prompts -> (B, T) sampled responses on the CPU (pad after EOS)."""
        sequences = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
            do_sample=True, temperature=request.temperature, top_k=0, top_p=1.0,
            max_new_tokens=request.max_new_tokens, pad_token_id=self.pad_id, eos_token_id=self.eos_id,
        )
        return sequences[:, ids.shape[1]:].cpu()

    def _logprobs(self, ids: torch.Tensor, mask: torch.Tensor, responses: torch.Tensor,
                  temperature: float) -> torch.Tensor:
        """(B, R) log softmax(logits / temperature) of the sampled tokens: the distribution
        the actor's loss evaluates, so ratios start at 1 on-policy. Tokens after EOS are
        scored too and masked out later by the response mask."""
        full = torch.cat([ids, responses], dim=1).to(self.device)
        attention = torch.cat([mask, torch.ones_like(responses)], dim=1).to(self.device)
        logits = self.model(input_ids=full, attention_mask=attention,
                            position_ids=(attention.cumsum(-1) - 1).clamp(min=0)).logits
        width = ids.shape[1]
        return logprobs_from_logits(logits[:, width - 1:-1], full[:, width:], temperature).cpu()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state, strict=False)
