"""Packed grouped-query decode attention (pipeline/engines/gqa_decode.py), as the cuda_graph
engine's attention (slots.slot_attention) runs it for a forward without a slot cache: the
logits of a left-padded prefill and decode steps over a StaticCache equal transformers' eager
attention, and each decode step attends to the cache's own KV heads, never a per-query-head
copy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.engines import slots
from tests.conftest import cache_keyword


def _model(attention: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                         attn_implementation=attention)
    return Qwen2ForCausalLM(config).eval()


def _decode(model, steps: int = 6) -> torch.Tensor:
    """Greedy decoding of 3 left-padded prompts over a StaticCache: (steps + 1, 3, V) logits."""
    from transformers import StaticCache

    prompt, length = 9, 9 + steps + 2
    ids = torch.randint(2, 300, (3, prompt), generator=torch.Generator().manual_seed(1))
    attention = torch.zeros(3, length, dtype=torch.long)
    attention[:, :prompt] = 1
    attention[1, :4] = 0   # row 1 is a shorter prompt, left-padded
    cache = {cache_keyword(model): StaticCache(config=model.config, max_cache_len=length)}
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention, **cache, use_cache=True,
                       position_ids=(attention[:, :prompt].cumsum(-1) - 1).clamp(min=0),
                       cache_position=torch.arange(prompt)).logits[:, -1]
        out = [logits]
        for t in range(steps):
            attention[:, prompt + t] = 1
            logits = model(input_ids=logits.argmax(-1)[:, None], attention_mask=attention, **cache,
                           use_cache=True, position_ids=attention.sum(-1, keepdim=True) - 1,
                           cache_position=torch.tensor([prompt + t])).logits[:, -1]
            out.append(logits)
    return torch.stack(out)


def test_packed_decode_equals_eager_attention_and_reads_the_cache_as_stored(monkeypatch):
    reference = _decode(_model("eager"))
    model = _model("sdpa")
    slots.use_slot_attention(model)
    assert model.config._attn_implementation == slots.NAME

    shapes = []
    sdpa = F.scaled_dot_product_attention

    def recording(query, key, value, **kwargs):
        shapes.append((tuple(query.shape), tuple(key.shape)))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    packed = _decode(model)
    torch.testing.assert_close(packed, reference, atol=1e-5, rtol=0)
    decode_calls = [s for s in shapes if s[0][2] == 4]   # the 4 query heads of a KV head, one token
    # 6 decode steps x 2 layers, each against the cache's 2 KV heads (a repeat would give 8).
    assert len(decode_calls) == 12
    assert all(q == (3, 2, 4, 16) and k[1] == 2 for q, k in decode_calls)


def test_a_model_loaded_with_eager_attention_switches_too():
    model = _model("eager")
    reference = _decode(model)
    slots.use_slot_attention(model)
    assert model.config._attn_implementation == slots.NAME
    torch.testing.assert_close(_decode(model), reference, atol=1e-5, rtol=0)
