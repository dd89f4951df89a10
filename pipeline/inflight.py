"""The batches in flight: each step's prompts submitted for generation, and scoring,
reference and critic passes chained on each shard as it lands, `max_staleness` steps ahead
of the update that consumes them.

With partial rollouts (train.partial_rollouts) a shard's rollout holds more rows than the
step trains on: the groups it completed are scored and trained on, the others are carried
into the next batch's requests (pipeline/partial.py), which is therefore submitted only once
this one has been generated: at most one batch ahead (partial.batches_ahead)."""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from dataclasses import dataclass

import torch

from pipeline import events
from pipeline.config import TrainConfig
from pipeline import partial
from pipeline.data import PromptStream
from pipeline.records import CarriedRow, GenerationRequest, RewardInputs, Rollout, Scores, join_scores
from pipeline.screening import informative_groups, select_samples
from pipeline.roles import critic, reference, reward, rollout

logger = logging.getLogger("dask_rl")


@dataclass
class Carry:
    """The rows a batch carries on (partial rollouts): futures, one per shard, until read.

    The carry and the batch's trained rows come from the same rollouts, so no group is in
    both, unless a rollout worker died after one was read and Dask generated the request
    again for the other: with train.partial_keep_kv that rollout can differ. `trained` (the
    groups the step took) and `rows` (once read) let whichever is read second leave out the
    groups of the first, so a group is trained once at most."""

    futures: list
    rows: tuple[CarriedRow, ...] | None = None
    trained: set[int] | None = None


@dataclass
class InFlightBatch:
    """One step's data while it is being generated and scored: futures, one per shard."""

    index: int
    prompt_position: int      # the prompt stream's position before this batch drew its prompts
    version: int              # policy version the rollouts are generated with
    rollouts: list
    scores: list
    ref_logprobs: list        # empty without a reference model (kl_coef 0)
    values: list              # empty for GRPO
    # Partial rollouts: the rows this batch continues, and those it carries on to the next.
    carried_in: tuple[CarriedRow, ...] = ()
    carry: Carry = dataclasses.field(default_factory=lambda: Carry([]))

    @property
    def futures(self) -> list:
        return self.rollouts + self.scores + self.ref_logprobs + self.values


