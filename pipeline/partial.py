"""Partial rollouts (train.partial_rollouts): a step trains on the groups a rollout finished,
and the unfinished ones continue in the next step's request. A request holds twice the groups
a step needs (new_groups): it ends once a step's worth are complete, and the rest, started or
still waiting, is carried.

A GRPO group is trained whole, so a group with one unfinished sample waits whole: its
finished samples are carried too (they are not generated again). Each carried row keeps the
version of its first token; `finish_born_before` makes the engine end, in this request, every
row that would be older than max_staleness when trained if it were carried once more.
"""

from __future__ import annotations

import torch

from pipeline.records import CarriedRow, Rollout


def open_groups(rollout: Rollout) -> torch.Tensor:
    """(B,) bool: the rows whose group has an unfinished row."""
    unfinished_groups = rollout.group_ids[rollout.unfinished].unique()
    return torch.isin(rollout.group_ids, unfinished_groups)


def trained_part(rollout: Rollout) -> Rollout:
    """Task: the rows of the groups that every sample finished: what this step trains on."""
    return rollout.select((~open_groups(rollout)).nonzero().flatten())


def carried_part(rollout: Rollout) -> tuple[CarriedRow, ...]:
    """Task: the rows of the other groups, as the next request continues them."""
    rows = []
    for row in open_groups(rollout).nonzero().flatten().tolist():
        prompt, response = rollout.token_ids(row)
        mask = rollout.response_mask[row].bool()
        born = int(rollout.born[row])
        rows.append(CarriedRow(prompt_ids=prompt, response_ids=response,
                               logprobs=rollout.behavior_logprobs[row][mask].tolist(),
                               group_id=int(rollout.group_ids[row]), born=None if born < 0 else born,
                               ended=not bool(rollout.unfinished[row])))
    return tuple(rows)


def new_groups(prompts_per_step: int, carried: tuple[CarriedRow, ...]) -> int:
    """Groups a batch draws: a request holds twice the groups its step trains on (the carried
    ones and new ones), so that its slots are full until prompts_per_step groups complete. A
    step trains on at least prompts_per_step groups and carries the rest, so the draws match
    what is trained."""
    return 2 * prompts_per_step - len({row.group_id for row in carried})


def finish_born_before(version: int, max_staleness: int) -> int:
    """A request generated with `version` is trained on by the update from `version` (the
    batches are not generated ahead); a row it carries is trained on one version later at
    the earliest. Rows whose first token is older than that allows must end now."""
    return version + 1 - max_staleness


def shard_carried(rows: tuple[CarriedRow, ...], shards: int) -> list[tuple[CarriedRow, ...]]:
    """The carried rows split over `shards` requests, each group whole in one (round-robin
    by group, oldest first)."""
    groups = list(dict.fromkeys(row.group_id for row in rows))
    owner = {group: i % shards for i, group in enumerate(groups)}
    return [tuple(row for row in rows if owner[row.group_id] == shard) for shard in range(shards)]
