"""Out-of-memory protection of the no-grad passes and the rollout engines, on CPU.

The out-of-memory errors are real torch.OutOfMemoryError raised inside the model's own
forward (a hook on the input embedding raises from a given number of rows up), so they take
the code path a GPU allocation failure takes. Results must not depend on the split; every
degradation is a log line and, through a real trainer on worker processes, a count in the
step's record."""

from __future__ import annotations

import functools
import sys
from types import SimpleNamespace

import cloudpickle
import pytest
import torch

from pipeline.engines import budget, continuous, cuda_graph
from pipeline.engines.cuda_graph import CudaGraphEngine
from pipeline.engines.hf import HFEngine
from pipeline.models import load_causal_lm, load_tokenizer
from pipeline.records import GenerationRequest
from pipeline.rewards import digit_fraction
from pipeline.roles.forward import in_row_chunks, response_logprobs
from pipeline.roles.host import RoleHost, plugin_name
from pipeline.roles.reference import ReferenceRole
from pipeline.trainer import HybridTrainer
from resources import allocator

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the capped reference recipe runs on a worker


def limit_rows(model, limit: int):
    """Make `model` run out of memory when its forward gets more than `limit` rows."""
    def check(module, args, kwargs):
        ids = args[0] if args else kwargs["input"]
        if ids.shape[0] > limit:
            raise torch.OutOfMemoryError(f"test model: {ids.shape[0]} rows > {limit}")
    return model.get_input_embeddings().register_forward_pre_hook(check, with_kwargs=True)


@pytest.fixture
def model_and_tokenizer(tiny_model):
    return load_causal_lm(tiny_model).eval(), load_tokenizer(tiny_model)


