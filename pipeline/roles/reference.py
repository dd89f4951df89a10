"""The reference role: the frozen initial policy, for the KL penalty."""

from __future__ import annotations

import torch

from pipeline.records import Rollout
from pipeline.roles.forward import choose_packing, in_row_chunks, response_logprobs
from pipeline.roles.host import resolve_device, role_state


class ReferenceRole:
    def __init__(self, model_dir: str, *, device: str = "auto", dtype: str = "float32",
                 micro_batch_size: int | str = "auto", pack_sequences: bool = True, share_prompts: bool = False):
        device = resolve_device(device)
        from pipeline.models import load_causal_lm

        self.model = load_causal_lm(model_dir, device=device, dtype=getattr(torch, dtype)).eval()
        self.device = device
        self.micro_batch_size = micro_batch_size
        # Whole rows packed, a group's prompt computed once too (train.share_prompts), or
        # neither: forward.choose_packing.
        self.packing = choose_packing(self.model, pack_sequences, share_prompts)

    def logprobs(self, rollout: Rollout, temperature: float) -> torch.Tensor:
        """(B, R) log pi_ref of the response tokens, 0 on padding."""
        return in_row_chunks(response_logprobs, self.model, rollout, self.micro_batch_size, self.device,
                             temperature, what="reference logprobs", pack=self.packing).cpu() * rollout.response_mask


def ref_logprobs(rollout: Rollout, temperature: float) -> torch.Tensor:
    """Task: (B, R) reference log-probabilities for one rollout shard."""
    return role_state("reference").logprobs(rollout, temperature)