class InFlight:
    def __init__(self, fleet, prompts: PromptStream, train_config: TrainConfig, roles: tuple[str, ...],
                 stop_token_ids: tuple[int, ...] = (), evaluates: bool = False):
        self.fleet, self.prompts, self.train_config, self.roles = fleet, prompts, train_config, roles
        self.evaluates = evaluates   # held-out evaluations read published weights too
        self.stop_token_ids = stop_token_ids  # the model's ends of turn (models.stop_token_ids)
        self._pending: deque[InFlightBatch] = deque()
        self._submitted = 0
        # Partial rollouts: what the last batch submitted carries (the next one continues
        # it), or the rows a checkpoint carried until a resumed run's first batch takes them.
        self._last: Carry | None = None
        self._restored: tuple[CarriedRow, ...] = ()
        self.partial_mode = ""   # partial rollouts: how batches overlap the update, for the user
        if train_config.partial_rollouts:   # decided at start; a later placement change keeps it
            take_turns = fleet.config.take_turns("rollout", "actor")
            self.ahead = partial.batches_ahead(train_config.max_staleness, take_turns)
            hosted = fleet.config.role("rollout").hosted_by == "actor"
            self.partial_mode = (
                ("the next batch generates during the update" if self.ahead else
                 "batches generate after the update (the rollout runs in the actor's processes)" if hosted else
                 "batches generate after the update (the rollout takes turns with the actor on its GPU; "
                 "gpu_sharing: mps lets them run at once)" if take_turns else
                 "batches generate after the update (max_staleness 1)")
                + f"; a carried row has {train_config.max_staleness - self.ahead} more step(s) to end"
                + ("; rows still decoding keep their keys and values" if train_config.partial_keep_kv else ""))
        else:
            self.ahead = train_config.max_staleness

    @property
    def published_versions(self) -> int:
        """Policy versions the actor keeps readable; under CUDA IPC each is a full copy of the
        weights on its GPU. A batch loads the version current when it was submitted, at most
        `ahead` updates before it starts generating: those versions and the newest. An
        evaluation may still be loading the newest while the next one is published: one more."""
        return self.ahead + 1 + int(self.evaluates)

    def next(self, version: int, weights) -> InFlightBatch:
        """The oldest in-flight batch no more than max_staleness versions old (older ones are
        dropped, never trained on), with the pipeline refilled behind it."""
        tc = self.train_config
        batch = self._pending.popleft() if self._pending else self._submit(version, weights)
        while version - batch.version > tc.max_staleness:
            logger.warning("dask-rl: dropping a batch of version %d (now %d, max_staleness %d)",
                           batch.version, version, tc.max_staleness)
            events.emit("stale-batch", f"dropped a batch of version {batch.version} at version {version} "
                        f"(max_staleness {tc.max_staleness})", client=self.fleet.client)
            batch = self._pending.popleft() if self._pending else self._submit(version, weights)
        while len(self._pending) < self.ahead:
            self._pending.append(self._submit(version, weights))
        return batch

    def carried_out(self, batch: InFlightBatch) -> tuple[CarriedRow, ...]:
        """The rows `batch` carried on to the next (partial rollouts)."""
        return self._read(batch.carry)

    def _read(self, carry: Carry) -> tuple[CarriedRow, ...]:
        if carry.rows is None:   # fetched once
            parts = self.fleet.wait("rollout", carry.futures, "the rows partial rollouts carry")
            rows = tuple(row for part in parts for row in part)
            carry.rows, carry.futures = partial.outside(rows, carry.trained or ()), []
            _warn_trained_twice(len(rows) - len(carry.rows), "left out of the carry")
        return carry.rows

    def resume_carried(self) -> tuple[CarriedRow, ...]:
        """The rows the batch at resume_point continues: a checkpoint keeps them."""
        if self._pending:
            return self._pending[0].carried_in
        return self._next_carried()

    def restore_carried(self, rows: tuple[CarriedRow, ...]) -> None:
        """A resumed run's first batch continues the rows the checkpoint's run carried."""
        self._restored, self._last = rows, None

    def _next_carried(self) -> tuple[CarriedRow, ...]:
        return self._read(self._last) if self._last is not None else self._restored

    def _submit(self, version: int, weights) -> InFlightBatch:
        """Submit generation for one step's prompts, and scoring that starts as each shard lands."""
        index, self._submitted = self._submitted, self._submitted + 1
        batch = InFlightBatch(index, self.prompts.position, version, [], [], [], [])
        self._add_shards(batch, weights, tag=str(index))
        return batch

    def fill_informative_groups(self, batch: InFlightBatch, weights) -> int:
        """DAPO's dynamic sampling (train.filter_groups): a group whose rewards are all equal
        has no advantage to learn from, so while fewer than prompts_per_step groups differ,
        one more step's worth of prompts is drawn into this batch, generated and scored as
        futures like the rest (the batches behind it keep generating), at most
        filter_groups_max_draws times. Returns the extra draws made."""
        tc = self.train_config
        for draw in range(tc.filter_groups_max_draws + 1):
            rollouts = self.fleet.wait("rollout", batch.rollouts, "generated rollouts")
            scores = join_scores(self.fleet.wait("reward", batch.scores, "rewards"))
            groups = torch.cat([r.group_ids for r in rollouts])
            if len(informative_groups(groups, scores.values)) >= tc.prompts_per_step or \
                    draw == tc.filter_groups_max_draws:
                return draw
            self._add_shards(batch, weights, tag=f"{batch.index}x{draw + 1}")
        return tc.filter_groups_max_draws

    def _add_shards(self, batch: InFlightBatch, weights, tag: str) -> None:
        """Draw prompts_per_step prompts into `batch`, a shard per rollout worker (with partial
        rollouts, as many as the step's requests need besides the carried rows)."""
        tc, fleet = self.train_config, self.fleet
        carried_rows = ()
        if tc.partial_rollouts:
            carried_rows = self._next_carried()
            batch.carried_in, self._last, self._restored = carried_rows, batch.carry, ()
        prompts, draws = self.prompts.next_batch(
            partial.new_groups(tc.prompts_per_step, carried_rows, tc.partial_request_groups)
            if tc.partial_rollouts else tc.prompts_per_step)
        n_shards = max(1, min(len(fleet.addresses("rollout")), len(prompts)))
        first = len(batch.rollouts)  # shards already in the batch: every shard gets its own seed
        carried = partial.shard_carried(carried_rows, n_shards) if tc.partial_rollouts else None
        for shard in range(n_shards):
            request = GenerationRequest(prompt_ids=prompts[shard::n_shards], group_ids=draws[shard::n_shards],
                                        samples_per_prompt=tc.samples_per_prompt, max_new_tokens=tc.max_new_tokens,
                                        temperature=tc.temperature,
                                        seed=tc.seed * 1_000_003 + batch.index * 1009 + first + shard,
                                        stop_token_ids=self.stop_token_ids, stop_strings=tc.stop, top_k=tc.top_k,
                                        top_p=tc.top_p, min_p=tc.min_p)
            if carried is not None:   # its carried groups first; it ends at its share of prompts_per_step
                request = dataclasses.replace(
                    request, carried=carried[shard],
                    complete_groups=len(range(tc.prompts_per_step)[shard::n_shards]),
                    finish_born_before=partial.finish_born_before(batch.version, tc.max_staleness, self.ahead),
                    keep_kv=tc.partial_keep_kv)
            shard_tag = f"{tag}-{shard}"
            generated = fleet.submit("rollout", rollout.generate, request, weights, tag=shard_tag)
            if carried is not None:
                split = (generated, request.complete_groups, request.finish_born_before)
                batch.carry.futures.append(fleet.submit("rollout", partial.carried_part, *split, tag=shard_tag))
                generated = fleet.submit("rollout", partial.trained_part, *split, tag=shard_tag)
            groups = list(dict.fromkeys([row.group_id for row in request.carried] + request.group_ids))
            batch.rollouts.append(generated)
            batch.scores.append(fleet.submit("reward", reward.score, generated,
                                             self._reward_inputs(groups), tag=shard_tag))
            if "reference" in self.roles:
                batch.ref_logprobs.append(fleet.submit("reference", reference.ref_logprobs, generated,
                                                       tc.temperature, tag=shard_tag))
            if "critic" in self.roles:
                batch.values.append(fleet.submit("critic", critic.values, generated, tc.micro_batch_size,
                                                 tc.pack_sequences, tag=shard_tag))

    def _reward_inputs(self, draws: list[int]) -> RewardInputs | None:
        """The original prompt and the fields of each drawn row, by group id (its draw number)."""
        rows = [self.prompts.row(d) for d in draws]
        if any(row is None for row in rows):
            return None
        return RewardInputs({d: r.prompt for d, r in zip(draws, rows)}, {d: r.fields for d, r in zip(draws, rows)})

    def resume_point(self) -> tuple[int, int]:
        """(batch index, prompt position) of the first batch not trained on yet: a resumed run
        submits again from there (batches in flight at the save are generated anew)."""
        if self._pending:
            return self._pending[0].index, self._pending[0].prompt_position
        return self._submitted, self.prompts.position

    def resume_from(self, index: int, prompt_position: int) -> None:
        self._submitted, self.prompts.position = index, prompt_position

    def cancel(self) -> None:
        """Drop the batches still in flight (at close)."""
        for batch in self._pending:
            self.fleet.client.cancel(batch.futures + batch.carry.futures)
        self._pending.clear()
        if self._last is not None:
            self.fleet.client.cancel(self._last.futures)
            self._last = None


def take_trained(batch: InFlightBatch, data: Rollout, scores: Scores,
                 per_token: dict[str, torch.Tensor]) -> tuple[Rollout, Scores, dict[str, torch.Tensor]]:
    """Partial rollouts: the step's rows of `batch`, less any group its carry (if read
    already) holds; the groups taken are noted, so the carry read later leaves them out."""
    carried = torch.tensor(sorted({row.group_id for row in batch.carry.rows or ()}), dtype=data.group_ids.dtype)
    keep = (~torch.isin(data.group_ids, carried)).nonzero().flatten()
    if 0 < len(keep) < len(data):   # (none left: the step trains them all rather than nothing)
        _warn_trained_twice(len(data) - len(keep), "left out of the step (the carry holds their groups)")
        data, scores, per_token = select_samples(keep, data, scores, per_token)
    batch.carry.trained = set(data.group_ids.tolist())
    return data, scores, per_token


def _warn_trained_twice(rows: int, what: str) -> None:
    if rows:
        logger.warning("dask-rl: partial rollouts: a rollout generated again after its worker was lost differs "
                       "from the first (as it can with train.partial_keep_kv); %d rows of groups both trained and "
                       "carried were %s, so each group is trained once", rows, what)
