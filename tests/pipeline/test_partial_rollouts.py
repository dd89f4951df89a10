"""Partial rollouts: the cuda_graph engine (eagerly on CPU) ends a request once enough groups
are complete, and the next request continues the unfinished rows where they stopped; what a
step trains on and what it carries (pipeline/partial.py)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from pipeline.engines.prefill import prefill_passes
from pipeline.engines.held_rows import HeldRows, row_key
from pipeline.engines.cuda_graph import CudaGraphEngine
from pipeline.engines.hf import HFEngine
from pipeline.models import load_causal_lm, load_tokenizer
from pipeline.partial import (batches_ahead, carried_part, finish_born_before, new_groups, shard_carried,
                              trained_part)
from pipeline.records import CarriedRow, GenerationRequest, Rollout
from pipeline.rewards import digit_fraction
from pipeline.roles.forward import response_logprobs
from pipeline.trainer import HybridTrainer
from tests.conftest import cache_keyword, published_snapshots


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model):
    return load_causal_lm(tiny_model), load_tokenizer(tiny_model)


def _prompts(tokenizer, first: int, count: int) -> list[list[int]]:
    return [tokenizer(f"what is {i} plus {i * 7}? answer: ")["input_ids"][: 8 + i % 9]
            for i in range(first, first + count)]


def _eos_bias(model, eos: int, bias: float):
    def raise_eos(module, args, logits):
        logits[..., eos] += bias
        return logits
    return model.lm_head.register_forward_hook(raise_eos)


def _generate_recording_prefills(engine, request: GenerationRequest, version: int) -> tuple[Rollout, list]:
    """engine.generate, and the (rows, width) of each prefill pass it made (a decode step
    feeds one token a row)."""
    widths = []
    record = engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape))
        if kwargs["input_ids"].shape[1] > 1 else None, with_kwargs=True)
    try:
        return engine.generate(request, policy_version=version), widths
    finally:
        record.remove()


def _complete_groups(rollout: Rollout) -> set[int]:
    return set(rollout.group_ids.tolist()) - set(rollout.group_ids[rollout.unfinished].tolist())


def test_a_request_ends_at_its_complete_groups_and_the_next_one_continues_the_rest(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    eos = tokenizer.eos_token_id
    engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=eos, device="cpu", max_batch_size=8,
                             prompt_bucket=16)
    # 16 groups of 4 through 8 slots; the request may end once 4 groups are complete.
    first = GenerationRequest(_prompts(tokenizer, 0, 16), list(range(16)), 4, 24, 1.0, seed=5, complete_groups=4)
    hook = _eos_bias(model, eos, 1.0)
    try:
        rollout = engine.generate(first, policy_version=0)
        complete = _complete_groups(rollout)
        assert len(complete) >= 4 and len(complete) < 16, "it should end before the queue is empty"
        unfinished = rollout.unfinished
        assert unfinished.any()
        lengths = rollout.response_mask.sum(-1).long()
        for row in unfinished.nonzero().flatten().tolist():   # its tokens so far: no stop, not clipped
            assert eos not in rollout.responses[row, :lengths[row]].tolist()
            assert not rollout.clipped[row] and lengths[row] < 24
        never_started = lengths == 0
        assert never_started.any(), "sequences still waiting in the queue are carried too"
        assert (rollout.born == torch.where(never_started, -1, 0)).all()
        # Every token's logprob, finished or not, is the policy's (under the same bias).
        expected = response_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.prompt_length,
                                     1.0) * rollout.response_mask
        torch.testing.assert_close(rollout.behavior_logprobs, expected, atol=2e-5, rtol=0)

        # The step trains on the first 4 complete groups; later complete ones wait, ended.
        trained, carried = trained_part(rollout, 4, 0), carried_part(rollout, 4, 0)
        first_complete = [g for g in dict.fromkeys(rollout.group_ids.tolist()) if g in complete][:4]
        assert list(dict.fromkeys(trained.group_ids.tolist())) == first_complete and len(trained) == 16
        assert len(trained) + len(carried) == 64 and {r.group_id for r in carried}.isdisjoint(first_complete)
        assert sum(r.ended for r in carried) == int((~unfinished).sum()) - len(trained)

        # The next request, a version later: 2 new groups behind the carried ones. Rows that
        # started at v0 must end now (finish_born_before 1): the request runs until they have.
        second = GenerationRequest(_prompts(tokenizer, 16, 2), [16, 17], 4, 24, 1.0, seed=6, carried=carried,
                                   complete_groups=2, finish_born_before=finish_born_before(1, 1))
        continued, widths = _generate_recording_prefills(engine, second, 1)
        assert len(continued) == len(carried) + 8
        # Carried prefixes (up to 16 + 23 tokens) are prefilled at their length rounded up to
        # the bucket (16), at most the ring's 40, the new prompts at 16: longest first.
        passes = [width for _, width in widths]
        assert passes == sorted(passes, reverse=True) and passes[-1] == 16 and set(passes) <= {16, 32, 40}
        assert len(set(passes)) > 1, widths
        assert all(rows * width <= 8 * 16 for rows, width in widths), widths   # within the memory plan
        started_before = [i for i, row in enumerate(carried) if row.born is not None]
        assert not continued.unfinished[started_before].any()
        for i, row in enumerate(carried):   # each continues from its own tokens and logprobs
            prompt, response = continued.token_ids(i)
            assert prompt == row.prompt_ids and response[:len(row.response_ids)] == row.response_ids
            if row.ended:
                assert response == row.response_ids
            kept = continued.behavior_logprobs[i, :len(row.logprobs)]
            assert kept.tolist() == pytest.approx(row.logprobs, abs=0)
            assert int(continued.born[i]) == (0 if row.born == 0 else 1 if response else -1)
        expected = response_logprobs(model, continued.input_ids, continued.attention_mask,
                                     continued.prompt_length, 1.0) * continued.response_mask
        torch.testing.assert_close(continued.behavior_logprobs, expected, atol=2e-5, rtol=0)
        # Every group with a token of v0 is trained on now, however many that is: carried
        # again it would be 2 versions old.
        old_groups = {row.group_id for row in carried if row.born == 0}
        assert old_groups and old_groups <= set(trained_part(continued, 2, 1).group_ids.tolist())
        assert all(row.born != 0 for row in carried_part(continued, 2, 1))
        # Each row ends at its first EOS or at max_new_tokens, never before, across the two requests.
        for row in (~continued.unfinished).nonzero().flatten().tolist():
            ids = continued.token_ids(row)[1]
            assert (ids[-1] == eos) != bool(continued.clipped[row]) and eos not in ids[:-1]
            assert len(ids) <= 24
    finally:
        hook.remove()
    stats = engine.last_stats
    # The request's own tokens: what the carried rows came with is not counted again.
    own = int(continued.response_mask.sum()) - sum(len(r.response_ids) for r in carried)
    assert stats["tokens"] == own and stats["carried_out"] == int(continued.unfinished.sum())


def _mixed_weights_logprobs(old, new, prompt: list[int], response: list[int], prior: int) -> torch.Tensor:
    """Logprobs of response[prior:] when the keys and values of prompt + response[:prior - 1]
    come from `old` and every later token goes through `new` (transformers' own cache)."""
    with torch.no_grad():
        past = old(input_ids=torch.tensor([prompt + response[:prior - 1]]), use_cache=True).past_key_values
        logits = new(input_ids=torch.tensor([response[prior - 1:-1]]), **{cache_keyword(new): past},
                     use_cache=True).logits
    return logits[0].float().log_softmax(-1).gather(-1, torch.tensor(response[prior:])[:, None])[:, 0]


def test_a_carried_row_left_in_its_slot_decodes_on_from_its_keys_and_values(model_and_tokenizer):
    old, tokenizer = model_and_tokenizer
    model = copy.deepcopy(old)   # the engine's: it gets new weights below
    eos = tokenizer.eos_token_id
    engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=eos, device="cpu", max_batch_size=8,
                             prompt_bucket=16)
    first = GenerationRequest(_prompts(tokenizer, 0, 16), list(range(16)), 4, 24, 1.0, seed=5, complete_groups=4,
                              keep_kv=True)
    hooks = [_eos_bias(m, eos, 1.0) for m in (old, model)]
    try:
        carried = carried_part(engine.generate(first, policy_version=0), 4, 0)
        live = [i for i, row in enumerate(carried) if row.response_ids and not row.ended]
        assert live
        # New weights between the two requests, as after an update.
        generator = torch.Generator().manual_seed(0)
        engine.load_state_dict({name: value + 0.05 * torch.randn(value.shape, generator=generator)
                                for name, value in model.state_dict().items()})
        second = GenerationRequest(_prompts(tokenizer, 16, 2), [16, 17], 4, 24, 1.0, seed=6, carried=carried,
                                   complete_groups=2, finish_born_before=finish_born_before(1, 1), keep_kv=True)
        continued, widths = _generate_recording_prefills(engine, second, 1)
        # Every row that was live in a slot decodes on there: no prefill holds more than a
        # prompt (new ones, and carried rows that never started).
        assert engine.last_stats["continued"] == len(live)
        assert widths and all(width == 16 for _, width in widths), widths
        for i in live:
            prompt, response = continued.token_ids(i)
            prior = len(carried[i].response_ids)
            assert response[:prior] == carried[i].response_ids and len(response) > prior
            behaviour = continued.behavior_logprobs[i, prior:len(response)]
            # The new tokens were sampled by the new weights over keys and values of the old
            # ones, and their behaviour logprobs say exactly that.
            torch.testing.assert_close(behaviour, _mixed_weights_logprobs(old, model, prompt, response, prior),
                                       atol=2e-5, rtol=0)
        # Any other request in between writes the slots: the held rows are prefilled again.
        engine.generate(GenerationRequest(_prompts(tokenizer, 30, 2), [30, 31], 4, 8, 1.0, seed=7), 1)
        third = GenerationRequest(_prompts(tokenizer, 18, 2), [18, 19], 4, 24, 1.0, seed=8,
                                  carried=carried_part(continued, 2, 1), complete_groups=2,
                                  finish_born_before=finish_born_before(2, 1), keep_kv=True)
        rollout = engine.generate(third, 2)
        assert engine.last_stats["continued"] == 0
        expected = response_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.prompt_length,
                                     1.0) * rollout.response_mask
        new = rollout.response_mask.bool().clone()
        for i, row in enumerate(third.carried):
            new[i, :len(row.response_ids)] = False
        torch.testing.assert_close(rollout.behavior_logprobs[new], expected[new], atol=2e-5, rtol=0)
    finally:
        for hook in hooks:
            hook.remove()


