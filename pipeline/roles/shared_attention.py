"""A group's prompt computed once, attended in ordinary attention kernels (train.share_prompts).

pack_shared_prompts lays each group out as one sequence: its prompt, then every sample's
response. The projections and MLPs then compute each prompt once; only the attention must
keep the responses apart, each seeing its prompt and itself. Here that attention is a few
calls of transformers' SDPA attention per layer, over short dense tiles:

- every prompt on its own, causal (a tile as wide as the longest prompt);
- every response's queries over its prompt's keys and values, then its own (causal), its
  prompt's keys repeated per response: the rows sorted by response length, in a few tiles
  each as wide as its longest response (RESPONSE_TILES).

Keys and queries are gathered into those tiles and the outputs scattered back, by indices
computed once per micro-batch (PromptsThenResponses), on the CPU where the rows are. A
block mask over the packed rows (FlexAttention) expresses the same pairs, but its kernels
ran 2-3x slower than cuDNN's attention over whole rows on an H200
(benchmarks/shared_attention.py), which ate what the shorter rows saved.

The model attends with SHARED_PROMPT_ATTENTION, a name registered with transformers'
attention interface: handed a PromptsThenResponses (the forward's TILES keyword, which
transformers passes down to every attention call) it runs the above, else it is
transformers' SDPA attention, masks and all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

SHARED_PROMPT_ATTENTION = "dask_rl_shared_prompts"
# The forward's keyword argument that carries the tiles: transformers hands a model's extra
# keyword arguments down to every attention call.
TILES = "shared_prompt_tiles"

# Responses are attended in this many tiles, the rows sorted by response length and cut into
# tiles of about equal rows, each as wide as its longest response: with long-tailed lengths
# one tile as wide as the longest response would compute several times the pairs needed.
RESPONSE_TILES = 4


@dataclass(frozen=True)
class Tile:
    """K spans of packed tokens (prompts, or responses) as one (K, L) tile, L the longest.

    gather: (K, L) flat index into the packed N*W tokens of each span's tokens (past a span's
    end, its first token again, or 0 for an empty span); real: (K, L) which are its tokens;
    unit: (K,) the unit (prompt) each span belongs to; pick: (T,) flat index into the tile's
    K*L outputs of each real token."""

    gather: torch.Tensor
    real: torch.Tensor
    unit: torch.Tensor
    pick: torch.Tensor

    @classmethod
    def of(cls, starts: torch.Tensor, lengths: torch.Tensor, unit: torch.Tensor) -> "Tile":
        longest = max(int(lengths.max()) if lengths.numel() else 0, 1)
        offsets = torch.arange(longest, device=starts.device)
        real = offsets[None, :] < lengths[:, None]
        first = torch.where(lengths > 0, starts, torch.zeros_like(starts))
        gather = torch.where(real, first[:, None] + offsets[None, :], first[:, None])
        return cls(gather, real, unit, real.flatten().nonzero()[:, 0])

    @property
    def places(self) -> torch.Tensor:
        """(T,) where each real token's output goes: its flat index into N*W."""
        return self.gather.flatten()[self.pick]


