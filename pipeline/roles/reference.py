"""The reference role: the frozen initial policy, for the KL penalty."""

from __future__ import annotations

import torch

from pipeline.records import Rollout
from pipeline.roles.forward import response_logprobs, row_chunks
from pipeline.roles.host import resolve_device, role_state


class ReferenceRole:
    def __init__(self, model_dir: str, *, device: str = "auto", dtype: str = "float32", micro_batch_size: int = 16):
        device = resolve_device(device)
        from pipeline.models import load_causal_lm

        self.model = load_causal_lm(model_dir, device=device, dtype=getattr(torch, dtype)).eval()
        self.device = device
        self.micro_batch_size = micro_batch_size

    @torch.no_grad()
    def logprobs(self, rollout: Rollout, temperature: float) -> torch.Tensor:
        """(B, R) log pi_ref of the response tokens."""
        parts = []
        for rows in row_chunks(len(rollout), self.micro_batch_size):
            parts.append(response_logprobs(
                self.model, rollout.input_ids[rows].to(self.device), rollout.attention_mask[rows].to(self.device),
                rollout.prompt_length, temperature).float().cpu())
        return torch.cat(parts) * rollout.response_mask


def ref_logprobs(rollout: Rollout, temperature: float) -> torch.Tensor:
    """Task: (B, R) reference log-probabilities for one rollout shard."""
    return role_state("reference").logprobs(rollout, temperature)
