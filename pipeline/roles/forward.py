"""Forward passes over rollouts that several roles share (actor, reference, critic)."""

from __future__ import annotations

import torch

from pipeline.algorithms import logprobs_from_logits
from pipeline.models import position_ids


def response_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      prompt_length: int, temperature: float) -> torch.Tensor:
    """(B, P+R) ids -> (B, R) log-probabilities of the response tokens under `model`.

    The logits at position t predict token t+1, so columns P-1 .. P+R-2 score the response.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=position_ids(attention_mask)).logits
    return logprobs_from_logits(logits[:, prompt_length - 1:-1], input_ids[:, prompt_length:], temperature)


def response_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    prompt_length: int) -> torch.Tensor:
    """(B, P+R) ids -> (B, R): V of the state before each response token is emitted."""
    return critic(input_ids, attention_mask)[:, prompt_length - 1:-1]


def row_chunks(num_rows: int, chunk_size: int) -> list[slice]:
    """Consecutive row slices of at most `chunk_size` rows (micro-batches)."""
    return [slice(start, min(start + chunk_size, num_rows)) for start in range(0, num_rows, chunk_size)]
