"""Fewer, wider matrix products in the rollout engine's forward: each layer's query, key and
value projections as one product, and its MLP's gate and up projections as one.

At a decode step each product has one row a slot (256 at most), so it is short, and a good
part of its time is the kernel's fixed cost: on an H100 at 256 slots (the Qwen2-0.5B shape,
benchmarks/decode_profile.py; the products told apart by launches a step and bias) the key
and value projections took 4.1 us each and the query projection 4.8 us, for 128, 128 and
896 output columns, and the two MLP inputs 7.1 us each. A product of all their columns does
the same arithmetic in one kernel.

The model keeps its own forward. The projections' weights (and biases) become views into
one buffer, so new weights loaded into them (the engine's load_state_dict copies into the
parameters) are the fused buffer's too. The group's first projection computes the fused
product and hands the others their columns when they are called next on the same input; a
call on any other input computes its own product, so a model that calls them in another
order gets the same results. Fuse a model where it will run: moving it to another device or
dtype afterwards (`.to()`) would move the parameters but not the fused buffers (the engine
gets its model on its device and never moves it).
"""

from __future__ import annotations

import torch
from torch import nn

# (the module's attribute names, the projections it fuses): the layouts of the Llama family
# (Llama, Mistral, Qwen2, Qwen3 and others) that transformers uses.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Shared:
    """What a group's members share: the fused weight and bias, and the columns the first
    member computed for the others (`pending`, taken once each, with the input they came from)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, widths: list[int]):
        self.weight, self.bias, self.widths = weight, bias, widths
        self.pending: list[torch.Tensor | None] = [None] * len(widths)
        self.pending_input: torch.Tensor | None = None


class FusedMember(nn.Module):
    """One projection of a fused group, with its own `weight` (and `bias`) parameters,
    views into the group's buffer: the state dict keeps its names and shapes."""

    def __init__(self, shared: _Shared, index: int, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.shared, self.index = shared, index
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared
        if self.index == 0:
            parts = nn.functional.linear(x, shared.weight, shared.bias).split(shared.widths, dim=-1)
            shared.pending, shared.pending_input = [None, *parts[1:]], x
            return parts[0]
        part = shared.pending[self.index]
        if part is None or shared.pending_input is not x:
            return nn.functional.linear(x, self.weight, self.bias)
        shared.pending[self.index] = None   # taken: the group keeps no activations past its use
        if all(p is None for p in shared.pending):
            shared.pending_input = None
        return part


def fuse_projections(model: nn.Module) -> int:
    """Fuse the projection groups of every module of `model` that has one (GROUPS) whose
    members are plain nn.Linear layers on the same inputs, all with or all without a bias.
    In place; the parameters' names and values stay as they were. Returns the groups fused."""
    fused = 0
    for module in list(model.modules()):
        for names in GROUPS:
            members = [getattr(module, name, None) for name in names]
            if not _fusable(members):
                continue
            with torch.no_grad():
                weight = torch.cat([m.weight for m in members])
                bias = None if members[0].bias is None else torch.cat([m.bias for m in members])
            widths = [m.out_features for m in members]
            if weight.is_cuda:   # read by captured graphs: a fixed address, never copied in at replay
                torch._dynamo.mark_static_address(weight)
                if bias is not None:
                    torch._dynamo.mark_static_address(bias)
            shared = _Shared(weight, bias, widths)
            start = 0
            for index, (name, width) in enumerate(zip(names, widths)):
                rows = slice(start, start + width)
                setattr(module, name, FusedMember(shared, index, weight[rows], None if bias is None else bias[rows]))
                start += width
            fused += 1
    return fused


def _fusable(members: list) -> bool:
    if not all(type(m) is nn.Linear for m in members):
        return False
    first = members[0]
    return all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
               and m.weight.device == first.weight.device and (m.bias is None) == (first.bias is None)
               for m in members)