def test_a_group_both_trained_and_carried_after_a_regenerated_rollout_is_trained_once():
    from pipeline.inflight import InFlightBatch, take_trained
    from pipeline.partial import outside
    from pipeline.records import Scores

    rollout = _hand_rollout()   # groups 7, 7, 8, 8, 9, 9
    scores = Scores(torch.arange(6.0), [], {"r": torch.arange(6.0) * 10})
    per_token = {"ref_logprobs": torch.arange(18.0).view(6, 3)}
    row = CarriedRow(prompt_ids=[6, 6], response_ids=[17], logprobs=[-1.0], group_id=8, born=3)
    # The carry was read first (the next batch continues it) and holds group 8, which this
    # step's rollout, generated again, has complete: the step leaves group 8 out.
    batch = InFlightBatch(0, 0, 3, [], [], [], [])
    batch.carry.rows = (row,)
    data, kept, tokens = take_trained(batch, rollout, scores, per_token)
    assert data.group_ids.tolist() == [7, 7, 9, 9] and kept.values.tolist() == [0.0, 1.0, 4.0, 5.0]
    assert kept.components["r"].tolist() == [0.0, 10.0, 40.0, 50.0]
    assert tokens["ref_logprobs"][:, 0].tolist() == [0.0, 3.0, 12.0, 15.0]
    assert batch.carry.trained == {7, 9}
    # The step read first: it takes every row, and the carry read later leaves out its groups.
    later = InFlightBatch(1, 0, 3, [], [], [], [])
    assert len(take_trained(later, rollout, scores, per_token)[0]) == 6 and later.carry.trained == {7, 8, 9}
    assert outside((row, dataclasses.replace(row, group_id=10)), later.carry.trained) == (
        dataclasses.replace(row, group_id=10),)
    # A carry holding every group the step has: the step trains them rather than nothing.
    every = InFlightBatch(2, 0, 3, [], [], [], [])
    every.carry.rows = tuple(dataclasses.replace(row, group_id=g) for g in (7, 8, 9))
    assert len(take_trained(every, rollout, scores, per_token)[0]) == 6


