"""Continuous batching in the cuda_graph engine (pipeline/engines/continuous.py), eagerly on CPU:
slots refilled from the queue, a ring that wraps, the tail moved into fewer slots; every
logprob still equals the actor's forward on the same tokens."""

from __future__ import annotations

import pytest
import torch

from pipeline.engines import continuous
from pipeline.engines.continuous import SlotRun
from pipeline.engines.prefill import prefill_mask
from pipeline.engines.cuda_graph import CudaGraphEngine
from pipeline.models import load_causal_lm, load_tokenizer
from pipeline.records import GenerationRequest
from pipeline.roles.forward import response_logprobs


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):
    return load_causal_lm(tiny_model), load_tokenizer(tiny_model)


def _request(tokenizer, prompts, samples, new_tokens, seed=3):
    ids = [tokenizer(f"what is {i} plus {i * 7}? answer: ")["input_ids"][: 8 + i % 9] for i in range(prompts)]
    return GenerationRequest(ids, list(range(prompts)), samples, new_tokens, 1.0, seed)


def _eos_bias(model, eos: int, bias: float):
    def raise_eos(module, args, logits):
        logits[..., eos] += bias
        return logits
    return model.lm_head.register_forward_hook(raise_eos)


def _check_against_the_actor(model, request, rollout, eos):
    expected = response_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.prompt_length,
                                 1.0) * rollout.response_mask
    torch.testing.assert_close(rollout.behavior_logprobs, expected, atol=2e-5, rtol=0)
    for row, prompt in enumerate(p for p in request.prompt_ids for _ in range(request.samples_per_prompt)):
        assert rollout.input_ids[row, rollout.prompt_length - len(prompt):rollout.prompt_length].tolist() == prompt
    # Each row ends at its first EOS or at max_new_tokens, never before.
    lengths = rollout.response_mask.sum(-1).long()
    for row, length in enumerate(lengths.tolist()):
        ids = rollout.responses[row, :length].tolist()
        assert (ids[-1] == eos) != bool(rollout.clipped[row]) and eos not in ids[:-1]
    return lengths


def test_slots_take_waiting_sequences_through_a_wrapping_ring(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    eos = tokenizer.eos_token_id
    engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=eos, device="cpu", max_batch_size=8,
                             prompt_bucket=16)
    # 64 sequences through 8 slots; prompts (8-16 tokens) pad to 16 and responses stop by 12,
    # so the ring has 28 columns, which the request's decode steps wrap several times.
    request = _request(tokenizer, prompts=16, samples=4, new_tokens=12)
    hook = _eos_bias(model, eos, 2.5)
    try:
        rollout = engine.generate(request, policy_version=0)
        lengths = _check_against_the_actor(model, request, rollout, eos)   # under the same bias
    finally:
        hook.remove()
    assert len(rollout) == 64
    assert lengths.min() < 6 and lengths.max() == 12, "lengths should spread: some end early, some run out"
    stats = engine.last_stats
    assert stats["slots"] == 8 and stats["tokens"] == int(lengths.sum())
    assert stats["decode_steps"] > 28, "the ring should have wrapped"
    # A static batch of 8 would take 8 batches x the longest row each; refilled slots do not.
    assert stats["decode_steps"] < 8 * 12
    assert stats["slot_use"] > 0.5


@pytest.mark.parametrize("fewest_slots", [None, 32])
def test_the_tail_moves_into_fewer_slots(model_and_tokenizer, fewest_slots):
    """Down to 8 slots eagerly; down to `fewest_slots` where each count is a graph to compile."""
    model, tokenizer = model_and_tokenizer
    eos = tokenizer.eos_token_id
    engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=eos, device="cpu", max_batch_size=64,
                             fewest_slots=fewest_slots)
    request = _request(tokenizer, prompts=16, samples=4, new_tokens=40)   # 64 sequences, 64 slots
    hook = _eos_bias(model, eos, 1.5)
    try:
        rollout = engine.generate(request, policy_version=0)
        lengths = _check_against_the_actor(model, request, rollout, eos)
    finally:
        hook.remove()
    assert lengths.float().mean() < 15 and lengths.max() > 30, "long-tailed lengths"
    # Each time at most half the slots were live, they moved into a cache of fewer (a power of
    # two, at least 8 or fewest_slots): 64 -> 32 -> 16 -> 8 here, or 64 -> 32.
    counts = [8, 16, 32, 64] if fewest_slots is None else [32, 64]
    assert sorted(slots for slots, _ in engine._caches) == counts
    # The smaller caches are the first rows of the 64-slot one: one allocation for the ring.
    caches = {slots: cache for (slots, _), cache in engine._caches.items()}
    smaller = counts[:-1]
    assert [caches[slots].keys[0].data_ptr() for slots in smaller] == [caches[64].keys[0].data_ptr()] * len(smaller)
    assert [caches[slots].nbytes for slots in smaller] == [0] * len(smaller) and caches[64].nbytes > 0
    assert sorted(engine.last_stats["step_ms"]) == counts
    assert all(ms > 0 for ms in engine.last_stats["step_ms"].values())
    assert sum(engine.last_stats["decode_steps_at"].values()) == engine.last_stats["decode_steps"]