class _Batch(SimpleNamespace):
    """What in_row_chunks reads of a rollout: ids, mask, prompt length, rows."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def _batch(vocab: int, rows: int = 10, prompt: int = 5, response: int = 6) -> _Batch:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (rows, prompt + response), generator=generator)
    mask = torch.ones_like(ids)
    mask[::3, :2] = 0   # some left-padded prompts
    return _Batch(input_ids=ids, attention_mask=mask, prompt_length=prompt)


def _new_reports(since: int) -> list[str]:
    return [d.line() for d in allocator.reported()[since:]]


def test_forward_chunks_halve_on_out_of_memory_with_the_same_result(model_and_tokenizer):
    model, _ = model_and_tokenizer
    batch = _batch(model.config.vocab_size)
    expected = in_row_chunks(response_logprobs, model, batch, 8, "cpu", 0.7, what="reference logprobs")
    limit_rows(model, 3)
    seen = len(allocator.reported())
    got = in_row_chunks(response_logprobs, model, batch, 8, "cpu", 0.7, what="reference logprobs")
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert _new_reports(seen) == [
        "local: reference logprobs: 8 -> 4 rows per chunk (out of memory: test model: 8 rows > 3)",
        "local: reference logprobs: 4 -> 2 rows per chunk (out of memory: test model: 4 rows > 3)"]
    # The next pass starts at what fitted (no reading says more memory is free): no new failure.
    again = in_row_chunks(response_logprobs, model, batch, 8, "cpu", 0.7, what="reference logprobs")
    torch.testing.assert_close(again, expected, rtol=0, atol=1e-6)
    assert len(allocator.reported()) == seen + 2


def _request(tokenizer, prompts=4, samples=3, new_tokens=8):
    ids = [tokenizer(f"what is {i} plus {i * 7}? answer: ")["input_ids"][: 10 + 3 * i] for i in range(prompts)]
    return GenerationRequest(ids, list(range(prompts)), samples, new_tokens, 1.0, seed=5)


def _consistent(model, rollout):
    """The rollout's logprobs are the model's on its own tokens: every row was generated."""
    expected = response_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.prompt_length,
                                 1.0) * rollout.response_mask
    torch.testing.assert_close(rollout.behavior_logprobs, expected, atol=2e-5, rtol=0)
    assert (rollout.response_mask.sum(-1) >= 1).all()


@pytest.mark.parametrize("engine_cls, expected", [
    # HF: 12 sequences at once fail, 6 fail, 3 fit; the scoring pass (16 rows a chunk) fails
    # with its 12 rows, then 8; 4 fit.
    (HFEngine, ["local: generation: 12 -> 6 sequences per batch (out of memory: test model: 12 rows > 4)",
                "local: generation: 6 -> 3 sequences per batch (out of memory: test model: 6 rows > 4)",
                "local: rollout logprobs: 16 -> 8 rows per chunk (out of memory: test model: 12 rows > 4)",
                "local: rollout logprobs: 8 -> 4 rows per chunk (out of memory: test model: 8 rows > 4)"]),
    # cuda_graph: 16 slots fail (their prefill computes the 4 distinct prompts once each; the
    # first decode step runs 16 rows), then 8; 4 fit (a power of two).
    (CudaGraphEngine, ["local: generation: 16 -> 8 sequences per batch (out of memory: test model: 16 rows > 4)",
                       "local: generation: 8 -> 4 sequences per batch (out of memory: test model: 8 rows > 4)"]),
])
def test_engines_split_the_generation_batch_on_out_of_memory(engine_cls, expected, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = engine_cls(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, device="cpu")
    hook = limit_rows(model, 4)
    seen = len(allocator.reported())
    try:
        rollout = engine.generate(_request(tokenizer), policy_version=1)
    finally:
        hook.remove()
    assert len(rollout) == 12 and rollout.group_ids.tolist() == [g for g in range(4) for _ in range(3)]
    _consistent(model, rollout)
    assert _new_reports(seen) == expected
    if engine_cls is CudaGraphEngine:   # caches sized for the failed batches were dropped
        assert engine.batch == 4 and [batch for batch, _ in engine._caches] == [4]


def test_budget_arithmetic(model_and_tokenizer):
    model, _ = model_and_tokenizer
    config = model.config   # the tiny model: see pipeline.models.create_tiny_model
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * 4   # K and V, float32
    assert budget.kv_bytes_per_token(config, torch.float32) == per_token
    assert budget.kv_bytes_per_token(config, torch.bfloat16) == per_token // 2
    prefill = 10 * (3 * config.intermediate_size + 4 * config.hidden_size) * 4 + heads * 10 * 10 * 4
    assert budget.sequence_bytes(config, torch.float32, 10, 30) == per_token * 30 + prefill + 16 * config.vocab_size
    assert budget.sequence_bytes(config, torch.float32, 10, 30, cache_copies=2) == \
        2 * per_token * 30 + prefill + 16 * config.vocab_size
    assert budget.fitting_rows(None, 100, 64) == 64                    # CPU: no reading, no limit
    assert budget.fitting_rows(10_000, 1_000, 64, headroom=0.85) == 8  # 0.85 * 10 = 8.5
    assert budget.fitting_rows(10, 1_000, 64) == 1
    assert budget.held_bytes(config, torch.float32, 30) + budget.prefill_bytes(config, torch.float32, 10) == \
        budget.sequence_bytes(config, torch.float32, 10, 30)
    # Slots holding 100 bytes each, prompts prefilled 4 at a time at 900 bytes each: in 10 000
    # bytes, 10 slots if every prompt took its prefill's memory at once, (10 000 - 4 x 900) /
    # 100 = 64 with one pass of 4 at a time; a pass of 20 holds every prompt that fits: 10.
    assert budget.fitting_slots(10_000, 100, 900, 4, 256, headroom=1.0) == 64
    assert budget.fitting_slots(10_000, 100, 900, 20, 256, headroom=1.0) == 10
    assert budget.fitting_slots(10_000, 100, 900, 4, 32, headroom=1.0) == 32      # at most max_rows
    assert budget.fitting_slots(None, 100, 900, 4, 32) == 32                        # CPU: no reading
    assert [budget.power_of_two_below(n) for n in (1, 2, 3, 8, 9, 255)] == [1, 2, 2, 8, 8, 128]


def test_cuda_graph_batch_follows_the_free_memory_read_before_each_request(model_and_tokenizer, monkeypatch):
    """The engine's plan from a memory reading (the reading is the one input set here)."""
    model, tokenizer = model_and_tokenizer
    engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, device="cpu",
                             max_batch_size=16)
    request = _request(tokenizer, prompts=4, samples=4)   # 16 sequences, 4 distinct prompts, prompts padded to 64
    width = cuda_graph.bucket_length(max(len(p) for p in request.prompt_ids), engine.prompt_bucket)
    per_sequence = budget.sequence_bytes(model.config, torch.float32, width, width + request.max_new_tokens)
    free = {"bytes": 100 * per_sequence}
    monkeypatch.setattr(budget, "free_bytes", lambda device: free["bytes"])
    seen = len(allocator.reported())
    engine.generate(request, 0)
    assert engine.batch == 16 and _new_reports(seen) == []              # room for all 16
    free["bytes"] = int(5 * per_sequence) - sum(c.nbytes for c in engine._caches.values())   # another process took memory
    rollout = engine.generate(request, 0)
    assert engine.batch == 4 and len(rollout) == 16                     # 0.85 * 5 = 4.25 -> 4
    _consistent(model, rollout)
    [line] = _new_reports(seen)
    assert line.startswith("local: generation: 16 -> 4 sequences per batch (free memory: ")
    free["bytes"] = 100 * per_sequence                                  # it left again
    engine.generate(request, 0)
    assert engine.batch == 16 and len(allocator.reported()) == seen + 1


