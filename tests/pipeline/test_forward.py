"""The shared forward pass: response logprobs projected chunk by chunk equal the whole-model
logits, gradients too (chunks recomputed in the backward pass), models that change their
logits after the output embedding take the whole-model path, and gradient checkpointing in
the trainable roles leaves the gradient as it was."""

from __future__ import annotations

import pytest
import torch

from pipeline.algorithms import logprobs_from_logits
from pipeline.models import load_causal_lm
from pipeline.roles import forward
from pipeline.roles.forward import response_logprobs
from pipeline.roles.training import Trainable, enable_checkpointing


def _batch(vocab: int, rows: int = 3, prompt: int = 5, response: int = 7):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (rows, prompt + response), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0    # a left-padded prompt
    return ids, mask, prompt


def _reference(model, ids, mask, prompt, temperature):
    """The definition: full logits of the whole model, columns P-1 .. L-2."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    return logprobs_from_logits(logits[:, prompt - 1:-1], ids[:, prompt:], temperature)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(forward, "LOGIT_CHUNK_TOKENS", 4)   # 21 response tokens: 6 chunks, the last short


def test_chunked_logprobs_and_gradients_equal_the_whole_model(tiny_model, small_chunks):
    model = load_causal_lm(tiny_model).eval()
    ids, mask, prompt = _batch(model.config.vocab_size)
    expected = _reference(model, ids, mask, prompt, 0.7)
    expected.sum().backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    got = response_logprobs(model, ids, mask, prompt, 0.7)
    assert forward._SEPARABLE[model] is True
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    got.sum().backward()
    for name, param in model.named_parameters():
        # Summation order differs (chunks): float32 rounding, ~1e-6 on gradients of size ~10.
        torch.testing.assert_close(param.grad, expected_grads[name], rtol=1e-5, atol=1e-5, msg=name)


def test_a_model_that_rescales_its_logits_takes_the_whole_model_path(tiny_model, small_chunks):
    model = load_causal_lm(tiny_model).eval()
    model.register_forward_hook(lambda module, args, out: setattr(out, "logits", out.logits * 3.0) or out)
    ids, mask, prompt = _batch(model.config.vocab_size)
    got = response_logprobs(model, ids, mask, prompt, 1.0)
    assert forward._SEPARABLE[model] is False
    torch.testing.assert_close(got, _reference(model, ids, mask, prompt, 1.0), rtol=0, atol=1e-6)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_gradient_checkpointing_leaves_the_gradient_unchanged(tiny_model, checkpointing):
    """The same optimizer step with and without recomputation: equal gradient norm and weights."""
    ids, mask, prompt = _batch(40)

    def loss(model, rows):
        logp = response_logprobs(model, ids[rows], mask[rows], prompt, 1.0)
        return -logp.mean(), {"rows": float(len(range(*rows.indices(len(ids)))))}

    results = []
    for enabled in (False, checkpointing):
        torch.manual_seed(0)
        trainable = Trainable(lambda: load_causal_lm(tiny_model), lr=1e-2, strategy="none", device="cpu",
                              gradient_checkpointing=enabled)
        stats = trainable.optimizer_step(lambda rows: rows, 3, loss, max_rows=2,  # rows 0:2, then 2:3
                                         tokens_per_row=ids.shape[1])
        results.append((stats["grad_norm"], [p.detach().clone() for p in trainable.model.parameters()]))
    (norm_a, params_a), (norm_b, params_b) = results
    assert norm_a == pytest.approx(norm_b, rel=1e-6)
    for a, b in zip(params_a, params_b):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    if checkpointing:  # the recompute really ran: blocks in checkpointing mode, dropout modules in eval
        layers = [m for m in trainable.model.modules() if getattr(m, "gradient_checkpointing", False) is True]
        assert layers and all(m.training for m in layers)
        assert not any(m.training for m in trainable.model.modules() if isinstance(m, torch.nn.Dropout))


@pytest.mark.slow
def test_a_compiled_model_trains_as_the_eager_one(tiny_model, monkeypatch):
    """compile_for_training (train.compile_model, on GPUs): compiled blocks and projection
    (Inductor on this CPU) compute the eager logprobs, entropies and gradients, packed, with
    checkpointing, over micro-batches of different shapes (dynamic: no compile per shape),
    projected in chunks (21-36 response tokens: several, the last short; the same size both
    ways, so the gradients sum in the same order)."""
    import torch._dynamo.utils

    monkeypatch.setattr(forward, "LOGIT_CHUNK_TOKENS", 8)
    monkeypatch.setattr(forward, "COMPILED_LOGIT_CHUNK_TOKENS", 8)

    results = []
    for compiled in (False, True):
        model = load_causal_lm(tiny_model).train()
        enable_checkpointing(model)
        if compiled:
            forward.compile_for_training(model)
        grads, scores = [], []
        for response in (7, 9, 12):
            ids, mask, prompt = _batch(model.config.vocab_size, response=response)
            model.zero_grad()
            logp, entropy = forward.response_logprobs_and_entropy(model, ids, mask, prompt, 0.7, entropy_grad=False,
                                                                  pack=True)
            (logp * mask[:, prompt:]).sum().backward()
            scores.append((logp.detach(), entropy))
            grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            if compiled and response == 9:
                graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        results.append((scores, grads))
        assert (model in forward._COMPILED) == compiled
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "a new length must not recompile"
    (eager_scores, eager_grads), (compiled_scores, compiled_grads) = results
    for (a_logp, a_entropy), (b_logp, b_entropy) in zip(eager_scores, compiled_scores):
        torch.testing.assert_close(b_logp, a_logp, rtol=0, atol=1e-5)
        torch.testing.assert_close(b_entropy, a_entropy, rtol=0, atol=1e-5)
    for a, b in zip(eager_grads, compiled_grads):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_the_actor_warm_up_compiles_its_update_and_leaves_its_state(tiny_model):
    """ActorRole.warm_up, which the trainer asks for at start: only GPUs compile the actor
    (train.compile_model), so its compiled state is set up here by hand, on this CPU. After the
    warm-up the update's forwards and backwards, at other lengths, compile nothing new, and the
    weights, gradients and optimizer state are as they were."""
    import torch._dynamo.utils

    from pipeline.roles.actor import ActorRole

    role = ActorRole(tiny_model, device="cpu", lr=1e-2, strategy="none", gradient_checkpointing=True)
    assert role.warm_up(0.7, entropy_grad=False, pack=True, proximal=False) is None   # nothing compiled here
    model = role.trainer.model
    role.trainer.compile_model = True   # what Trainable does on a GPU
    forward.compile_for_training(model)
    before = [p.detach().clone() for p in model.parameters()]
    compiled_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert role.warm_up(0.7, entropy_grad=False, pack=True, proximal=False) > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > compiled_before   # it compiled
    assert all(p.grad is None for p in model.parameters()) and not role.trainer.optimizer.state
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for response in (300, 700):   # two updates' micro-batches
        ids, mask, prompt = _batch(model.config.vocab_size, rows=3, prompt=24, response=response)

        def loss(model, rows):
            logp, _ = forward.response_logprobs_and_entropy(model, ids[rows], mask[rows], prompt, 0.7,
                                                            entropy_grad=False, pack=True)
            return -logp.mean(), {}

        stats = role.trainer.optimizer_step(lambda rows: rows, 3, loss, max_rows=3, tokens_per_row=ids.shape[1])
        assert stats["grad_norm"] > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "the update compiled again"



def test_a_hook_on_the_head_added_later_counts(tiny_model, small_chunks):
    """The projection calls the head: a forward hook added after the model's first forward
    (its path already chosen) still shapes the logprobs, as it does the model's own logits."""
    model = load_causal_lm(tiny_model).eval()
    ids, mask, prompt = _batch(model.config.vocab_size)
    response_logprobs(model, ids, mask, prompt, 1.0)
    assert forward._SEPARABLE[model] is True
    hook = model.lm_head.register_forward_hook(lambda module, args, logits: logits * 3.0)
    try:
        got = response_logprobs(model, ids, mask, prompt, 1.0)
        torch.testing.assert_close(got, _reference(model, ids, mask, prompt, 1.0), rtol=0, atol=1e-5)
    finally:
        hook.remove()
