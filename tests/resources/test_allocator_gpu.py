"""The allocator against real out-of-memory errors on a GPU (`pytest -m gpu`, about 2 minutes
on an H200): under a per-process memory cap a configured micro-batch that does not fit is
halved and the update equals the unsplit one; the reference forward halves its chunks with
the same result; the HF engine's scoring pass survives a real OOM; the cuda_graph engine
sizes its batch from the memory another process leaves it and grows back once that process
has gone. Every figure is printed (and listed in pytest's "measured" summary)."""

from __future__ import annotations

import gc
import subprocess
import sys
import time

import pytest
import torch

from pipeline.engines.cuda_graph import CudaGraphEngine
from pipeline.engines.hf import HFEngine
from pipeline.records import GenerationRequest, even_chunks
from pipeline.roles.forward import in_row_chunks, response_logprobs
from pipeline.roles.training import Trainable
from resources import allocator

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

GiB = 2**30
ROWS, PROMPT, RESPONSE = 32, 128, 384   # the configured micro-batch: 32 rows x 512 tokens


def _model(dtype=torch.float32, hidden=512, layers=8, kv_heads=2, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=kv_heads, tie_word_embeddings=True,
                         max_position_embeddings=1024, pad_token_id=0, eos_token_id=1)
    return Qwen2ForCausalLM(config).to(dtype)


def _batch(rows=ROWS):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 32000, (rows, PROMPT + RESPONSE), generator=generator)
    mask = torch.ones_like(ids)
    mask[::4, :PROMPT // 2] = 0   # left-padded prompts
    return ids, mask


class _Rows:
    """What in_row_chunks reads of a rollout."""

    def __init__(self, ids, mask):
        self.input_ids, self.attention_mask, self.prompt_length = ids, mask, PROMPT

    def __len__(self):
        return self.input_ids.shape[0]


def _fresh():
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _cap(extra_bytes: int) -> float:
    """Cap this process at what it holds now plus `extra_bytes`; returns the fraction set."""
    _fresh()
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = (torch.cuda.memory_reserved() + extra_bytes) / total
    torch.cuda.set_per_process_memory_fraction(fraction)
    return fraction


@pytest.fixture(autouse=True)
def uncapped():
    torch.backends.cuda.matmul.allow_tf32 = False   # float32 sums, so results compare closely
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)
    _fresh()


def _step(initial: dict, ids, mask, max_rows: int):
    """One actor-like optimizer step from `initial` weights; returns the trainable and figures."""
    trainable = Trainable(lambda: _load(initial), lr=1e-5, strategy="none", device="cuda")
    response = mask[:, PROMPT:].float()
    normalizer = float(response.sum())

    def loss(model, rows):
        logp = response_logprobs(model, ids[rows].cuda(), mask[rows].cuda(), PROMPT, 1.0)
        total = -(logp * response[rows].cuda()).sum() / normalizer
        return total, {"loss": float(total.detach())}

    return trainable, lambda: _timed(lambda: trainable.optimizer_step(lambda rows: rows, ROWS, loss,
                                                                       max_rows=max_rows,
                                                                       tokens_per_row=PROMPT + RESPONSE))


def _load(state):
    model = _model()
    model.load_state_dict(state)
    return model


def _timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def _peak_step(initial, ids, mask, max_rows: int) -> int:
    """Peak bytes an optimizer step with `max_rows`-row micro-batches takes above the model."""
    _fresh()
    trainable, step = _step(initial, ids, mask, max_rows)
    static = torch.cuda.memory_allocated()
    step()
    peak = torch.cuda.max_memory_allocated() - static
    del trainable, step
    _fresh()
    return peak


def _grads_at_step(trainable) -> list[torch.Tensor]:
    """The accumulated gradients of the first optimizer step, read just before it applies
    them (the step frees them afterwards), through the optimizer's public pre-step hook."""
    grads: list[torch.Tensor] = []

    def keep(optimizer, args, kwargs):
        if not grads:
            grads.extend(p.grad.detach().cpu() for p in trainable.model.parameters())

    trainable.optimizer.register_step_pre_hook(keep)
    return grads


