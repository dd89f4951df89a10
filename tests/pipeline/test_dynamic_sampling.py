"""DAPO's dynamic sampling (train.filter_groups) and overlong filter (train.overlong_filter):
by hand on small tensors, then through the trainer on real workers."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pipeline.experience import build_experience
from pipeline.records import Rollout, Scores
from pipeline.screening import informative_groups, keep_informative_groups


def _rollout(groups: list[int], clipped: list[bool] | None = None) -> Rollout:
    rows = len(groups)
    ids = torch.arange(rows * 3).view(rows, 3)
    mask = torch.ones(rows, 2)
    return Rollout(ids, torch.ones_like(ids), mask, torch.zeros(rows, 2), torch.tensor(groups), 0, 1,
                   clipped=None if clipped is None else torch.tensor(clipped))


def test_informative_groups_are_those_whose_rewards_differ_in_order_of_first_row():
    groups = torch.tensor([5, 3, 5, 3, 9, 9, 7, 7])
    scores = torch.tensor([1.0, 0.0, 1.0, 2.0, 0.5, math.nan, 0.0, 1.0])
    # 5: all 1.0 -> out; 3: 0 vs 2 -> in; 9: one finite value only -> out; 7: 0 vs 1 -> in.
    assert informative_groups(groups, scores) == [3, 7]


def test_keep_informative_groups_keeps_whole_groups_up_to_the_limit():
    rollout = _rollout([5, 3, 5, 3, 7, 7, 8, 8])
    scores = Scores(torch.tensor([1.0, 0.0, 1.0, 2.0, 0.0, 1.0, 3.0, 4.0]), [],
                    {"r": torch.tensor([1.0, 0.0, 1.0, 2.0, 0.0, 1.0, 3.0, 4.0])})
    values = torch.arange(16.0).view(8, 2)
    kept, kept_scores, per_token, left_out = keep_informative_groups(rollout, scores, {"values": values}, groups=2,
                                                                     min_rows=1)
    assert kept.group_ids.tolist() == [3, 3, 7, 7]   # groups 3 and 7: the first two that differ
    assert kept_scores.values.tolist() == [0.0, 2.0, 0.0, 1.0] and kept_scores.components["r"].tolist() == [0, 2, 0, 1]
    assert per_token["values"][:, 0].tolist() == [2.0, 6.0, 8.0, 10.0]
    assert left_out == 2   # group 5 (all equal) and group 8 (beyond the limit)
    # Too few rows for the update: every row stays (advantages of all-equal groups are 0).
    kept, _, _, left_out = keep_informative_groups(rollout, scores, {}, groups=1, min_rows=4)
    assert len(kept) == 8 and left_out == 0


def test_the_overlong_filter_takes_cut_responses_out_of_the_loss_but_not_out_of_the_baseline():
    rollout = _rollout([0, 0, 1, 1], clipped=[False, True, False, False])
    scores = torch.tensor([1.0, 3.0, 0.0, 2.0])
    args = dict(algorithm="grpo", kl_coef=0.0, gamma=1.0, lam=1.0, group_size=2, whiten=False)
    plain, _ = build_experience(rollout, scores, torch.zeros(4, 2), None, **args)
    filtered, stats = build_experience(rollout, scores, torch.zeros(4, 2), None, overlong_filter=True, **args)
    # Group 0's baseline still counts the cut response's 3.0: row 0's advantage is unchanged.
    torch.testing.assert_close(filtered.advantages[[0, 2, 3]], plain.advantages[[0, 2, 3]])
    assert plain.advantages[1].abs().sum() > 0 and filtered.advantages[1].tolist() == [0.0, 0.0]
    assert filtered.response_mask.tolist() == [[1, 1], [0, 0], [1, 1], [1, 1]]
    assert stats["clipped_fraction"] == 0.25


def spread_unless_flat(prompts, completions, flat, **_):
    """0 for every sample of a "flat" row (an all-equal group); else the sample's position in
    the shard, which differs between the samples of any group."""
    return [0.0 if is_flat else float(i) for i, is_flat in enumerate(flat)]


def test_filter_groups_trains_only_on_groups_whose_rewards_differ(shared_cluster, shared_config, tiny_model,
                                                                  tmp_path):
    from pipeline.trainer import HybridTrainer

    rows = [{"prompt": f"what is {i} plus 1? ", "flat": i % 2 == 0} for i in range(8)]
    out = tmp_path / "run"
    with HybridTrainer(tiny_model, spread_unless_flat, shared_config, algorithm="grpo", prompts=rows,
                       cluster=shared_cluster, steps=3, samples_per_prompt=2, prompts_per_step=4, max_new_tokens=3,
                       kl_coef=0.0, filter_groups=True, overlong_filter=True, log_samples=8, output_dir=str(out),
                       show_progress=False) as trainer:
        history = trainer.train()
    # Half the rows are flat: a draw of 4 holds 2 on average, so steps needed more prompts.
    assert sum(r.uninformative_groups for r in history) > 0 and sum(r.extra_draws for r in history) > 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["extra_draws"] for line in lines] == [r.extra_draws for r in history]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and not any(s["fields"]["flat"] for s in samples)  # no flat group was trained on
    for record in history:
        assert record.tokens > 0 and 0.0 <= record.clipped_fraction <= 1.0