def test_held_rows_of_the_same_content_each_go_on_in_a_slot_of_their_own():
    # Two samples of group 3 both at tokens [5, 6] (slots 1 and 4), one of group 2 at [5].
    held = HeldRows(cache=None, column=0, slots={row_key(3, [9], [5, 6]): [1, 4], row_key(2, [9], [5]): [0]},
                    state={})
    row = CarriedRow(prompt_ids=[9], response_ids=[5, 6], logprobs=[-1.0, -1.0], group_id=3, born=0)
    assert sorted([held.take(row), held.take(row)]) == [1, 4] and held.take(row) is None
    assert held.take(dataclasses.replace(row, group_id=2, response_ids=[5], ended=True)) is None   # not live
    assert held.take(dataclasses.replace(row, group_id=2, response_ids=[5], logprobs=[-1.0])) == 0
    assert held.take(dataclasses.replace(row, response_ids=[5, 7])) is None


def _hand_rollout() -> Rollout:
    """Groups 7 (rows 0-1), 8 (rows 2-3), 9 (rows 4-5); row 3 unfinished, row 5 never started."""
    ids = torch.tensor([[0, 5, 11, 1, 0], [0, 5, 12, 13, 1], [6, 6, 14, 15, 16], [6, 6, 17, 18, 0],
                        [0, 7, 1, 0, 0], [0, 7, 0, 0, 0]])
    response_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]]).float()
    prompt_mask = torch.tensor([[0, 1], [0, 1], [1, 1], [1, 1], [0, 1], [0, 1]])
    logprobs = -torch.arange(1, 19, dtype=torch.float32).view(6, 3) / 10 * response_mask
    return Rollout(ids, torch.cat([prompt_mask, response_mask.long()], 1), response_mask, logprobs,
                   torch.tensor([7, 7, 8, 8, 9, 9]), policy_version=4, prompt_length=2,
                   unfinished=torch.tensor([False, False, False, True, False, True]),
                   born=torch.tensor([4, 4, 3, 3, 4, -1]))