def test_cuda_graph_slots_leave_the_reserve_of_a_role_sharing_the_process(model_and_tokenizer, monkeypatch):
    """A hosted rollout's engine plans in the free memory less what its host's next update
    needs (`reserve`, read before each request): room for 100 sequences less a reserve of 95
    plans 0.85 x 5 = 4.25 -> 4 slots; the reserve gone, all 16 again."""
    model, tokenizer = model_and_tokenizer
    reserve = {"bytes": 0}
    engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, device="cpu",
                             max_batch_size=16, reserve=lambda: reserve["bytes"])
    request = _request(tokenizer, prompts=4, samples=4)
    width = cuda_graph.bucket_length(max(len(p) for p in request.prompt_ids), engine.prompt_bucket)
    per_sequence = budget.sequence_bytes(model.config, torch.float32, width, width + request.max_new_tokens)
    monkeypatch.setattr(budget, "free_bytes", lambda device: 100 * per_sequence)
    reserve["bytes"] = 95 * per_sequence
    rollout = engine.generate(request, 0)
    assert engine.batch == 4 and len(rollout) == 16
    _consistent(model, rollout)
    reserve["bytes"] = 200 * per_sequence                               # more than is free: one slot
    engine.generate(request, 0)
    assert engine.batch == 1
    reserve["bytes"] = 0
    engine.generate(request, 0)
    assert engine.batch == 16


def test_cuda_graph_plan_counts_one_prefill_pass_not_one_a_slot(model_and_tokenizer, monkeypatch):
    """Prompts prefill a pass at a time (continuous.PREFILL_PASS_TOKENS): the memory plan
    counts one pass's activations besides the slots' KV caches, so a GPU with room for 16
    slots and one pass runs 16, where counting every prompt's prefill planned fewer."""
    model, tokenizer = model_and_tokenizer
    engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, device="cpu",
                             max_batch_size=16)
    request = _request(tokenizer, prompts=4, samples=4)   # 16 sequences, 4 distinct prompts
    width = cuda_graph.bucket_length(max(len(p) for p in request.prompt_ids), engine.prompt_bucket)
    held = budget.held_bytes(model.config, torch.float32, width + request.max_new_tokens)
    prefill = budget.prefill_bytes(model.config, torch.float32, width)
    for module in (cuda_graph, continuous):
        monkeypatch.setattr(module, "PREFILL_PASS_TOKENS", 2 * width)   # two prompts a pass
    free = int((16 * held + 2 * prefill) / budget.HEADROOM) + 1
    monkeypatch.setattr(budget, "free_bytes", lambda device: free)
    rollout = engine.generate(request, 0)
    assert engine.batch == 16 and engine.last_stats["prefill_passes"] == 2   # each prompt computed once
    assert budget.fitting_rows(free, held + prefill, 16) < 16           # every prompt's prefill counted
    _consistent(model, rollout)


def capped_reference(model_dir: str, limit: int) -> ReferenceRole:
    """Recipe: the reference role on a test model that runs out of memory above `limit` rows
    (padded rows: packed, the 4 rows of a shard would be one)."""
    role = ReferenceRole(model_dir, device="cpu", micro_batch_size=8, pack_sequences=False)
    limit_rows(role.model, limit)
    return role


def test_a_trainer_step_counts_the_workers_degradations(shared_cluster, shared_config, tiny_model, prompts):
    trainer = HybridTrainer(tiny_model, digit_fraction, shared_config, algorithm="ppo", prompts=prompts,
                            cluster=shared_cluster, steps=1, prompts_per_step=8, max_new_tokens=6,
                            micro_batch_size=8, pack_sequences=False, show_progress=False)
    shared_cluster.client.register_plugin(RoleHost("reference", functools.partial(capped_reference, tiny_model, 2),
                                                   torch_threads=1), name=plugin_name("reference"))
    [record] = trainer.train()
    # Two rollout shards of 4 rows: the first halves 8 -> 2 rows a chunk, the second starts at 2.
    assert record.oom_backoffs == 1
    assert record.degradations == ["reference: reference logprobs: 8 -> 2 rows per chunk "
                                   "(out of memory: test model: 4 rows > 2)"]
    assert record.policy_version == 1 and record.tokens > 0
