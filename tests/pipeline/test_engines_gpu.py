"""The cuda_graph engine captured as CUDA graphs on a real GPU (`pytest -m gpu`): its
bf16 logprobs stay close to the actor's training forward, new weights copied in place are
served by the same graphs (and, hosted by the actor, its optimizer steps), and sequences
stop at EOS."""

from __future__ import annotations

import pytest
import torch

from benchmarks.shapes import end_with_probability
from pipeline.engines.cuda_graph import CudaGraphEngine
from pipeline.records import GenerationRequest
from pipeline.roles.forward import response_logprobs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         pad_token_id=0, eos_token_id=1)
    return Qwen2ForCausalLM(config).to("cuda", torch.bfloat16).eval()


def _request(batch=32, prompt=40, new=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 32000, (prompt - i % 7,), generator=generator).tolist() for i in range(batch)]
    return GenerationRequest(prompts, list(range(batch)), 2, new, 1.0, seed)


def _difference(model, rollout):
    with torch.no_grad():
        actor = response_logprobs(model, rollout.input_ids.cuda(), rollout.attention_mask.cuda(),
                                  rollout.prompt_length, 1.0).float().cpu()
    mask = rollout.response_mask.bool()
    return (rollout.behavior_logprobs - actor)[mask].abs()


def test_graph_logprobs_match_the_actor_and_survive_a_weight_update(model):
    import torch._dynamo.utils

    engine = CudaGraphEngine(model, pad_id=0, eos_id=1, device="cuda")
    assert engine.compiled
    rollout = engine.generate(_request(), 0)
    diff = _difference(model, rollout)
    print(f"bf16 logprob difference to the actor forward: mean {diff.mean():.4f}, max {diff.max():.4f}")
    assert diff.mean() < 0.02 and diff.max() < 0.25
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    new_state = {name: p.detach() + 0.02 * torch.randn_like(p) for name, p in model.named_parameters()}
    pointers = [p.data_ptr() for p in model.parameters()]
    engine.load_state_dict(new_state)
    assert [p.data_ptr() for p in model.parameters()] == pointers
    again = engine.generate(_request(seed=1), 1)
    diff = _difference(model, again)   # model now holds the new weights: the graphs must too
    assert diff.mean() < 0.02 and diff.max() < 0.25
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "a weight update must not recompile"