def test_a_step_trains_on_whole_groups_and_carries_the_rest_by_hand():
    rollout = _hand_rollout()
    # needed 1, rows born before v4 may not be carried again: group 7 is the one complete group.
    assert trained_part(rollout, 1, 4).group_ids.tolist() == [7, 7]
    carried = carried_part(rollout, 1, 4)
    assert [(r.prompt_ids, r.response_ids, r.group_id, r.born, r.ended) for r in carried] == [
        ([6, 6], [14, 15, 16], 8, 3, True), ([6, 6], [17, 18], 8, 3, False),
        ([7], [1], 9, 4, True), ([7], [], 9, None, False)]
    assert [r.logprobs for r in carried] == [pytest.approx([-0.7, -0.8, -0.9]), pytest.approx([-1.0, -1.1]),
                                             pytest.approx([-1.3]), []]
    # None needed: the complete group waits, its rows ended...
    assert len(trained_part(rollout, 0, 4)) == 0
    assert [(r.response_ids, r.group_id, r.ended) for r in carried_part(rollout, 0, 4)[:2]] == [
        ([11, 1], 7, True), ([12, 13, 1], 7, True)]
    # ...unless its rows (born at v4) may not be carried again (floor 5): it is trained on now.
    assert trained_part(rollout, 0, 5).group_ids.tolist() == [7, 7]
    # The first request draws 2 (3) x 4 groups; one that continues carried groups draws the 4 a
    # step trains, however many are carried: each step trains 4 groups on average.
    assert new_groups(4, ()) == 8 and new_groups(4, (), request_groups=3) == 12
    assert new_groups(4, carried) == 4 and new_groups(4, carried, request_groups=3) == 4
    # Two shards: groups whole, alternating, oldest first.
    assert [[r.group_id for r in shard] for shard in shard_carried(carried, 2)] == [[8, 8], [9, 9]]
    # Trained by the update from v5 at the earliest if carried once more: with max_staleness 1
    # a row born at v4 or before must end in the request generated with v5.
    assert finish_born_before(5, 1) == 5 and finish_born_before(5, 2) == 4
    # A batch generated one ahead is trained by the update from v6: its carried rows by v7 at
    # the earliest, so with max_staleness 2 a row born at v4 must end now.
    assert finish_born_before(5, 2, ahead=1) == 5 and finish_born_before(5, 3, ahead=1) == 4
    # One batch ahead only when the rollout does not take turns with the actor on a GPU and
    # has a version to spare.
    assert [batches_ahead(s, turns) for s in (1, 2, 3) for turns in (False, True)] == [0, 0, 1, 0, 1, 0]


