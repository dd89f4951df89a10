"""Packed forwards on a real GPU (`pytest -m gpu`): Qwen2-0.5B's shape in bf16 with random
weights scores long-tailed responses packed as it does padded, within bf16 rounding, with
whatever attention kernel transformers picks there (sdpa, or flash-attention's varlen); and
`micro_batch_size: auto` follows a real memory cap."""

from __future__ import annotations

import pytest
import torch

from benchmarks.shapes import geometric_lengths, padded_rows, qwen2_05b_config, share_prompts
from pipeline.packing import plan_packing
from pipeline.roles.forward import response_logprobs, response_values

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

PROMPT, RESPONSE, ROWS = 128, 1024, 24


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(qwen2_05b_config()).to("cuda", torch.bfloat16).eval()


@pytest.fixture(scope="module")
def rows(model):
    responses = geometric_lengths(ROWS, 215.0, RESPONSE, seed=1)
    responses[0] = RESPONSE                      # one row at the cap: the longest packed sequence
    prompts = [PROMPT - (row % 5) * 7 for row in range(ROWS)]   # some left padding too
    ids, mask = padded_rows(prompts, responses, model.config.vocab_size, prompt_width=PROMPT,
                            response_width=RESPONSE)
    return ids.cuda(), mask.cuda()


@torch.no_grad()
def _in_chunks(fn, ids, mask, rows: int = 8) -> torch.Tensor:
    return torch.cat([fn(ids[start:start + rows], mask[start:start + rows]).float()
                      for start in range(0, ids.shape[0], rows)])


def test_packed_logprobs_match_padded_in_bf16(model, rows):
    ids, mask = rows
    padded = _in_chunks(lambda i, m: response_logprobs(model, i, m, PROMPT, 1.0), ids, mask)
    packed = _in_chunks(lambda i, m: response_logprobs(model, i, m, PROMPT, 1.0, pack=True), ids, mask)
    real = mask[:, PROMPT:].bool()
    diff = (packed - padded)[real].abs()
    plan = plan_packing(mask.sum(-1).tolist())
    print(f"attention {model.config._attn_implementation}: packed vs padded logprobs over {int(real.sum())} "
          f"tokens: mean abs diff {diff.mean():.4f}, max {diff.max():.4f}; computed/real tokens packed "
          f"{plan.computed_tokens / plan.real_tokens:.3f}, padded {ids.numel() / plan.real_tokens:.2f}")
    assert diff.mean() < 0.02 and diff.max() < 0.5
    assert (packed[~real] == 0).all()


def test_packed_values_match_padded_in_bf16(model, rows):
    from pipeline.models import ValueModel

    critic = ValueModel.__new__(ValueModel)      # the role's class around this body, without a checkpoint
    torch.nn.Module.__init__(critic)
    critic.body = model.model
    critic.head = torch.nn.Linear(model.config.hidden_size, 1, device="cuda", dtype=torch.bfloat16)
    ids, mask = rows
    padded = _in_chunks(lambda i, m: response_values(critic, i, m, PROMPT), ids, mask)
    packed = _in_chunks(lambda i, m: response_values(critic, i, m, PROMPT, pack=True), ids, mask)
    real = mask[:, PROMPT:].bool()
    diff = (packed - padded)[real].abs()
    print(f"packed vs padded values: mean abs diff {diff.mean():.4f}, max {diff.max():.4f} "
          f"(values' mean size {padded[real].abs().mean():.3f})")
    assert diff.mean() < 0.02 * max(1.0, float(padded[real].abs().mean()))


def test_auto_micro_batches_follow_a_memory_cap(model):
    """`micro_batch_size: auto` under a real cap (torch's per-process memory fraction): the cap
    leaves the extra memory the uncapped step took in one micro-batch, so the token budget
    (0.8 of what is free) falls below the batch's tokens and the step runs in more micro-batches
    without failing; once the cap is lifted the budget is back (within a tenth: free memory
    moves). Gradient checkpointing is off so that activations, which a smaller micro-batch
    shrinks, outweigh what it does not (the gradients and the vocabulary projection of the
    longest row: ~2 GiB on this shape): with checkpointing on, one row did not fit under a
    cap of 90% of the step's extra memory on an H100."""
    import copy

    from benchmarks.packed_update import experience, run
    from pipeline.roles.training import Trainable

    trainable = Trainable(lambda: copy.deepcopy(model).train(), lr=1e-6, strategy="none", device="cuda",
                          gradient_checkpointing=False, role_name="actor")
    batch = experience(64, PROMPT, RESPONSE, 215.0, model.config.vocab_size, seed=2)
    run(trainable, batch, "auto", True)                 # measures the bytes a token takes
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    roomy = run(trainable, batch, "auto", True)
    extra = roomy["peak_gib"] * 2**30 - before
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + extra) / total)
    try:
        capped = run(trainable, batch, "auto", True)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    again = run(trainable, batch, "auto", True)
    print(f"auto micro-batches: free memory {roomy['token_budget']} tokens a micro-batch, "
          f"{roomy['micro_batches']} micro-batches, {extra / 2**30:.2f} GiB over the {before / 2**30:.2f} GiB "
          f"held; capped there {capped['token_budget']} tokens, {capped['micro_batches']} micro-batches, "
          f"peak {capped['peak_gib']:.2f} GiB; uncapped again {again['token_budget']} tokens")
    assert roomy["micro_batches"] == 1, roomy   # the batch fits once with the memory free: the cap must split it
    assert capped["token_budget"] < roomy["token_budget"] and capped["micro_batches"] > roomy["micro_batches"]
    assert capped["computed_tokens"] >= capped["real_tokens"]   # every row ran
    assert again["token_budget"] >= 0.9 * roomy["token_budget"]


