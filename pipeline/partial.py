"""Partial rollouts (train.partial_rollouts): a step trains on the groups a rollout finished,
and the unfinished ones continue in the next step's request. A request holds more groups
than a step needs, the carried ones and new ones (new_groups): it ends once a step's worth
are complete, and the rest, started or still waiting, is carried.

A GRPO group is trained whole, so a group with one unfinished sample waits whole: its
finished samples are carried too (they are not generated again). Each carried row keeps the
version of its first token; `finish_born_before` makes the engine complete, and the step train
on, every group with a row that would be older than max_staleness if it were carried again.
"""

from __future__ import annotations

import torch

from pipeline.records import CarriedRow, Rollout


def trained_groups(rollout: Rollout, needed: int, floor: int) -> torch.Tensor:
    """The groups a step trains on: of those every sample finished, first each with a row
    older than `floor` allows to carry again (finish_born_before), then the oldest others
    (the carried ones come first in a request), `needed` in all unless more must go now."""
    order = list(dict.fromkeys(rollout.group_ids.tolist()))
    open_ = set(rollout.group_ids[rollout.unfinished].tolist())
    old = set(rollout.group_ids[(rollout.born >= 0) & (rollout.born < floor)].tolist())
    complete = [g for g in order if g not in open_]
    must = [g for g in complete if g in old]
    others = [g for g in complete if g not in old]
    return torch.tensor(must + others[:max(0, needed - len(must))], dtype=torch.long)


def trained_part(rollout: Rollout, needed: int, floor: int) -> Rollout:
    """Task: the rows of the groups this step trains on (trained_groups)."""
    return rollout.select(torch.isin(rollout.group_ids, trained_groups(rollout, needed, floor)).nonzero().flatten())


def carried_part(rollout: Rollout, needed: int, floor: int) -> tuple[CarriedRow, ...]:
    """Task: the rows of the other groups, as the next request continues them (a complete
    group left for the next step waits there, its rows ended)."""
    carried = ~torch.isin(rollout.group_ids, trained_groups(rollout, needed, floor))
    rows = []
    for row in carried.nonzero().flatten().tolist():
        prompt, response = rollout.token_ids(row)
        mask = rollout.response_mask[row].bool()
        born = int(rollout.born[row])
        rows.append(CarriedRow(prompt_ids=prompt, response_ids=response,
                               logprobs=rollout.behavior_logprobs[row][mask].tolist(),
                               group_id=int(rollout.group_ids[row]), born=None if born < 0 else born,
                               ended=not bool(rollout.unfinished[row])))
    return tuple(rows)


def outside(carried: tuple[CarriedRow, ...], groups) -> tuple[CarriedRow, ...]:
    """The carried rows whose group is not among `groups` (group ids)."""
    groups = set(groups)
    return tuple(row for row in carried if row.group_id not in groups)


def new_groups(prompts_per_step: int, carried: tuple[CarriedRow, ...], request_groups: int = 2) -> int:
    """Groups a batch draws. The first request of a run (nothing carried) draws
    `request_groups` x prompts_per_step groups (train.partial_request_groups), so that its
    slots stay full while prompts_per_step groups complete; later ones draw prompts_per_step,
    the groups a step trains. Every group drawn is trained once, so steps train
    prompts_per_step groups on average: a step that must take more (rows that would grow too
    old) shrinks the carried pool, and the steps after it go back to prompts_per_step. Topping
    the pool up to its first size instead made each step train what the staleness bound
    drains from it: 1.2-3x prompts_per_step groups (benchmarks/partial_step_size.py)."""
    if carried:
        return prompts_per_step
    return request_groups * prompts_per_step


def batches_ahead(max_staleness: int, take_turns: bool) -> int:
    """Batches generated ahead of the update with partial rollouts. A batch continues the rows
    the one before carried, so batches generate one after the other: one ahead is all the
    overlap there is, and it pays only when the rollout's GPU work can run beside the actor's
    (GPUs of its own, or one shared under MPS); where the two take turns on a GPU, the step
    is their sum either way. It costs a version of the carried rows' allowance, so it needs
    max_staleness 2 or more."""
    return 1 if max_staleness >= 2 and not take_turns else 0


def finish_born_before(version: int, max_staleness: int, ahead: int = 0) -> int:
    """A request generated with `version` is trained on by the update from `version + ahead`
    (`ahead` batches generate ahead); a row it carries is trained on one version later at
    the earliest. Groups with a row whose first token is older than that allows must
    complete, and be trained on, now."""
    return version + 1 + ahead - max_staleness


def shard_carried(rows: tuple[CarriedRow, ...], shards: int) -> list[tuple[CarriedRow, ...]]:
    """The carried rows split over `shards` requests, each group whole in one (round-robin
    by group, oldest first)."""
    groups = list(dict.fromkeys(row.group_id for row in rows))
    owner = {group: i % shards for i, group in enumerate(groups)}
    return [tuple(row for row in rows if owner[row.group_id] == shard) for shard in range(shards)]