@pytest.mark.parametrize("sharing, ahead", [("time_slice", 0), ("mps", 1)])
def test_on_the_actors_gpu_the_next_batch_generates_ahead_only_under_mps(sharing, ahead, tmp_path, monkeypatch):
    """InFlight's choice from the resource file (NVML replaced by a GPU list; a FIFO stands
    for the MPS control daemon's pipe): the printed mode says which, and why."""
    import os
    import types

    from pipeline.config import make_train_config
    from pipeline.inflight import InFlight
    from resources import parse_resource_config
    from resources.devices import GpuInfo

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    os.mkfifo(tmp_path / "control")
    gpu = {"device_type": "cuda", "device_ids": [0]}
    config = parse_resource_config(
        {"actor": gpu, "rollout": {**gpu, "strategy": "cuda_graph"}, "reward": {"device_type": "cpu"},
         "allow_shared_devices": True, "gpu_sharing": sharing},
        gpus=[GpuInfo(index=0, name="H100", total_bytes=80 << 30, free_bytes=80 << 30, used_bytes=0,
                      utilization_pct=0, process_count=0)])
    train = make_train_config({"algorithm": "grpo", "samples_per_prompt": 4, "partial_rollouts": True,
                               "max_staleness": 3})
    batches = InFlight(types.SimpleNamespace(config=config), None, train, ("actor", "rollout", "reward"))
    assert batches.ahead == ahead and batches.published_versions == ahead + 1
    assert batches.partial_mode.startswith("the next batch generates during the update; a carried row has 2"
                                           if ahead else "batches generate after the update (the rollout takes "
                                           "turns with the actor on its GPU; gpu_sharing: mps lets them run at once)")