def test_a_hosted_engine_serves_each_optimizer_step_through_the_same_graphs():
    """rollout.hosted_by: the engine runs on a twin of the trained module (models.sharing_twin).
    An AdamW step of the trained module (train mode, gradient checkpointing, a backward pass)
    writes the shared tensors in place: the captured graphs sample from the new weights with
    no sync and no recompile, and the trained module keeps its own attention and mode."""
    import torch._dynamo.utils
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipeline.models import sharing_twin
    from pipeline.roles.training import enable_checkpointing

    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         pad_token_id=0, eos_token_id=1)
    actor = Qwen2ForCausalLM(config).to("cuda", torch.bfloat16)
    enable_checkpointing(actor)
    attention = actor.config._attn_implementation
    engine = CudaGraphEngine(sharing_twin(actor), pad_id=0, eos_id=1, device="cuda", fuse_projections=False)
    first = engine.generate(_request(), 0)
    assert _difference(actor.eval(), first).mean() < 0.02
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    optimizer = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    actor.train()
    ids = first.input_ids[:8].cuda()
    actor(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    again = engine.generate(_request(seed=1), 1)
    diff = _difference(actor.eval(), again)   # the actor's forward after its step: the graphs follow it
    print(f"hosted engine after an AdamW step: bf16 logprob difference mean {diff.mean():.4f}, max {diff.max():.4f}")
    assert diff.mean() < 0.02 and diff.max() < 0.25
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "an optimizer step must not recompile"
    assert actor.config._attn_implementation == attention


def test_compiled_prefill_matches_the_actor_over_passes_of_several_sizes(model, monkeypatch):
    """cuda_graph_args.compile_prefill: prefill passes through torch.compile (dynamic shapes)
    of several sizes (the pass cap splits the prompts), then captured decode steps: the
    logprobs stay those of the actor's forward, and a second request compiles nothing new."""
    import torch._dynamo.utils

    from pipeline.engines import continuous

    # 32 prompts of 64 columns, each prefilled once for its two samples: passes of 10, 10, 10, 2.
    monkeypatch.setattr(continuous, "PREFILL_PASS_TOKENS", 10 * 64)
    engine = CudaGraphEngine(model, pad_id=0, eos_id=1, device="cuda", compile_prefill=True)
    rollout = engine.generate(_request(), 0)
    assert engine.last_stats["prefill_passes"] >= 3
    diff = _difference(model, rollout)
    print(f"compiled prefill: bf16 logprob difference to the actor forward: mean {diff.mean():.4f}, "
          f"max {diff.max():.4f} over {engine.last_stats['prefill_passes']} prefill passes")
    assert diff.mean() < 0.02 and diff.max() < 0.25
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    again = engine.generate(_request(seed=1), 0)
    assert _difference(model, again).mean() < 0.02
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_graph_loop_stops_at_eos(model):
    engine = CudaGraphEngine(model, pad_id=0, eos_id=1, device="cuda")
    lm_head = model.get_output_embeddings()
    hook = lm_head.register_forward_hook(lambda m, a, out: out.index_add_(
        -1, torch.tensor([1], device=out.device), torch.full((*out.shape[:-1], 1), 12.0, device=out.device,
                                                              dtype=out.dtype)))
    try:
        rollout = engine.generate(_request(new=200), 0)
    finally:
        hook.remove()
    responses = rollout.responses
    assert (responses == 1).any(-1).all() and responses.shape[1] < 200
    first = (responses == 1).float().argmax(-1)
    assert torch.equal(rollout.response_mask.sum(-1), (first + 1).float())


def test_graph_loop_stops_at_any_stop_id_and_string_and_reports_unfiltered_logprobs(model):
    """Captured decode steps with two stop ids (a device tensor), a stop string checked on
    the host, and top-k / top-p / min-p: rows end at their first stop, exactly, and the
    logprobs are the unfiltered ones (top-k 100 of 32000 tokens would change them a lot)."""
    decode = lambda ids: "".join(chr(ord("a") + i % 26) for i in ids)  # noqa: E731 (a toy text)
    engine = CudaGraphEngine(model, pad_id=0, eos_id=1, device="cuda", decode=decode)
    lm_head = model.get_output_embeddings()
    bias = torch.zeros(32000, device="cuda", dtype=torch.bfloat16)
    bias[[5, 7]] = 1.0  # about 2% a token each among the 100 kept (a random model is near uniform)
    hook = lm_head.register_forward_hook(lambda m, a, out: out + bias)
    request = _request(new=64)
    request.stop_token_ids, request.stop_strings = (5, 7), ("q",)
    request.top_k, request.top_p, request.min_p = 100, 0.95, 0.01
    try:
        rollout = engine.generate(request, 0)
        diff = _difference(model, rollout)
    finally:
        hook.remove()
    print(f"bf16 logprob difference with stops and filters: mean {diff.mean():.4f}, max {diff.max():.4f}")
    assert diff.mean() < 0.02 and diff.max() < 0.25
    endings = []
    for row in range(len(rollout)):
        n = int(rollout.response_mask[row].sum())
        kept = rollout.responses[row, :n].tolist()
        assert rollout.responses[row, n:].eq(0).all()
        assert not set(kept[:-1]) & {1, 5, 7} and "q" not in decode(kept[:-1])
        endings.append("id" if kept[-1] in (1, 5, 7) else "string" if decode(kept).endswith("q") else "clipped")
        assert bool(rollout.clipped[row]) == (endings[-1] == "clipped") and (endings[-1] != "clipped" or n == 64)
    assert {"id", "string"} <= set(endings), endings


@pytest.mark.parametrize("decode_attention", ["sdpa", "kernel"])
def test_continuous_batching_on_long_tails_keeps_the_logprobs_and_the_graphs(model, decode_attention):
    """256 sequences through 64 captured slots on geometric lengths (each token ends a
    response with probability 0.03, cut at 256): slots refill from the queue, the tail moves
    into fewer slots, and the logprobs stay as close to the actor's as a static batch's,
    with decode attention through SDPA and through the Triton kernel (windows all over the
    ring, wrapping past its end, as slots refill)."""
    import torch._dynamo.utils

    from pipeline.engines import decode_kernel

    assert decode_attention == "sdpa" or decode_kernel.prepare("cuda")

    # Down to 8 slots (the default stops at 32): the test's 64 slots would otherwise shrink once.
    engine = CudaGraphEngine(model, pad_id=0, eos_id=1, device="cuda", max_batch_size=64, fewest_slots=8,
                             decode_attention=decode_attention)
    assert CudaGraphEngine(model, pad_id=0, eos_id=1, device="cuda").fewest_slots == 32
    hook = end_with_probability(model, 1, 0.03)   # each token ends a response with probability 0.03
    try:
        engine.generate(_request(batch=128, new=256, seed=4), 0)   # compiles
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        rollout = engine.generate(_request(batch=128, new=256, seed=5), 0)
        diff = _difference(model, rollout)
    finally:
        hook.remove()
    lengths = rollout.response_mask.sum(-1)
    stats = engine.last_stats
    print(f"continuous batching ({decode_attention}): mean length {lengths.mean():.1f}, longest {lengths.max():.0f}, "
          f"{stats['decode_steps']} decode steps, slot use {stats['slot_use']:.2f}; logprob difference "
          f"mean {diff.mean():.4f}, max {diff.max():.4f}; ms a decode step at each slot count {stats['step_ms']}")
    assert len(rollout) == 256 and 20 < lengths.float().mean() < 45 and lengths.max() > 120
    assert diff.mean() < 0.02 and diff.max() < 0.25
    slot_counts = sorted(slots for slots, _ in engine._caches)
    assert slot_counts[-1] == 64 and slot_counts[0] <= 16, slot_counts   # the tail moved into fewer slots
    largest = max(engine._caches.values(), key=lambda cache: cache.slots)
    assert sum(cache.nbytes for cache in engine._caches.values()) == largest.nbytes, "fewer slots: views"
    # Rows of mean length 37 and a look every 8 steps acted on one look late: a slot's last
    # look costs it a fifth of a row's life here (0.70 when the looks waited for the device).
    assert stats["slot_use"] > 0.65
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "a second request must not recompile"


def test_partial_rollouts_under_captured_graphs_continue_rows_and_fill_more_slots(model):
    """Requests of 64 groups of 2 through 64 captured slots, each ending once 32 groups are
    complete, the rest carried into the next (pipeline/partial.py, max_staleness 2): carried
    rows continue under the same graphs, their logprobs stay as close to the actor's, no row
    is carried past its bound, and the slots hold live rows more of the time than when a
    request decodes its tail. From the fourth request on rows still in a slot stay there
    (keep_kv), and the next request decodes them on without a prefill."""
    import torch._dynamo.utils

    from pipeline.partial import carried_part, finish_born_before, new_groups, trained_part

    engine = CudaGraphEngine(model, pad_id=0, eos_id=1, device="cuda", max_batch_size=64)
    hook = end_with_probability(model, 1, 0.03)
    try:
        whole = engine.generate(_request(batch=64, new=256, seed=6), 0)   # compiles; the tail decoded
        whole_use = engine.last_stats["slot_use"]
        carried, drawn, uses = (), 0, []
        for version in range(6):
            count = new_groups(32, carried)
            fresh = _request(batch=count, new=256, seed=10 + version)
            request = GenerationRequest(fresh.prompt_ids, list(range(drawn, drawn + count)), 2, 256, 1.0, version,
                                        carried=carried, complete_groups=32,
                                        finish_born_before=finish_born_before(version, 2), keep_kv=version >= 3)
            drawn += count
            if version == 1:
                graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            rollout = engine.generate(request, version)
            diff = _difference(model, rollout)
            assert diff.mean() < 0.02 and diff.max() < 0.25, (version, diff.mean(), diff.max())
            trained = trained_part(rollout, 32, request.finish_born_before)
            assert len(trained) == 64 and not trained.unfinished.any()
            assert (trained.born >= version - 2).all()                  # trained at most 2 versions late
            carried = carried_part(rollout, 32, request.finish_born_before)
            assert all(row.born is None or row.born >= request.finish_born_before for row in carried)
            uses.append(engine.last_stats["slot_use"])
            assert (engine.last_stats["continued"] > 0) == (version >= 4), (version, engine.last_stats["continued"])
    finally:
        hook.remove()
    print(f"partial rollouts: slot use {[round(u, 2) for u in uses]} against {whole_use:.2f} for a request that "
          f"decodes its tail ({len(whole)} rows)")
    assert sum(uses[1:]) / len(uses[1:]) > whole_use   # a request's use varies with its carry
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs, "carried rows must not recompile"


def test_refills_and_moves_launch_without_waiting_for_the_device(model, monkeypatch):
    """Between two looks the decode loop never waits for the GPU: refills (prefill passes)
    and moves into fewer slots are launched behind the steps already queued, and each look
    waits only for its own copy. Counted with torch's sync debug mode over a whole long-tailed
    request, the looks' own waits left out: what syncs is the request's start and end, not
    its dozens of looks and prefill passes."""
    import collections
    import warnings
    from pathlib import Path

    from pipeline.engines.continuous import EOS_CHECK_EVERY, SlotRun

    looked = SlotRun._look

    def look_unwatched(run):   # the wait a look is for is not counted
        wait = looked(run)

        def waited():
            torch.cuda.set_sync_debug_mode("default")
            try:
                return wait()
            finally:
                torch.cuda.set_sync_debug_mode("warn")
        return waited

    engine = CudaGraphEngine(model, pad_id=0, eos_id=1, device="cuda", max_batch_size=64)
    hook = end_with_probability(model, 1, 0.03)
    try:
        engine.generate(_request(batch=128, new=256, seed=4), 0)   # compiles
        monkeypatch.setattr(SlotRun, "_look", look_unwatched)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.generate(_request(batch=128, new=256, seed=7), 0)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        hook.remove()
    places = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                                 if "synchronizing CUDA operation" in str(w.message))
    looks = engine.last_stats["decode_steps"] // EOS_CHECK_EVERY
    print(f"synchronizing operations besides the looks' waits, over a request of {looks} looks and "
          f"{engine.last_stats['prefill_passes']} prefill passes: {dict(places)}")
    assert engine.last_stats["prefill_passes"] > 4 and looks > 20
    assert sum(places.values()) <= 8, places   # the request's start and end


