"""Shards from several rollout workers join into one record, padded once, by hand."""

from __future__ import annotations

import pytest
import torch

from pipeline.records import Rollout, even_chunks, join_shards, rank_shards


def _shard(prompts: list[list[int]], responses: list[list[int]], prompt_length: int, response_length: int,
           version: int = 2, group: int = 0) -> Rollout:
    """Left-padded prompts, right-padded responses (pad id 0), logprobs = -token id / 10."""
    rows = len(prompts)
    ids = torch.zeros((rows, prompt_length + response_length), dtype=torch.long)
    attention = torch.zeros_like(ids)
    mask = torch.zeros((rows, response_length))
    for r, (p, q) in enumerate(zip(prompts, responses)):
        ids[r, prompt_length - len(p):prompt_length] = torch.tensor(p)
        ids[r, prompt_length:prompt_length + len(q)] = torch.tensor(q)
        attention[r, prompt_length - len(p):prompt_length + len(q)] = 1
        mask[r, :len(q)] = 1
    return Rollout(input_ids=ids, attention_mask=attention, response_mask=mask,
                   behavior_logprobs=-ids[:, prompt_length:].float() / 10 * mask,
                   group_ids=torch.full((rows,), group), policy_version=version, prompt_length=prompt_length)


def test_shards_of_different_widths_are_padded_once_to_the_widest():
    a = _shard([[5, 6]], [[7]], prompt_length=2, response_length=1, group=0)
    b = _shard([[8, 9, 4]], [[3, 2, 1]], prompt_length=3, response_length=3, group=1)
    values = [torch.tensor([[0.5]]), torch.tensor([[1.0, 2.0, 3.0]])]
    joined, per_token = join_shards([a, b], values=values, ref_logprobs=[])
    assert joined.prompt_length == 3 and joined.response_mask.shape == (2, 3)
    assert joined.input_ids.tolist() == [[0, 5, 6, 7, 0, 0], [8, 9, 4, 3, 2, 1]]
    assert joined.attention_mask.tolist() == [[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert joined.response_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    torch.testing.assert_close(joined.behavior_logprobs, torch.tensor([[-0.7, 0, 0], [-0.3, -0.2, -0.1]]))
    assert joined.group_ids.tolist() == [0, 1] and joined.policy_version == 2
    assert per_token["values"].tolist() == [[0.5, 0.0, 0.0], [1.0, 2.0, 3.0]]
    assert "ref_logprobs" not in per_token          # no reference model: nothing to join
    assert joined.responses.tolist() == [[7, 0, 0], [3, 2, 1]]


def test_shards_of_two_policy_versions_are_refused():
    with pytest.raises(ValueError, match="different policy versions"):
        join_shards([_shard([[1]], [[2]], 1, 1, version=1), _shard([[1]], [[2]], 1, 1, version=2)])


def test_rank_shards_keep_each_mini_batch_the_same_rows_whatever_the_world_size():
    one = rank_shards(6, 1, 2)
    two = rank_shards(6, 2, 2)
    assert [b.tolist() for b in one[0]] == [[0, 1, 2], [3, 4, 5]]
    assert [[b.tolist() for b in rank] for rank in two] == [[[0, 1], [3, 4]], [[2], [5]]]


def test_rank_shards_refuse_a_rank_without_rows():
    # 7 rows in 2 mini-batches of 4 and 3 rows: 4 ranks would leave rank 3 nothing of the second.
    with pytest.raises(ValueError, match=r"actor: mini-batch 1 has 3 rows for 4 ranks.*train.prompts_per_step.*"
                                         r"train.mini_batches.*actor role fewer workers"):
        rank_shards(7, 4, 2, "actor")
    assert [[b.tolist() for b in rank] for rank in rank_shards(7, 3, 2)] == [[[0, 1], [4]], [[2], [5]], [[3], [6]]]


def test_even_chunks():
    assert even_chunks(3, 2) == [slice(0, 2), slice(2, 3)]   # 3 rows, as many chunks as a 2-chunk rank
    assert even_chunks(2, 2) == [slice(0, 1), slice(1, 2)]
    assert even_chunks(10, 3) == [slice(0, 4), slice(4, 7), slice(7, 10)]
    assert even_chunks(4, 1) == [slice(0, 4)]