def test_long_carried_prefixes_are_prefilled_in_passes_the_memory_plan_covers(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, device="cpu",
                             max_batch_size=8, prompt_bucket=16)
    # Two groups of 4 carried with 30 tokens each behind prompts of up to 16: prefixes of up
    # to 46 tokens, prefilled at 48. The plan counted 8 slots x 16 prompt tokens: 2 rows a pass.
    prompts = _prompts(tokenizer, 0, 2)
    tokens = [t for t in tokenizer("one two three four five six seven eight nine ten " * 8)["input_ids"]
              if t not in (tokenizer.eos_token_id, tokenizer.pad_token_id)]
    carried = tuple(CarriedRow(prompt_ids=prompts[g], response_ids=tokens[i:i + 30], logprobs=[-1.0] * 30,
                               group_id=g, born=0) for g in range(2) for i in range(4))
    request = GenerationRequest(_prompts(tokenizer, 2, 1), [2], 4, 64, 1.0, seed=3, carried=carried, complete_groups=2)
    rollout, widths = _generate_recording_prefills(engine, request, 1)
    assert widths[:4] == [(2, 48)] * 4 and all(rows * width <= 8 * 16 for rows, width in widths), widths
    # Each carried row went on from its 30 tokens; what it generated here is the policy's.
    expected = response_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.prompt_length, 1.0)
    new = rollout.response_mask.bool().clone()
    new[:8, :30] = False
    assert new[:8].any()
    torch.testing.assert_close(rollout.behavior_logprobs[new], expected[new], atol=2e-5, rtol=0)


def test_prefixes_are_prefilled_longest_first_in_passes_padded_to_their_bucket():
    # Budget 400 tokens, bucket 64, ring 300: 290 -> 300 (the ring) and 200 -> 256 go alone
    # (two rows would pass 400); the two 150s share 192 (384 tokens), then 130 and 60 do;
    # a third row would not fit, so 5 starts a pass at 64.
    lengths = [60, 150, 290, 5, 200, 130, 150]
    assert prefill_passes(lengths, 64, 300, 400) == [(300, [2]), (256, [4]), (192, [1, 6]), (192, [5, 0]),
                                                     (64, [3])]
    # A pass holds one row whatever the budget; every prefix is in exactly one pass.
    assert prefill_passes([1000], 64, 1152, 128) == [(1024, [0])]
    passes = prefill_passes([128] * 10 + [700] * 3, 128, 1152, 1024)
    assert sorted(i for _, members in passes for i in members) == list(range(13))
    assert passes == [(768, [10]), (768, [11]), (768, [12]), (128, list(range(8))), (128, [8, 9])]


def test_engines_that_run_every_row_to_its_end_refuse_a_partial_request(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    engine = HFEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, device="cpu")
    request = GenerationRequest(_prompts(tokenizer, 0, 2), [0, 1], 2, 4, 1.0, seed=1, complete_groups=1)
    with pytest.raises(ValueError, match="train.partial_rollouts: the hf rollout engine .* Fix: set rollout.strategy: "
                                         "cuda_graph"):
        engine.generate(request, policy_version=0)


# End to end on the shared cluster's workers. Stop strings of four common characters end a
# response at about one token in ten, so lengths spread up to max_new_tokens and the groups of
# a shard complete at different times.
PARTIAL = dict(algorithm="grpo", prompts_per_step=4, samples_per_prompt=4, max_new_tokens=16, kl_coef=0.0,
               actor_lr=1e-3, micro_batch_size=8, show_progress=False, log_samples=0, partial_rollouts=True,
               max_staleness=1, stop=["a", "e", "1", "3"])


def _cuda_graph(config):
    from resources.validate import with_role

    return with_role(config, dataclasses.replace(config.role("rollout"), strategy="cuda_graph"))


def _figures(record):
    return (record.step, record.policy_version, record.reward_mean, record.tokens, record.staleness,
            record.carried_rows, record.losses)