def test_optimizer_step_under_a_cap_halves_and_equals_the_unsplit_step(measured):
    initial = {k: v.clone() for k, v in _model().state_dict().items()}
    ids, mask = _batch()
    small_peak = _peak_step(initial, ids, mask, 4)

    trainable, step = _step(initial, ids, mask, ROWS)
    grads_a = _grads_at_step(trainable)
    static = torch.cuda.memory_allocated()
    (stats_a, first_a) = step()
    peak = torch.cuda.max_memory_allocated() - static
    params_a = [p.detach().cpu() for p in trainable.model.parameters()]
    _, steady_a = step()
    assert trainable.micro_batch_rows == ROWS
    del trainable, step
    _fresh()

    trainable, step = _step(initial, ids, mask, ROWS)
    # Half way between what 4-row and 32-row micro-batches take (gradients and AdamW state
    # included): 32 rows run out of memory for real, 4 fit.
    fraction = _cap((small_peak + peak) // 2 + 128 * 2**20)
    seen = len(allocator.reported())
    grads_b = _grads_at_step(trainable)
    (stats_b, first_b) = step()
    lines = [d.line() for d in allocator.reported()[seen:]]
    chosen = trainable.micro_batch_rows
    params_b = [p.detach().cpu() for p in trainable.model.parameters()]
    (_, steady_b) = step()
    steady_rows = trainable.micro_batch_rows
    steady_lines = len(allocator.reported()) - seen - len(lines)

    scale = max(g.abs().max() for g in grads_a)
    grad_error = max((a - b).abs().max() for a, b in zip(grads_a, grads_b)) / scale
    param_error = max((a - b).abs().max() for a, b in zip(params_a, params_b))
    total = torch.cuda.get_device_properties(0).total_memory
    for line in [
        f"cap: {fraction * total / GiB:.2f} GiB of {total / GiB:.0f} GiB (fraction {fraction:.4f}); step peak "
        f"above the model {peak / GiB:.2f} GiB with 32-row micro-batches, {small_peak / GiB:.2f} GiB with 4",
        f"micro-batch: configured {ROWS} rows, chosen {chosen} after {len(lines)} real OOMs; "
        f"next step {steady_rows} rows, {steady_lines} more OOMs",
        *[f"  {line}" for line in lines],
        f"step time: uncapped {first_a:.3f} s first / {steady_a:.3f} s steady; capped {first_b:.3f} s first "
        f"(with the OOM attempts) / {steady_b:.3f} s steady",
        f"equality: loss {stats_a['loss']:.6f} vs {stats_b['loss']:.6f}, grad norm {stats_a['grad_norm']:.6f} vs "
        f"{stats_b['grad_norm']:.6f}, max grad difference {grad_error:.2e} of the largest grad, max weight "
        f"difference {param_error:.2e} (lr 1e-5)",
    ]:
        print(line)
        measured(f"allocator gpu: {line}")
    assert chosen < ROWS and lines and all("optimizer step" in line and "out of memory" in line for line in lines)
    assert stats_b["loss"] == pytest.approx(stats_a["loss"], rel=1e-5)
    assert stats_b["grad_norm"] == pytest.approx(stats_a["grad_norm"], rel=1e-4)
    assert grad_error < 1e-4
    assert param_error <= 2.5e-5   # AdamW's first step moves each weight by at most ~lr
    assert steady_lines <= 1   # the next step plans from what it measured, not from the configured size


def test_reference_forward_under_a_cap_halves_its_chunks_with_the_same_result(measured):
    model = _model().cuda().eval()
    ids, mask = _batch()
    batch = _Rows(ids, mask)
    peaks = {}
    for rows in (4, ROWS):
        _fresh()
        base = torch.cuda.memory_allocated()
        expected, seconds_a = _timed(lambda: in_row_chunks(response_logprobs, model, batch, rows, "cuda", 1.0,
                                                           what="reference logprobs"))
        peaks[rows] = torch.cuda.max_memory_allocated() - base
    peak = peaks[ROWS]
    fraction = _cap((peaks[4] + peaks[ROWS]) // 2)   # 32-row chunks do not fit, 4-row ones do
    seen = len(allocator.reported())
    got, seconds_b = _timed(lambda: in_row_chunks(response_logprobs, model, batch, ROWS, "cuda", 1.0,
                                                  what="reference logprobs"))
    lines = [d.line() for d in allocator.reported()[seen:]]
    difference = float((got - expected).abs().max())
    total = torch.cuda.get_device_properties(0).total_memory
    for line in [f"reference forward: cap {fraction * total / GiB:.2f} GiB, chunk peak {peak / GiB:.2f} GiB "
                 f"at {ROWS} rows, {peaks[4] / GiB:.2f} GiB at 4; {len(lines)} real OOMs; {seconds_a:.3f} s uncapped, {seconds_b:.3f} s "
                 f"capped; max logprob difference {difference:.2e}", *[f"  {line}" for line in lines]]:
        print(line)
        measured(f"allocator gpu: {line}")
    assert lines and all("reference logprobs" in line and "out of memory" in line for line in lines)
    assert difference < 1e-4


def _request(prompts=64, samples=4, new_tokens=192, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = [torch.randint(2, 32000, (40 - i % 9,), generator=generator).tolist() for i in range(prompts)]
    return GenerationRequest(ids, list(range(prompts)), samples, new_tokens, 1.0, seed)


def test_hf_engine_scoring_survives_a_real_out_of_memory(measured):
    model = _model().cuda().eval()
    engine = HFEngine(model, pad_id=0, eos_id=1, device="cuda", rows=16)
    request = _request(prompts=8, samples=4, new_tokens=384)   # 32 sequences of 424 tokens
    # Scoring 16 sequences keeps 16 x 424 x 32000 float32 logits (0.9 GB) and their log-softmax.
    fraction = _cap(1 * GiB)
    seen = len(allocator.reported())
    rollout, seconds = _timed(lambda: engine.generate(request, 0))
    lines = [d.line() for d in allocator.reported()[seen:]]
    torch.cuda.set_per_process_memory_fraction(1.0)
    with torch.no_grad():
        actor = torch.cat([response_logprobs(model, rollout.input_ids[r].cuda(), rollout.attention_mask[r].cuda(),
                                             rollout.prompt_length, 1.0).cpu() for r in even_chunks(32, 8)])
    difference = float(((rollout.behavior_logprobs - actor) * rollout.response_mask).abs().max())
    total = torch.cuda.get_device_properties(0).total_memory
    for line in [f"hf engine: cap {fraction * total / GiB:.2f} GiB; 32 sequences in {seconds:.1f} s; "
                 f"logprob difference to the actor forward {difference:.2e}", *[f"  {line}" for line in lines]]:
        print(line)
        measured(f"allocator gpu: {line}")
    assert len(rollout) == 32 and any("rollout logprobs" in line and "out of memory" in line for line in lines)
    assert difference < 1e-3


HOLD = """
import sys, torch
free, _ = torch.cuda.mem_get_info()
held = torch.empty(max(free - int(sys.argv[1]), 0), dtype=torch.uint8, device="cuda")
print(held.numel(), flush=True)
sys.stdin.read()
"""


def test_cuda_graph_engine_batch_follows_the_memory_another_process_leaves(measured):
    model = _model(torch.bfloat16, layers=8, kv_heads=8).cuda().eval()   # 16 KiB of KV cache a token
    engine = CudaGraphEngine(model, pad_id=0, eos_id=1, device="cuda", max_batch_size=256)
    request = _request()                       # 256 sequences of 64 + 192 tokens
    _fresh()
    # The other process leaves this one 1 GiB: room for about 150 sequences, so 128 a batch.
    other = subprocess.Popen([sys.executable, "-c", HOLD, str(GiB)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        held = int(other.stdout.readline())
        seen = len(allocator.reported())
        crowded, seconds_crowded = _timed(lambda: engine.generate(request, 0))
        crowded_batch = engine.batch
        lines = [d.line() for d in allocator.reported()[seen:]]
    finally:
        other.stdin.close()
        other.wait(timeout=60)
    _fresh()
    alone, seconds_alone = _timed(lambda: engine.generate(request, 1))
    again, seconds_again = _timed(lambda: engine.generate(request, 2))
    for line in [f"cuda_graph engine: another process held {held / GiB:.1f} GiB: batch {crowded_batch} "
                 f"({seconds_crowded:.1f} s incl. compile); it left: batch {engine.batch} ({seconds_alone:.1f} s "
                 f"incl. compile, {seconds_again:.1f} s the next request)", *[f"  {line}" for line in lines]]:
        print(line)
        measured(f"allocator gpu: {line}")
    assert crowded_batch < 256 and engine.batch == 256
    assert len(crowded) == len(alone) == len(again) == 256
    assert any("generation: 256 ->" in line and "free memory" in line for line in lines)
    for rollout in (crowded, alone):
        assert torch.isfinite(rollout.behavior_logprobs).all() and (rollout.response_mask.sum(-1) >= 1).all()


CAPPED = """
import json, torch
from resources.allocator import free_bytes, limit_gpu_memory
fraction = limit_gpu_memory(2.0)
free = free_bytes("cuda")
kept = torch.empty(GIB, dtype=torch.uint8, device="cuda")   # 1 GiB fits under the cap
try:
    torch.empty(int(1.5 * GIB), dtype=torch.uint8, device="cuda")   # 2.5 GiB in all does not
    refused = False
except torch.OutOfMemoryError:
    refused = True
print(json.dumps({"fraction": fraction, "free": free, "refused": refused, "free_after": free_bytes("cuda")}))
""".replace("GIB", str(GiB))


def test_a_roles_gpu_memory_cap_bounds_the_process_and_what_it_sees_free(measured):
    """max_gpu_memory_gib: the role's process allocates at most its cap, and free_bytes (what
    micro-batches, generation slots and KV caches are sized by) counts only what is left
    under it. In a process of its own: a cap outlives the test that sets it."""
    import json
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", CAPPED], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    measured(f"a 2 GiB cap: {result['fraction']:.2%} of the device; free {result['free'] / GiB:.2f} GiB before and "
             f"{result['free_after'] / GiB:.2f} GiB after 1 GiB was allocated")
    assert result["refused"] and 0 < result["fraction"] < 1
    assert 1.9 * GiB <= result["free"] <= 2 * GiB and 0.9 * GiB <= result["free_after"] <= GiB