@dataclass(frozen=True)
class PromptsThenResponses:
    """A packed micro-batch's prompts and responses as the attention's tiles: `prompts`,
    one span per unit; `responses`, the rows' responses in RESPONSE_TILES tiles of similar
    lengths (fewer for fewer rows, or where two would be as wide: one for equal lengths);
    `place`: (T,) the flat index into N*W of every real token of the tiles, prompts first,
    then each response tile's, where its output goes. The masks
    are made from these in the attention itself: inside a compiled block their sizes then
    follow these tensors' and are never compiled in as constants."""

    prompts: Tile
    responses: tuple[Tile, ...]
    place: torch.Tensor

    @classmethod
    def of(cls, shared) -> "PromptsThenResponses":
        """From pack_shared_prompts' SharedPromptRows."""
        units = torch.arange(shared.prompt_start.shape[0], device=shared.prompt_start.device)
        prompts = Tile.of(shared.prompt_start, shared.prompt_tokens, units)
        order = torch.argsort(shared.response_tokens, stable=True)
        cuts: list[torch.Tensor] = []
        for rows in order.tensor_split(min(RESPONSE_TILES, max(len(order), 1))):
            # A cut as wide as the one before joins it: the same tile, in fewer calls.
            if cuts and shared.response_tokens[rows].max() == shared.response_tokens[cuts[-1]].max():
                cuts[-1] = torch.cat([cuts[-1], rows])
            else:
                cuts.append(rows)
        responses = tuple(Tile.of(shared.response_start[rows], shared.response_tokens[rows], shared.row_unit[rows])
                          for rows in cuts)
        place = torch.cat([prompts.places] + [tile.places for tile in responses])
        return cls(prompts, responses, place)

    def prompt_mask(self) -> torch.Tensor:
        """(U, 1, P, P): a prompt's query sees its prompt's keys up to itself."""
        return _causal(self.prompts.real.shape[1], self.place.device) & self.prompts.real[:, None, None, :]

    def response_mask(self, tile: Tile) -> torch.Tensor:
        """(K, 1, L, P + L) for a response tile: a query sees all its prompt's keys, then its
        response's up to itself."""
        width = tile.real.shape[1]
        sees_prompt = self.prompts.real[tile.unit][:, None, None, :].expand(-1, -1, width, -1)
        sees_response = _causal(width, self.place.device) & tile.real[:, None, None, :]
        return torch.cat([sees_prompt, sees_response], dim=-1)


def _causal(width: int, device) -> torch.Tensor:
    return torch.ones(width, width, dtype=torch.bool, device=device).tril()


def tiles_inputs(tiles: PromptsThenResponses) -> dict:
    """The keyword arguments of a forward whose attention runs `tiles`: the tiles, and as its
    attention mask a placeholder of four dimensions, which transformers takes as a mask
    already made (it would otherwise build one over every pair of each packed row) and the
    tiled attention never reads."""
    return {TILES: tiles, "attention_mask": torch.ones(1, 1, 1, 1, dtype=torch.bool)}


def attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function signature: (N, heads, W, d) query, key and value ->
    ((N, W, heads, d) output, None). Given tiles (the TILES keyword) it runs them; without,
    it is transformers' SDPA attention, mask and all."""
    layout = kwargs.pop(TILES, None)
    if layout is None:
        if attention_mask is not None and attention_mask.shape == (1, 1, 1, 1) and query.shape[2] > 1:
            raise RuntimeError(f"{type(module).__name__} was not handed the shared-prompt tiles: this model does "
                               "not pass its forward's keyword arguments down to its attention")
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows, heads, width, dim = query.shape
    query, key, value = (t.transpose(1, 2).reshape(rows * width, t.shape[1], dim) for t in (query, key, value))

    def tiled(tokens, tile):   # (N*W, h, d) -> (K, h, L, d)
        return tokens[tile.gather].transpose(1, 2)

    prompts = layout.prompts
    prompt_keys, prompt_values = tiled(key, prompts), tiled(value, prompts)
    out, _ = sdpa_attention_forward(module, tiled(query, prompts), prompt_keys, prompt_values, layout.prompt_mask(),
                                    **kwargs)
    outputs = [out.flatten(0, 1)[prompts.pick]]
    for tile in layout.responses:
        keys = torch.cat([prompt_keys[tile.unit], tiled(key, tile)], dim=2)
        values = torch.cat([prompt_values[tile.unit], tiled(value, tile)], dim=2)
        out, _ = sdpa_attention_forward(module, tiled(query, tile), keys, values, layout.response_mask(tile),
                                        **kwargs)
        outputs.append(out.flatten(0, 1)[tile.pick])
    merged = query.new_zeros(rows * width, heads, dim).index_put((layout.place,), torch.cat(outputs))
    return merged.view(rows, width, heads, dim), None


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