def test_partial_rollouts_carry_rows_within_the_staleness_bound_and_resume_exactly(
        shared_cluster, shared_config, tiny_model, prompts, tmp_path):
    config = _cuda_graph(shared_config)
    common = dict(prompts=prompts, cluster=shared_cluster, **PARTIAL)
    with HybridTrainer(tiny_model, digit_fraction, config, output_dir=str(tmp_path / "a"), steps=4,
                       checkpoint={"every_n_steps": 2, "keep_last": 2}, **common) as straight_run:
        straight = straight_run.train()
        # Each batch loads the newest weights (none generates ahead): the actor keeps that one only.
        assert straight_run.batches.published_versions == 1
        assert published_snapshots(straight_run.fleet.snapshot_dir) == ["policy-v000004.safetensors"]
    assert [r.policy_version for r in straight] == [1, 2, 3, 4]
    assert all(r.staleness_max <= 1 for r in straight)                  # max_staleness
    # Rows were carried, and trained a version later; batches are not generated ahead.
    assert any(r.carried_rows for r in straight) and any(r.staleness_max == 1 for r in straight)
    assert all(r.staleness <= 1 for r in straight)
    # Each step trains on prompts_per_step groups of 4 (here no group had to go early).
    assert [r.rows for r in straight] == [16] * 4
    saved = json.loads((tmp_path / "a" / "checkpoints" / "step-000002" / "trainer.json").read_text())
    assert len(saved["carried_rows"]) == straight[1].carried_rows > 0
    # Resumed from step 2, the run continues the carried rows exactly as the straight run did.
    with HybridTrainer(tiny_model, digit_fraction, config, output_dir=str(tmp_path / "b"), steps=4,
                       resume=str(tmp_path / "a" / "checkpoints" / "step-000002"), **common) as resumed:
        again = resumed.train()
    assert [_figures(r) for r in again] == [_figures(r) for r in straight[2:]]


def test_partial_rollouts_are_refused_with_an_engine_that_cannot_cut_a_request(shared_config, tiny_model, prompts):
    with pytest.raises(ValueError, match="train.partial_rollouts: the hf rollout engine .* Fix: set rollout.strategy: "
                                         "cuda_graph"):
        HybridTrainer(tiny_model, digit_fraction, shared_config, prompts=prompts, **PARTIAL)
    with pytest.raises(ValueError, match=r"train.partial_rollouts: True is not allowed. Fix: set max_staleness: 1"):
        HybridTrainer(tiny_model, digit_fraction, _cuda_graph(shared_config), prompts=prompts,
                      **{**PARTIAL, "max_staleness": 0})
    with pytest.raises(ValueError, match=r"train.partial_keep_kv: True is not allowed. Fix: it applies to partial"):
        HybridTrainer(tiny_model, digit_fraction, _cuda_graph(shared_config), prompts=prompts,
                      **{**PARTIAL, "partial_rollouts": False, "partial_keep_kv": True})
    with pytest.raises(ValueError, match=r"train.partial_request_groups: 0 is not allowed. Fix: use 1 to 16"):
        HybridTrainer(tiny_model, digit_fraction, _cuda_graph(shared_config), prompts=prompts,
                      **{**PARTIAL, "partial_request_groups": 0})


def test_with_max_staleness_2_the_next_partial_batch_generates_during_the_update_and_resumes(
        shared_cluster, shared_config, tiny_model, prompts, tmp_path):
    # CPU roles are separate processes: the rollout does not share the actor's GPU.
    config = _cuda_graph(shared_config)
    common = dict(prompts=prompts, cluster=shared_cluster, **{**PARTIAL, "max_staleness": 2})
    with HybridTrainer(tiny_model, digit_fraction, config, output_dir=str(tmp_path / "a"), steps=4,
                       checkpoint={"every_n_steps": 2, "keep_last": 2}, **common) as straight_run:
        assert straight_run.batches.ahead == 1
        assert straight_run.batches.partial_mode == ("the next batch generates during the update; a carried row "
                                                     "has 1 more step(s) to end")
        straight = straight_run.train()
        # The batch generating during an update loads the version before it: two are kept.
        assert published_snapshots(straight_run.fleet.snapshot_dir) == ["policy-v000003.safetensors",
                                                                        "policy-v000004.safetensors"]
    assert [r.policy_version for r in straight] == [1, 2, 3, 4]
    # Batch 0 is trained on with the weights that generated it. Each later batch was generated
    # during the update before: every row it trains on is at least a version old, none more
    # than max_staleness.
    assert straight[0].staleness == 0
    assert all(r.staleness >= 1 and r.staleness_max <= 2 for r in straight[1:])
    assert any(r.carried_rows for r in straight) and any(r.staleness_max == 2 for r in straight)
    # The checkpoint after step 2 holds what the batch generating at the save continues: the
    # rows step 1's batch carried. The resumed run generates that batch again from them.
    saved = json.loads((tmp_path / "a" / "checkpoints" / "step-000002" / "trainer.json").read_text())
    assert len(saved["carried_rows"]) == straight[1].carried_rows > 0
    assert saved["next_batch"] == 2        # batches 0 and 1 trained on, batch 2 generating
    with HybridTrainer(tiny_model, digit_fraction, config, output_dir=str(tmp_path / "b"), steps=4,
                       resume=str(tmp_path / "a" / "checkpoints" / "step-000002"), **common) as resumed:
        again = resumed.train()
    assert [r.policy_version for r in again] == [3, 4]
    assert all(r.staleness_max <= 2 for r in again)
    assert again[0].staleness_max >= 1   # rows born before the save (v2): the checkpoint's carry went on
    assert [r.rows for r in again] == [16, 16]