def test_slot_run_reports_use_and_refills_in_groups(model_and_tokenizer):
    """A freed slot waits for a sixteenth of the slots to be free before a prefill (one prefill
    serves several), and the sequences' first tokens come from that prefill."""
    model, tokenizer = model_and_tokenizer
    eos = tokenizer.eos_token_id
    engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=eos, device="cpu", max_batch_size=32)
    request = _request(tokenizer, prompts=24, samples=4, new_tokens=10)   # 96 sequences, 32 slots
    prefills = []
    original = SlotRun._refill

    def counting(run, free):
        prefills.append(min(len(free), len(run.queue)))
        return original(run, free)

    SlotRun._refill = counting
    hook = _eos_bias(model, eos, 2.0)
    try:
        rollout = engine.generate(request, policy_version=0)
        _check_against_the_actor(model, request, rollout, eos)
    finally:
        SlotRun._refill = original
        hook.remove()
    assert prefills[0] == 32 and sum(prefills) == 96
    assert all(count >= 2 for count in prefills[1:-1]), prefills


@pytest.mark.slow
def test_the_compiled_decode_step_serves_refills_and_a_second_request(tiny_model):
    """torch.compile traces the decode step with its slot cache (Inductor on the CPU here; on
    a GPU the same graph is captured as a CUDA graph, `-m gpu`): logprobs still equal the
    actor's, and a second request of the same shapes compiles nothing new."""
    import torch._dynamo.utils

    model, tokenizer = load_causal_lm(tiny_model), load_tokenizer(tiny_model)
    eos = tokenizer.eos_token_id
    engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=eos, device="cpu", compile=True,
                             max_batch_size=16)
    hook = _eos_bias(model, eos, 2.0)
    try:
        engine.generate(_request(tokenizer, prompts=16, samples=4, new_tokens=24, seed=1), 0)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        request = _request(tokenizer, prompts=16, samples=4, new_tokens=24, seed=2)
        rollout = engine.generate(request, 0)
        _check_against_the_actor(model, request, rollout, eos)
    finally:
        hook.remove()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert engine.last_stats["slots"] == 16 and engine.last_stats["tokens"] == int(rollout.response_mask.sum())


@pytest.mark.slow
def test_compiled_prefill_passes_give_the_eager_ones_sequences(tiny_model, monkeypatch):
    """cuda_graph_args.compile_prefill: the prefill passes through torch.compile (dynamic
    shapes; Inductor on the CPU here) sample the same first tokens as eagerly, over passes of
    different widths and sizes, and the logprobs still equal the actor's."""
    model, tokenizer = load_causal_lm(tiny_model), load_tokenizer(tiny_model)
    eos = tokenizer.eos_token_id
    monkeypatch.setattr(continuous, "PREFILL_PASS_TOKENS", 3 * 16)   # several passes, the last short
    request = _request(tokenizer, prompts=8, samples=2, new_tokens=6)
    rollouts = []
    for compiled in (False, True):
        engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=eos, device="cpu", max_batch_size=16,
                                 prompt_bucket=16, compile_prefill=compiled)
        rollouts.append(engine.generate(request, policy_version=0))
        assert engine.last_stats["prefill_passes"] == 3   # 8 distinct prompts, 3 a pass
    assert torch.equal(rollouts[0].input_ids, rollouts[1].input_ids)
    torch.testing.assert_close(rollouts[1].behavior_logprobs, rollouts[0].behavior_logprobs, atol=2e-5, rtol=0)
    _check_against_the_actor(model, request, rollouts[1], eos)