def test_a_compiled_actor_step_matches_the_eager_one(model):
    """train.compile_model on the 0.5B shape: one packed actor step with compiled blocks and
    projection gives the eager step's loss, entropy and gradient norm within bf16 rounding
    (the fused kernels round differently), and its second step compiles nothing new."""
    import copy

    import torch._dynamo.utils

    from benchmarks.packed_update import experience, run
    from pipeline.roles.training import Trainable

    batch = experience(32, PROMPT, RESPONSE, 215.0, model.config.vocab_size, seed=3)
    results = {}
    for compiled in (False, True):
        trainable = Trainable(lambda: copy.deepcopy(model).train(), lr=1e-6, strategy="none", device="cuda",
                              gradient_checkpointing=True, compile_model=compiled, role_name="actor")
        results[compiled] = run(trainable, batch, "auto", True)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        second = run(trainable, batch, "auto", True)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
        results[compiled]["second_seconds"] = second["seconds"]
        del trainable
        torch.cuda.empty_cache()
    eager, compiled = results[False], results[True]
    print(f"compiled actor step: {compiled['second_seconds']:.2f} s against {eager['second_seconds']:.2f} s eager; "
          f"grad norm {compiled['grad_norm']:.4f} / {eager['grad_norm']:.4f}, policy loss "
          f"{compiled['policy_loss']:.5f} / {eager['policy_loss']:.5f}, entropy sum "
          f"{compiled['entropy_sum']:.1f} / {eager['entropy_sum']:.1f}")
    assert compiled["grad_norm"] == pytest.approx(eager["grad_norm"], rel=0.02)
    assert compiled["policy_loss"] == pytest.approx(eager["policy_loss"], rel=0.02, abs=1e-4)
    assert compiled["entropy_sum"] == pytest.approx(eager["entropy_sum"], rel=0.01)


def test_shared_prompts_match_padded_in_bf16(model, rows):
    """train.share_prompts on a GPU: groups of four rows with one prompt each run as one
    sequence per group, attended in the two dense tiles a layer, forward and backward, and
    give the padded rows' logprobs and gradients within bf16 rounding."""
    import copy

    from pipeline.packing import SHARED_PROMPTS, pack_shared_prompts
    from pipeline.roles.forward import choose_packing

    ids, mask = share_prompts(*rows, PROMPT, 4)
    shared_model = copy.deepcopy(model).train()
    assert choose_packing(shared_model, True, True) == SHARED_PROMPTS
    padded_model = copy.deepcopy(model).train()
    chunk = slice(0, 8)
    real = mask[chunk, PROMPT:].bool()
    padded = response_logprobs(padded_model, ids[chunk], mask[chunk], PROMPT, 1.0)
    shared = response_logprobs(shared_model, ids[chunk], mask[chunk], PROMPT, 1.0, pack=SHARED_PROMPTS)
    diff = (shared.float() - padded.float())[real].abs()
    plan = pack_shared_prompts(ids[chunk], mask[chunk], PROMPT).plan
    print(f"shared prompts vs padded logprobs over {int(real.sum())} tokens: mean abs diff "
          f"{diff.mean():.4f}, max {diff.max():.4f}; computed tokens {plan.computed_tokens} against "
          f"{int(mask[chunk].sum())} real ones unshared")
    assert diff.mean() < 0.02 and diff.max() < 0.5
    assert (shared[~real] == 0).all()
    padded[real].sum().backward()
    shared[real].sum().backward()
    for (name, a), b in zip(padded_model.named_parameters(), shared_model.parameters()):
        cosine = torch.nn.functional.cosine_similarity(a.grad.float().flatten(), b.grad.float().flatten(), dim=0)
        assert cosine > 0.99, (name, float(cosine))