def _rows_continued(dask_worker=None) -> int:
    """The carried rows the rollout worker's last request decoded on in their slots."""
    return dask_worker.plugins["dask-rl-rollout"].state.engine.last_stats.get("continued", 0)


def test_the_partial_cpu_example_carries_rows_and_trains_them_a_version_older(
        shared_cluster, shared_config, tiny_model, tmp_path):
    """examples/partial_cpu.yaml's training section, on the shared cluster's CPU workers: its
    128 slots hold every row of a request, so the extra groups all start and every step
    from the third trains rows 2 versions old (the README says so). With partial_keep_kv
    (added here) the rows still decoding when a request ends go on in their slots in the
    next one, with the same staleness."""
    from pathlib import Path

    from pipeline.run_file import load_run_file

    run = load_run_file(Path(__file__).resolve().parents[2] / "examples" / "partial_cpu.yaml")
    assert run.resources.role("rollout").strategy == "cuda_graph"
    assert not run.resources.share_gpus("rollout", "actor")
    train = {key: value for key, value in dataclasses.asdict(run.train).items() if key != "algorithm"}
    with HybridTrainer(tiny_model, digit_fraction, _cuda_graph(shared_config), algorithm=run.train.algorithm,
                       prompts=run.inputs["prompts"], cluster=shared_cluster, output_dir=str(tmp_path),
                       show_progress=False, **{**train, "steps": 4, "partial_keep_kv": True}) as trainer:
        assert trainer.batches.ahead == 1
        records = trainer.train()
        continued = shared_cluster.client.run(_rows_continued,
                                              workers=[w["address"] for w in shared_cluster.workers_of("rollout")])
    assert any(continued.values()), continued
    assert [r.staleness for r in records] == [0.0, 1.0, 2.0, 2.0]
    assert all(r.carried_rows > 0 for r in records)


def test_a_request_of_many_groups_trains_prompts_per_step_groups_a_step_on_average(
        shared_cluster, shared_config, tiny_model, prompts, tmp_path):
    with HybridTrainer(tiny_model, digit_fraction, _cuda_graph(shared_config), prompts=prompts, cluster=shared_cluster,
                       output_dir=str(tmp_path), steps=6, **{**PARTIAL, "partial_request_groups": 4}) as trainer:
        records = trainer.train()
    groups = [r.rows // 4 for r in records]   # groups of 4 samples
    # The first request draws 4 x 4 groups, each later one the 4 a step trains: every group
    # drawn is trained once or still carried at the end.
    assert sum(groups) + records[-1].carried_rows // 4 == 4 * 4 + 5 * 4
    # With max_staleness 1 every started row of the first request must end in the second,
    # which trains them all at once; from then on each step trains prompts_per_step groups.
    # (Topping each request up to 4 x 4 groups made the steps train 12 and 4 groups in turn.)
    assert groups[0] == 4 and groups[1] > 4 and groups[2:] == [4] * 4
    assert all(r.staleness_max <= 1 for r in records)