def test_fewer_slots_live_within_the_rings_largest_cache(model_and_tokenizer):
    """Caches of fewer slots over one ring are views of its largest; a larger one replaces
    them; moving rows between two caches that share storage moves the right rows."""
    model, tokenizer = model_and_tokenizer
    engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, device="cpu")
    small = engine._cache(16, 40)
    assert small.nbytes > 0
    large = engine._cache(64, 40)
    assert sorted(engine._caches) == [(64, 40)], "the 16-slot cache had its own storage: replaced"
    within = engine._cache(16, 40)
    assert within.nbytes == 0 and within.keys[0].data_ptr() == large.keys[0].data_ptr()
    other_ring = engine._cache(8, 72)
    assert other_ring.nbytes > 0, "another ring length is another allocation"
    for layer, tensor in enumerate(large.keys):
        tensor.copy_(torch.arange(64, dtype=tensor.dtype).view(64, 1, 1, 1) + 1000 * layer)
    within.take_rows(large, torch.tensor([63, 5, 0, 40] + list(range(20, 32))))
    assert large.keys[1][:4, 0, 0, 0].tolist() == [1063, 1005, 1000, 1040]
    assert large.keys[1][4:16, 0, 0, 0].tolist() == [1000 + row for row in range(20, 32)]
    assert large.keys[1][16:, 0, 0, 0].tolist() == [1000 + row for row in range(16, 64)], "rows past 16 kept"


def test_the_prefill_mask_is_causal_over_real_keys():
    """Hand-computed: a prompt with one padding position, one without."""
    mask = prefill_mask(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert mask.shape == (2, 1, 3, 3)
    assert mask[0, 0].int().tolist() == [[1, 1, 1],    # padding: no real key yet, so every key
                                         [0, 1, 0],    # (finite; its output is never read)
                                         [0, 1, 1]]
    assert mask[1, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


def test_acting_on_the_last_look_serves_the_same_sequences(model_and_tokenizer, monkeypatch):
    """Refills and moves decided from the look before (the default) against the present:
    every sequence still ends at its first EOS or its limit with the actor's logprobs, and
    the late looks cost a bounded share of decode steps. The two ways sample different
    sequences (a slot draws its tokens at other steps), so the steps are summed over four
    requests: here responses of about 11 tokens, where a refill one look (4 steps) late
    costs most, take about a quarter more steps."""
    model, tokenizer = model_and_tokenizer
    eos = tokenizer.eos_token_id
    steps = {False: 0, True: 0}
    hook = _eos_bias(model, eos, 1.5)
    try:
        for seed in (3, 4, 5, 6):
            request = _request(tokenizer, prompts=16, samples=4, new_tokens=40, seed=seed)
            for lagged in (False, True):
                monkeypatch.setattr(continuous, "LAGGED_LOOKS", lagged)
                engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=eos, device="cpu",
                                         max_batch_size=16, check_every=4)
                rollout = engine.generate(request, policy_version=0)
                _check_against_the_actor(model, request, rollout, eos)
                steps[lagged] += engine.last_stats["decode_steps"]
    finally:
        hook.remove()
    assert steps[False] <= steps[True] <= steps[False] * 1.4, steps


def test_prefill_passes_hold_at_most_prefill_pass_tokens(model_and_tokenizer, monkeypatch):
    """A request whose prompts fill more than PREFILL_PASS_TOKENS prefills in several passes
    (the memory a pass takes stays reserved), with the same sequences as in one pass."""
    model, tokenizer = model_and_tokenizer
    request = _request(tokenizer, prompts=8, samples=2, new_tokens=6)
    rollouts, passes = [], []
    for cap in (10_000, 2 * 16):   # all 8 distinct prompts (16-token bucket) in one pass; two a pass
        monkeypatch.setattr(continuous, "PREFILL_PASS_TOKENS", cap)
        engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, device="cpu",
                                 max_batch_size=16, prompt_bucket=16)
        rollouts.append(engine.generate(request, policy_version=0))
        passes.append(engine.last_stats["prefill_passes"])
        assert engine.last_stats["prefill_tokens"] <= passes[-1] * cap
    assert passes == [1, 4]
    assert torch.equal(rollouts[0].input_ids, rollouts[1].input_ids)
    torch.testing.assert_close(rollouts[1].behavior_logprobs, rollouts[0].behavior_logprobs, atol=2e-5, rtol=0)


