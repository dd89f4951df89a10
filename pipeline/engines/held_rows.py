"""The rows a partial request leaves live in its decode slots, for the next request on the
same engine (train.partial_keep_kv): where each is, by content, and the decode state that
goes with it. continuous.SlotRun makes them at a request's end and takes them back at the
next one's start."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.engines.slots import SlotCache
from pipeline.records import CarriedRow


def row_key(group_id: int, prompt_ids, response_ids) -> tuple:
    """What identifies a carried row between two requests: its group and its tokens."""
    return group_id, tuple(prompt_ids), tuple(response_ids)


@dataclass
class HeldRows:
    """The rows a partial request left live in its decode slots, for the next request.

    Their keys and values (computed by the weights that generated them) are in `cache`'s
    slots; `state` holds each slot's decode state (tokens so far, next rotary position,
    ring mask, the sampled token not yet fed) and `column` the ring column the next step
    writes. A request continues a row only while nothing else used the cache since."""

    cache: SlotCache
    column: int
    slots: dict[tuple, list[int]]     # row_key -> the slots holding a row of that content
    state: dict[str, torch.Tensor]    # name -> per-slot tensor (generated, position, mask, token)

    def take(self, row: CarriedRow) -> int | None:
        """The slot `row` goes on in, or None. Two samples of a group may hold the same
        tokens so far: each takes one of their slots (with the same content they are alike)."""
        if row.ended:
            return None
        slots = self.slots.get(row_key(row.group_id, row.prompt_ids, row.response_ids))
        return slots.pop() if slots else None
