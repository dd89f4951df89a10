"""A group's prompt computed once, attended in ordinary attention kernels (train.share_prompts).

pack_shared_prompts lays each group out as one sequence: its prompt, then every sample's
response. The projections and MLPs then compute each prompt once; only the attention must
keep the responses apart, each seeing its prompt and itself. Here that attention is two
calls of transformers' SDPA attention per layer, both over short dense tiles:

- every prompt on its own, causal (a tile of the longest prompt);
- every response's queries over its prompt's keys and values, then its own (causal): a tile
  of the longest response, its prompt's keys repeated per response.

Keys and queries are gathered into those tiles and the outputs scattered back, by indices
computed once per micro-batch (PromptsThenResponses). A block mask over the packed rows
(FlexAttention) expresses the same pairs, but its kernels ran 2-3x slower than cuDNN's
attention over whole rows on an H200 (benchmarks/shared_attention.py), which ate what the
shorter rows saved.

The model attends with SHARED_PROMPT_ATTENTION, a name registered with transformers'
attention interface: handed a PromptsThenResponses as its attention mask it runs the above,
handed anything else it is transformers' SDPA attention, masks and all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

SHARED_PROMPT_ATTENTION = "dask_rl_shared_prompts"


@dataclass(frozen=True)
class PromptsThenResponses:
    """Where a packed micro-batch's prompts and responses lie, as the attention's tiles.

    prompt_gather: (U, P) flat index into the packed N*W tokens of each prompt's tokens
    (P the longest prompt; past a prompt's end, its first token again), prompt_real: (U, P)
    which are its tokens. response_gather, response_real: (B, R) the same for each row's
    response (R the longest); response_unit: (B,) whose prompt it follows. *_pick: (T,) flat
    index into a tile's (U*P or B*R) outputs of each real token, *_place: (T,) the same
    token's flat index into N*W, where its output goes. The masks are made from these in the
    attention itself: inside a compiled block their sizes then follow these tensors' and
    are never compiled in as constants."""

    prompt_gather: torch.Tensor
    prompt_real: torch.Tensor
    response_gather: torch.Tensor
    response_real: torch.Tensor
    response_unit: torch.Tensor
    prompt_pick: torch.Tensor
    prompt_place: torch.Tensor
    response_pick: torch.Tensor
    response_place: torch.Tensor

    @classmethod
    def of(cls, shared) -> "PromptsThenResponses":
        """From pack_shared_prompts' SharedPromptRows."""
        prompt_gather, prompt_real = _spans(shared.prompt_start, shared.prompt_tokens)
        response_gather, response_real = _spans(shared.response_start, shared.response_tokens)
        prompt_pick, response_pick = prompt_real.flatten().nonzero()[:, 0], response_real.flatten().nonzero()[:, 0]
        return cls(prompt_gather, prompt_real, response_gather, response_real, shared.row_unit,
                   prompt_pick, prompt_gather.flatten()[prompt_pick], response_pick,
                   response_gather.flatten()[response_pick])

    def prompt_mask(self) -> torch.Tensor:
        """(U, 1, P, P): a prompt's query sees its prompt's keys up to itself."""
        return _causal(self.prompt_real.shape[1], self.prompt_real.device) & self.prompt_real[:, None, None, :]

    def response_mask(self) -> torch.Tensor:
        """(B, 1, R, P + R): a response's query sees all its prompt's keys, then its own up to itself."""
        rows, width = self.response_real.shape
        sees_prompt = self.prompt_real[self.response_unit][:, None, None, :].expand(-1, -1, width, -1)
        sees_response = _causal(width, self.response_real.device) & self.response_real[:, None, None, :]
        return torch.cat([sees_prompt, sees_response], dim=-1)


def _causal(width: int, device) -> torch.Tensor:
    return torch.ones(width, width, dtype=torch.bool, device=device).tril()


def _spans(starts: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K,) starts and lengths -> (K, longest) flat index of each span's tokens (past its end,
    its start again, or 0 for an empty span) and (K, longest) which are real."""
    longest = max(int(lengths.max()) if lengths.numel() else 0, 1)
    offsets = torch.arange(longest, device=starts.device)
    real = offsets[None, :] < lengths[:, None]
    first = torch.where(lengths > 0, starts, torch.zeros_like(starts))
    return torch.where(real, first[:, None] + offsets[None, :], first[:, None]), real


def attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function signature: (N, heads, W, d) query, key and value ->
    ((N, W, heads, d) output, None). A PromptsThenResponses mask runs the two tiles;
    anything else is transformers' SDPA attention."""
    if not isinstance(attention_mask, PromptsThenResponses):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    layout = attention_mask
    rows, heads, width, dim = query.shape
    query, key, value = (t.transpose(1, 2).reshape(rows * width, t.shape[1], dim) for t in (query, key, value))

    def tile(tokens, index):   # (N*W, h, d) -> (K, h, L, d) for a (K, L) index
        return tokens[index].transpose(1, 2)

    prompt_keys, prompt_values = tile(key, layout.prompt_gather), tile(value, layout.prompt_gather)
    prompt_out, _ = sdpa_attention_forward(module, tile(query, layout.prompt_gather), prompt_keys, prompt_values,
                                           layout.prompt_mask(), **kwargs)
    response_keys = torch.cat([prompt_keys[layout.response_unit], tile(key, layout.response_gather)], dim=2)
    response_values = torch.cat([prompt_values[layout.response_unit], tile(value, layout.response_gather)], dim=2)
    response_out, _ = sdpa_attention_forward(module, tile(query, layout.response_gather), response_keys,
                                             response_values, layout.response_mask(), **kwargs)
    out = query.new_zeros(rows * width, heads, dim)
    out = out.index_put((layout.prompt_place,), prompt_out.flatten(0, 1)[layout.prompt_pick])
    out = out.index_put((layout.response_place,), response_out.flatten(0, 1)[layout.response_pick])
    return out.view(rows, width, heads, dim), None


def attend_with_shared_prompts(model) -> None:
    """Switch `model`'s attention to SHARED_PROMPT_ATTENTION (registered with transformers
    on first use, its masks made as for SDPA). Raises ValueError for a model whose layers
    do not all attend to the whole sequence (a sliding window is not in the tiles)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    layer_types = getattr(model.config, "layer_types", None) or ["full_attention"]
    if set(layer_types) != {"full_attention"}:
        raise ValueError(f"its layers attend as {sorted(set(layer_types))}, not only to the whole sequence")
    AttentionInterface.register(SHARED_PROMPT_ATTENTION, attention)
    AttentionMaskInterface.register(SHARED_PROMPT_ATTENTION, sdpa_mask)
    model.set_attn_implementation(SHARED_PROMPT_ATTENTION)