def test_a_prompt_shared_by_a_groups_samples_is_prefilled_once(model_and_tokenizer, monkeypatch):
    """12 prompts x 4 samples through 16 slots: each refill computes a prompt once for all of
    its samples waiting then, and stores its keys and values into each of their slots. The
    sequences and logprobs are those of a prefill of every row, and the actor's."""
    model, tokenizer = model_and_tokenizer
    eos = tokenizer.eos_token_id
    request = _request(tokenizer, prompts=12, samples=4, new_tokens=10)
    rollouts, stats = {}, {}
    hook = _eos_bias(model, eos, 1.5)
    try:
        for sharing in (True, False):
            if not sharing:   # every row its own prefix: the prefill of each row
                monkeypatch.setattr(continuous, "distinct_prefixes", lambda rows: [[i] for i in range(len(rows))])
            engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=eos, device="cpu",
                                     max_batch_size=16, prompt_bucket=16, check_every=2)
            rollouts[sharing] = engine.generate(request, policy_version=0)
            stats[sharing] = engine.last_stats
        _check_against_the_actor(model, request, rollouts[True], eos)
    finally:
        hook.remove()
    assert torch.equal(rollouts[True].input_ids, rollouts[False].input_ids)
    torch.testing.assert_close(rollouts[True].behavior_logprobs, rollouts[False].behavior_logprobs, atol=2e-5, rtol=0)
    # The first refill takes the first 16 sequences: 4 prompts x 4 samples, 4 rows computed.
    # Later refills take what waits then, often part of a group; every row computed is a prompt
    # at least one sequence needed, so rows computed + rows that shared one = 48.
    assert stats[False]["prefill_shared"] == 0 and stats[False]["prefill_tokens"] == 48 * 16
    shared = stats[True]["prefill_shared"]
    assert stats[True]["prefill_tokens"] == (48 - shared) * 16
    assert 12 <= shared <= 36, stats[True]
    assert stats[True]["prefill_ms"] > 0 and stats[False]["prefill_ms"] > 0   # the passes' clock ran


def test_the_decode_kernel_leaves_a_cpu_engine_on_sdpa(model_and_tokenizer):
    """decode_attention "kernel" (the default): a CPU engine finds the Triton kernel unusable
    (no CUDA) and samples exactly what it samples with "sdpa"."""
    from pipeline.engines import decode_kernel

    model, tokenizer = model_and_tokenizer
    request = _request(tokenizer, prompts=4, samples=2, new_tokens=12)
    rollouts = []
    for attention in ("sdpa", "kernel"):
        engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                                 device="cpu", max_batch_size=8, decode_attention=attention)
        rollouts.append(engine.generate(request, policy_version=0))
    assert not decode_kernel.prepare("cpu")
    assert torch.equal(rollouts[0].input_ids, rollouts[1].input_ids)
    assert torch.equal(rollouts[0].behavior_logprobs, rollouts[1].behavior_logprobs)


def test_a_decode_kernel_that_fails_gives_way_to_sdpa(model_and_tokenizer, monkeypatch):
    """Where the Triton kernel fails (here it is taken to apply on a CPU, whose install never
    defined its op, so the call fails inside decode_kernel.py), the engine reports it, decodes
    with SDPA from then on and serves the request: the rollout of an engine set to SDPA."""
    from pipeline.engines import decode_kernel
    from resources.allocator import KERNEL_FAILED, reported

    model, tokenizer = model_and_tokenizer
    request = _request(tokenizer, prompts=4, samples=2, new_tokens=12)
    options = dict(pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, device="cpu", max_batch_size=8)
    expected = CudaGraphEngine(model, decode_attention="sdpa", **options).generate(request, policy_version=0)
    monkeypatch.setattr(decode_kernel, "usable", lambda query, key_cache: True)
    engine = CudaGraphEngine(model, **options)   # decode_attention "kernel", the default
    before = len(reported())
    rollout = engine.generate(request, policy_version=0)
    (failure,) = reported()[before:]
    assert failure.cause == KERNEL_FAILED and (failure.before, failure.after) == (1, 0)
    assert "decode_attention: sdpa" in failure.detail and "slot_decode_attention" in failure.detail
    assert not engine.attention_kernel
    assert torch.equal(rollout.input_ids, expected.input_ids)
    assert torch.equal(rollout.behavior_logprobs, expected.behavior_logprobs)
    engine.generate(request, policy_version=0)   # on SDPA from the start now: nothing new to report
    assert len(reported()) == before + 1


def test_a_sliding_window_shorter_than_a_sequence_is_refused(tmp_path):
    """The slots attend over whole sequences: a model that attends to fewer tokens is told
    to use another engine, not served something else."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=48,
                         max_window_layers=0)
    engine = CudaGraphEngine(Qwen2ForCausalLM(config).eval(), pad_id=0, eos_id=1, device="cpu", max_batch_size=8,
                             prompt_bucket=16)
    with pytest.raises(ValueError, match="last 48 tokens only.*Fix: set the rollout role's strategy to hf or vllm"):
        engine.generate(GenerationRequest([[5, 6, 7]], [0], 2, 40, 1.0, 0), 0)   # 16 + 40 tokens
    assert len(engine.generate(GenerationRequest([[5, 6, 7]], [0], 2, 32, 1.0, 0), 0)) == 2   # 16 + 32: served
