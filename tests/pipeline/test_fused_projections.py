"""Fused projections in the rollout engine (pipeline/engines/fused_projections.py), on CPU:
the same outputs as the model's own layers, new weights reaching the fused buffers through
the engine's load_state_dict, and one graph for Dynamo."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from pipeline.engines.cuda_graph import CudaGraphEngine
from pipeline.engines.fused_projections import FusedMember, fuse_projections
from pipeline.records import GenerationRequest

CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    plain = Qwen2ForCausalLM(Qwen2Config(**CONFIG)).eval()
    return plain, copy.deepcopy(plain)


def test_a_fused_model_keeps_its_parameters_and_outputs(models):
    plain, fused = models
    names = [name for name, _ in plain.named_parameters(remove_duplicate=False)]
    # Qwen2: query/key/value (with biases) and gate/up, in each of the 2 layers
    assert fuse_projections(fused) == 4
    attention = fused.model.layers[0].self_attn
    assert isinstance(attention.k_proj, FusedMember)
    # the parameters are views into one buffer a group: q's rows, then k's, then v's
    shared = attention.q_proj.shared
    assert shared.weight.shape == (32 + 16 + 16, 32) and shared.bias.shape == (64,)
    assert attention.v_proj.weight.data_ptr() == shared.weight[48:].data_ptr()
    assert [name for name, _ in fused.named_parameters(remove_duplicate=False)] == names
    ids = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, plain(ids).logits, atol=1e-6, rtol=0)
        # nothing is held between forwards: the handed-over columns were all taken
        assert shared.pending == [None, None, None] and shared.pending_input is None
        # one graph for Dynamo, as the engine's captured decode step needs
        compiled = torch.compile(fused, backend="eager", fullgraph=True)
        torch.testing.assert_close(compiled(ids).logits, plain(ids).logits, atol=1e-6, rtol=0)


def test_a_member_called_out_of_turn_computes_its_own_product():
    """k before q, or on another input than q's: each still gets x @ W_k^T + b_k."""
    torch.manual_seed(2)
    holder = nn.Module()
    holder.q_proj, holder.k_proj, holder.v_proj = nn.Linear(8, 6), nn.Linear(8, 4), nn.Linear(8, 4)
    expected = {name: copy.deepcopy(getattr(holder, name)) for name in ("q_proj", "k_proj", "v_proj")}
    assert fuse_projections(holder) == 1
    x, y = torch.randn(5, 8), torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(holder.k_proj(x), expected["k_proj"](x))   # before q
        torch.testing.assert_close(holder.q_proj(x), expected["q_proj"](x))
        torch.testing.assert_close(holder.v_proj(y), expected["v_proj"](y))   # another input than q's
        torch.testing.assert_close(holder.k_proj(x), expected["k_proj"](x))   # q's columns for k


def test_layers_that_differ_are_left_alone():
    holder = nn.Module()
    holder.gate_proj, holder.up_proj = nn.Linear(8, 6, bias=False), nn.Linear(8, 6, bias=True)
    assert fuse_projections(holder) == 0 and type(holder.up_proj) is nn.Linear


def test_new_weights_reach_the_fused_engine(models):
    """The engine fuses its model; weights loaded afterwards (a policy sync) are sampled
    from exactly as by an engine over an unfused copy of them."""
    plain, _ = models
    torch.manual_seed(3)
    newer = Qwen2ForCausalLM(Qwen2Config(**CONFIG)).eval()
    fused_engine = CudaGraphEngine(copy.deepcopy(plain), pad_id=0, eos_id=1, device="cpu", max_batch_size=8)
    fused_engine.load_state_dict(newer.state_dict())
    plain_engine = CudaGraphEngine(newer, pad_id=0, eos_id=1, device="cpu", max_batch_size=8,
                                   fuse_projections=False)
    assert not any(isinstance(m, FusedMember) for m in newer.modules())
    request = GenerationRequest([[5, 6, 7, 8], [9, 10]], [0, 1], 3, 12, 1.0, 4)
    first, second = fused_engine.generate(request, 1), plain_engine.generate(request, 1)
    assert torch.equal(first.input_ids, second.input_ids)
    torch.testing.assert_close(first.behavior_logprobs, second.behavior_logprobs, atol=1e-5, rtol=0)