def _windowed_mask(slots: int, length: int, generator) -> torch.Tensor:
    """(S, 1, 1, L) masks of contiguous windows at random places in the ring, some wrapping
    past its end; slot 0 keeps one column, slot 1 the whole ring."""
    mask = torch.zeros(slots, 1, 1, length, dtype=torch.bool)
    for slot in range(slots):
        size = int(torch.randint(1, length + 1, (1,), generator=generator))
        start = int(torch.randint(0, length, (1,), generator=generator))
        mask[slot, 0, 0, [(start + i) % length for i in range(size)]] = True
    mask[0, 0, 0, :] = False
    mask[0, 0, 0, length // 2] = True
    if slots > 1:
        mask[1, 0, 0, :] = True
    return mask


@pytest.mark.parametrize("slots,heads,kv_heads,dim,length", [
    (256, 14, 2, 64, 1152),   # Qwen2-0.5B's heads at the long-tail ring: one split a program
    (8, 14, 2, 64, 1152),     # few slots: the ring split across programs, merged by log-sum-exp
    (3, 4, 2, 128, 200),      # a ring that is not a multiple of the kernel's blocks
    (4, 8, 8, 64, 64),        # no grouping
])
def test_decode_kernel_matches_float32_attention_over_wrapping_windows(slots, heads, kv_heads, dim, length):
    from pipeline.engines import decode_kernel
    from pipeline.engines.gqa_decode import packed_gqa_attention

    generator = torch.Generator().manual_seed(slots + length)
    query = torch.randn(slots, heads, 1, dim, generator=generator).to("cuda", torch.bfloat16)
    keys, values = (torch.randn(slots + 2, kv_heads, length, dim, generator=generator)[:slots].to("cuda", torch.bfloat16)
                    for _ in range(2))
    mask = _windowed_mask(slots, length, generator).cuda()
    assert decode_kernel.prepare("cuda") and decode_kernel.usable(query, keys)
    scale = dim ** -0.5
    out = decode_kernel.slot_decode_attention(query, keys, values, mask, scale)

    group = heads // kv_heads
    scores = torch.einsum("shgd,shld->shgl", query.float().reshape(slots, kv_heads, group, dim), keys.float()) * scale
    weights = scores.masked_fill(~mask.reshape(slots, 1, 1, length), float("-inf")).softmax(-1)
    expected = torch.einsum("shgl,shld->shgd", weights, values.float()).reshape(slots, 1, heads, dim)
    module = type("Layer", (), {"num_key_value_groups": group})()
    sdpa = packed_gqa_attention(module, query, keys, values, mask, scaling=scale)[0]
    assert out.shape == sdpa.shape == (slots, 1, heads, dim) and out.dtype == torch.bfloat16
    kernel_error = (out.float() - expected).abs().max().item()
    sdpa_error = (sdpa.float() - expected).abs().max().item()
    print(f"decode kernel: largest difference to float32 {kernel_error:.4f} (SDPA's {sdpa_error:.4f})")
    assert kernel_error <= max(2 * sdpa_error, 1e-2)
    # The one-column slot returns that column's value exactly (a softmax over one score).
    torch.testing.assert_close(out[0, 0].float(), values[0, torch.arange(heads) // group, length // 2].float())
