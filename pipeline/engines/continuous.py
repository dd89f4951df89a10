"""One generation request through the cuda_graph engine's decode slots (continuous batching).

The request's N sequences wait in a queue; S slots (S <= N, a power of two) decode one token
each per step. A slot whose sequence ended (a stop id, a stop string, max_new_tokens) takes
the next waiting sequence: its prompt is prefilled, together with the other sequences that
start at the same time, straight into the slot cache (slots.py). Once the queue is empty and
at most half of the slots are still live, the live ones move into a cache of fewer slots
(a power of two), so the long tail of a request decodes at ever smaller batches: a decode
step's time falls with its batch (each slot count is one more captured graph).

The loop talks to the GPU without waiting for it, except every EOS_CHECK_EVERY steps (and
every step on a CPU, where waiting costs nothing): there it learns which slots are free,
checks stop strings, and refills, shrinks or ends. A slot whose sequence ended in between
keeps decoding into a sink row until then; those steps are the slot use this reports.
What it learns is one look old: each look copies the slots' live flags to the host without
waiting, and the next look acts on that copy while the steps launched in between keep the
GPU busy. Otherwise the GPU would wait at every look for the host's scheduling and the
Python of eager prefill passes. Acting late is safe because only the host makes a slot live:
a slot free in the copy is still free. A request with stop strings looks at the present
instead (it reads the tokens too).

Partial rollouts (a request with `complete_groups`): the request holds more sequences than a
step needs, the rows carried from the request before first. Their tokens so far are prefilled
behind their prompts and they continue from there. At a sync point where `complete_groups`
groups have every sample finished (and every carried row that must end this time has), the
request ends: the slots never decode a tail, and what is unfinished goes to the next request.
A group with a row that could not be carried again (max_staleness) must complete first.
A row still live in a slot when its request ends stays there (HeldRows): the next request
on the same engine finds it by content among its carried rows and decodes on from the keys
and values already in the slot, under the new weights, instead of prefilling its prompt
and tokens again (a request with `keep_kv`).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Callable

import torch

from pipeline.engines.held_rows import HeldRows, row_key
from pipeline.engines.hf import left_pad, stop_ids_of
from pipeline.engines.prefill import PassClock, distinct_prefixes, prefill_mask, prefill_passes
from pipeline.engines.sampling import sample_tokens, stop_string_end
from pipeline.records import GenerationRequest, on_device

# Decode steps between two looks at the device (each is a device-to-host sync): 8 steps of
# overshoot after a sequence ends cost less than a sync every step.
EOS_CHECK_EVERY = 8
# A free slot waits until this share of the slots is free, so one prefill serves several.
REFILL_SHARE = 16
# Once nothing waits, the live rows move into fewer slots when at most 1/SHRINK_SHARE of the
# slots are live. Halving at each step down costs a captured graph per slot count (compiled
# once per run and shape) and keeps slot use higher than quartering.
SHRINK_SHARE = 2
# Act on the last look's copy of the slots' live flags (see the module's docstring); False acts
# on the present at every look, which waits for the device (benchmarks compare the two).
LAGGED_LOOKS = True
# Captured decode steps shrink no lower than this many slots. Below it a step costs about
# the same (the 0.5B shape on an H100: 2.23 ms at 32 slots, 2.17 at 16, 2.12 at 8), while
# each further slot count is one more graph to compile, 10-30 s that a partial run met in
# the middle of its training whenever a tail first got that short.
FEWEST_CAPTURED_SLOTS = 32
# Tokens one prefill pass holds at most. A pass's activations are freed after it, but the
# caching allocator keeps the memory they took reserved for the process, away from the roles
# beside it on the GPU: a layer's MLP over 32 768 prompt tokens (256 slots x 128, the
# 0.5B shape) is 1.0 GB at once, over 8192 tokens 0.24 GB. A pass of 8192 tokens is still
# wide enough for full-size matrix products; a batch of 256 prompts then prefills in four.
PREFILL_PASS_TOKENS = 8192


def bucket_batch(rows: int) -> int:
    """Rows rounded up to a power of two (at least 8): few distinct graph shapes."""
    return 1 << max(3, (max(rows, 1) - 1).bit_length())


class SlotRun:
    """The state of one request in the slots; `run()` -> (N, T) tokens and logprobs.

    `engine` provides: model, prefill_model (the model or its compiled forward), device, pad_id,
    eos_id, decode (ids -> text), compiled, prompt_bucket, fewest_slots (the tail shrinks no
    lower), check_every (decode steps between two looks at the device; None: the device's
    default),
    `_decode(token, position_ids, column, mask, cache, temperature, top_k, top_p, min_p)`
    (one decode step, maybe captured) and `_cache(slots, length)` (a SlotCache).
    """

    def __init__(self, engine, prompts: list[list[int]], width: int, request: GenerationRequest, slots: int,
                 groups: list[int] | None = None, held: HeldRows | None = None):
        """`prompts`: one per sequence, the request's carried rows first (`groups`: their
        group ids, needed with carried rows or complete_groups). `held`: the rows the last
        request left in the slots; those among the carried rows decode on from there.
        Afterwards `self.held` is what this request leaves (partial requests only)."""
        self.engine, self.prompts, self.width, self.request = engine, prompts, width, request
        self.max_new = request.max_new_tokens
        self.filters = (request.top_k, request.top_p, request.min_p)
        # A slot's window (its prompt's bucket and its response) never exceeds the ring.
        self.length = width + self.max_new
        device = self.device = engine.device
        self.sink = len(prompts)   # the output row of empty and finished slots
        self.tokens = torch.full((self.sink + 1, self.max_new), engine.pad_id, dtype=torch.long, device=device)
        self.logprobs = torch.zeros((self.sink + 1, self.max_new), dtype=torch.float32, device=device)
        self.lengths = torch.zeros(self.sink + 1, dtype=torch.long, device=device)
        self.stop_ids = torch.tensor(stop_ids_of(request, engine.eos_id), dtype=torch.long, device=device)
        self.columns = torch.arange(self.length, device=device)
        self.column = 0            # the ring column the next decode step writes (a host int: no sync)
        self.on_cuda = torch.device(device).type == "cuda"
        self.check_every = engine.check_every or (EOS_CHECK_EVERY if self.on_cuda else 1)
        self.stats = {"slots": slots}
        # The most tokens (rows x padded width) one prefill pass holds: what the engine's
        # memory plan counted for the request's prompts, and at most PREFILL_PASS_TOKENS. A
        # partial rollout's first refill can hold a hundred carried rows of 1152 tokens, whose
        # activations in one pass would be several GiB beyond the plan; in passes of this size
        # they stay within it.
        self.prefill_budget = min(slots * width, PREFILL_PASS_TOKENS)
        # Where a request's time goes besides decode steps: its prefill passes (tokens with
        # padding and without, device time from CUDA events, which need no sync) and the host
        # work at sync points, during which the device waits.
        self.prefill_clock = PassClock(self.on_cuda)
        self.stats.update(prefill_passes=0, prefill_tokens=0, prefill_real_tokens=0, prefill_shared=0, prefill_ms=0.0,
                          host_ms=0.0, continued=0)
        self.groups = groups
        self.held: HeldRows | None = None
        self._carry_in(request.carried, groups)
        self._start(slots, held)

    def _carry_in(self, carried, groups: list[int] | None) -> None:
        """Rows carried from the request before hold their tokens so far; a row that ended
        already (an unfinished sibling held its group back) only waits for its group. The
        host keeps which sequences have started and which group each belongs to."""
        count = len(self.prompts)
        self.prior = [len(row.response_ids) for row in carried] + [0] * (count - len(carried))  # tokens it came with
        self.prefixes = [row.prompt_ids + row.response_ids for row in carried] + self.prompts[len(carried):]
        self.started = torch.tensor([row.ended for row in carried] + [False] * (count - len(carried)))
        # A group is trained whole: one row too old to be carried again holds its whole group here.
        too_old = {row.group_id for row in carried
                   if row.born is not None and row.born < self.request.finish_born_before}
        self.must_end = torch.tensor([not row.ended and row.group_id in too_old for row in carried]
                                     + [False] * (count - len(carried)))   # rows this request must finish
        if carried:   # their tokens and logprobs so far, in one copy each
            tokens = torch.full((len(carried), self.max_new), self.engine.pad_id, dtype=torch.long)
            logprobs = torch.zeros((len(carried), self.max_new), dtype=torch.float32)
            for i, row in enumerate(carried):
                tokens[i, :len(row.response_ids)] = torch.tensor(row.response_ids, dtype=torch.long)
                logprobs[i, :len(row.logprobs)] = torch.tensor(row.logprobs, dtype=torch.float32)
            self.tokens[:len(carried)] = tokens.to(self.device)
            self.logprobs[:len(carried)] = logprobs.to(self.device)
            self.lengths[:len(carried)] = torch.tensor(self.prior[:len(carried)], device=self.device)
        self.queue = deque(i for i in range(count) if not self.started[i])
        self.new_tokens = -sum(self.prior)   # the request's own tokens, counted at the end
        if groups is not None:
            self.group_index = torch.unique(torch.tensor(groups), return_inverse=True)[1]
            self.group_sizes = torch.bincount(self.group_index)
        self.unfinished = torch.zeros(count, dtype=torch.bool)

    def _start(self, slots: int, held: HeldRows | None) -> None:
        self.cache = self.engine._cache(slots, self.length)
        device = self.device
        self.sequence = torch.full((slots,), self.sink, dtype=torch.long, device=device)  # what each slot holds
        self.generated = torch.zeros(slots, dtype=torch.long, device=device)            # its tokens so far
        self.active = torch.zeros(slots, dtype=torch.bool, device=device)
        self.position = torch.zeros((slots, 1), dtype=torch.long, device=device)        # rotary position fed next
        self.mask = torch.zeros((slots, 1, 1, self.length), dtype=torch.bool, device=device)
        self.token = torch.zeros(slots, dtype=torch.long, device=device)                # sampled, not yet recorded
        self.logprob = torch.zeros(slots, dtype=torch.float32, device=device)
        continued = set(self._continue_held(held) if held is not None and self.request.keep_kv else ())
        self._refill([slot for slot in range(slots) if slot not in continued])

    def _continue_held(self, held: HeldRows) -> list[int]:
        """Put the carried rows the last request left in its slots back into those slots, with
        their decode state, and start decoding at its ring column. Only when the slots are
        the same memory (this request's cache starts where that one did, and is as large)
        and the ring as long: otherwise they are prefilled like any carried row. Returns the
        slots taken."""
        same_memory = held.cache.keys[0].data_ptr() == self.cache.keys[0].data_ptr()
        if not same_memory or held.cache.length != self.length or held.cache.slots > self.cache.slots:
            return []
        pairs = [(sequence, slot) for sequence, row in enumerate(self.request.carried)
                 if (slot := held.take(row)) is not None]
        self.column = held.column
        if not pairs:
            return []
        sequences, slots = (list(part) for part in zip(*pairs))
        rows = torch.tensor(slots, device=self.device)
        for name, values in held.state.items():
            getattr(self, name)[rows] = values[rows]
        self.sequence[rows] = torch.tensor(sequences, device=self.device)
        self.active[rows] = True
        self.started[sequences] = True
        waiting = set(sequences)
        self.queue = deque(i for i in self.queue if i not in waiting)
        self.stats["continued"] = len(sequences)
        return slots

    @torch.no_grad()   # decode steps and the slot caches' in-place writes record no autograd graph
    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        steps_at: Counter[int] = Counter()        # decode steps at each slot count
        seconds_at: Counter[int] = Counter()      # their wall time, read at the sync points
        steps, clock = 0, time.perf_counter()
        lagged = LAGGED_LOOKS and not self.request.stop_strings
        look = self._look() if lagged else None   # the slots as of the last look, on their way
        while True:   # the prefill recorded each sequence's first token
            slots = self.cache.slots              # changes only at a sync point (_schedule)
            self._decode()
            self._record()
            steps_at[slots] += 1
            steps += 1
            if steps % self.check_every == 0:
                active, sequences = look() if lagged else self._present()   # waits for the device up to that look
                synced = time.perf_counter()
                done = not self._schedule(active, sequences)
                if lagged and not done:
                    look = self._look()           # after _schedule's refills and moves: it sees them
                now = time.perf_counter()
                self.stats["host_ms"] += 1e3 * (now - synced)
                seconds_at[slots] += now - clock
                clock = now
                if done:
                    break
        if self.request.complete_groups:          # what is unfinished now, not at the look
            self.unfinished = self._unfinished(*self._present())
        self.stats["decode_steps"] = steps
        self.stats["decode_steps_at"] = dict(steps_at)
        # Wall time per decode step at each slot count (prefills included): the tail's floor.
        self.stats["step_ms"] = {slots: round(1e3 * seconds_at[slots] / count, 3) for slots, count in steps_at.items()}
        slot_steps = sum(slots * count for slots, count in steps_at.items())
        lengths = self.lengths[:self.sink].cpu()
        self.stats["tokens"] = int(lengths.sum()) + self.new_tokens   # generated by this request
        self.stats["slot_use"] = self.stats["tokens"] / max(slot_steps + self.stats["slots"], 1)
        self.stats["carried_out"] = int(self.unfinished.sum())
        self.stats["prefill_ms"] = round(self.prefill_clock.milliseconds(), 3)
        self.stats["host_ms"] = round(self.stats["host_ms"], 3)
        if self.request.complete_groups and self.request.keep_kv:
            self.held = self._hold(lengths)
        width = max(1, int(lengths.max()))
        return self.tokens[:self.sink, :width].cpu(), self.logprobs[:self.sink, :width].cpu()

    def _hold(self, lengths: torch.Tensor) -> HeldRows:
        """The rows live in a slot now, keyed as the next request's carried rows will be."""
        live = (self.active & (self.sequence < self.sink)).nonzero().flatten()
        sequences = self.sequence[live].tolist()
        width = int(lengths[sequences].max()) if sequences else 0
        tokens = self.tokens[self.sequence[live], :width].cpu().tolist()
        slots: dict[tuple, list[int]] = {}
        for i, row, slot in zip(sequences, tokens, live.tolist()):
            slots.setdefault(row_key(self.groups[i], self.prompts[i], row[:int(lengths[i])]), []).append(slot)
        state = {name: getattr(self, name) for name in ("generated", "position", "mask", "token")}
        return HeldRows(self.cache, self.column, slots, state)

    def _record(self) -> None:
        """Write each live slot's token of the last decode step into its sequence's row; end
        the slots that sampled a stop id or reached max_new_tokens."""
        rows = torch.where(self.active, self.sequence, self.sink)
        columns = self.generated.clamp(max=self.max_new - 1)
        self.tokens[rows, columns] = self.token
        self.logprobs[rows, columns] = self.logprob
        self.generated += self.active
        self.lengths[rows] = self.generated
        self.active &= ~(torch.isin(self.token, self.stop_ids) | (self.generated >= self.max_new))

    def _decode(self) -> None:
        self.mask[:, 0, 0, self.column] = True
        if self.engine.compiled:
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are consumed
        token, logprob = self.engine._decode(self.token[:, None], self.position,
                                             self.columns[self.column:self.column + 1], self.mask, self.cache,
                                             self.request.temperature, *self.filters)
        self.token.copy_(token)
        self.logprob.copy_(logprob)
        self.position += 1
        self.column = (self.column + 1) % self.length

    def _schedule(self, active: torch.Tensor, sequences: torch.Tensor) -> bool:
        """At a sync point (`active`: the slots' live flags at the last look, `sequences`: what
        each slot held then): end rows at stop strings, refill free slots from the queue, or
        move the live rows into fewer slots once the queue is empty. False: all done."""
        if self.request.stop_strings:
            self._end_at_stop_strings()
            active, sequences = self._present()
        if self.request.complete_groups and self._groups_complete(active, sequences):
            return False
        free = (~active).nonzero().flatten().tolist()
        live, slots = len(active) - len(free), len(active)
        if self.queue:
            if len(free) >= max(1, slots // REFILL_SHARE) or live == 0:
                self._refill(free)
            return True
        if live == 0:
            return False
        if slots > self.engine.fewest_slots and bucket_batch(live) <= slots // SHRINK_SHARE:
            self._shrink(active)
        return True

    def _groups_complete(self, active: torch.Tensor, sequences: torch.Tensor) -> bool:
        """Partial rollouts: whether the request can end here, i.e. `complete_groups` groups
        have every sample finished and no row that must end this time is live. A row
        finished at a look stays finished, so a late look only ends the request later."""
        finished = ~self._unfinished(active, sequences)
        if (self.must_end & ~finished).any():
            return False
        done = torch.bincount(self.group_index, weights=finished.double(), minlength=len(self.group_sizes))
        return int((done == self.group_sizes).sum()) >= self.request.complete_groups

    def _present(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots' live flags and the sequence each holds, now: waits for every step launched."""
        return self.active.cpu(), self.sequence.cpu()

    def _unfinished(self, active: torch.Tensor, sequences: torch.Tensor) -> torch.Tensor:
        """(N,) bool: the sequences live in a slot (per `active` and `sequences`) or still waiting."""
        unfinished = ~self.started
        unfinished[sequences[active]] = True
        return unfinished

    def _look(self) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """Start copying the slots' live flags and the sequence each holds to the host; the
        returned function waits for the copy, not for the steps launched after it, and
        returns both."""
        if not self.on_cuda:
            seen = self.active.clone(), self.sequence.clone()
            return lambda: seen
        active = torch.empty(self.active.shape, dtype=torch.bool, pin_memory=True)
        sequences = torch.empty(self.sequence.shape, dtype=torch.long, pin_memory=True)
        active.copy_(self.active, non_blocking=True)
        sequences.copy_(self.sequence, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

        def wait() -> tuple[torch.Tensor, torch.Tensor]:
            copied.synchronize()
            return active, sequences
        return wait

    @torch.no_grad()   # also called while the run is set up
    def _refill(self, free: list[int]) -> None:
        """Prefill the next waiting sequences into the slots `free` (as many as wait), in the
        ring columns just before the next decode step's column. A carried row's prefill is its
        prompt and its tokens so far; it fits the ring, which holds a prompt and a whole
        response. Sequences with one prefix (a group's samples of a prompt) share its
        computation. The passes are prefill_passes' over the distinct prefixes, each of at
        most prefill_budget computed tokens."""
        count = min(len(free), len(self.queue))
        if count == 0:
            return
        waiting = [self.queue.popleft() for _ in range(count)]
        self.started[waiting] = True
        shared = distinct_prefixes([self.prefixes[sequence] for sequence in waiting])
        passes = prefill_passes([len(self.prefixes[waiting[positions[0]]]) for positions in shared],
                                self.engine.prompt_bucket, self.length, self.prefill_budget)
        for width, members in passes:
            self._prefill(width, [[free[i] for i in shared[m]] for m in members],
                          [[waiting[i] for i in shared[m]] for m in members])

    def _prefill(self, width: int, slots: list[list[int]], waiting: list[list[int]]) -> None:
        """One prefill pass: for each distinct prefix, the sequences `waiting[j]` that have it,
        into slots `slots[j]`. A prefix is computed once, left-padded to `width`, and its keys
        and values stored into each of its slots; each sequence samples its own first token."""
        ids, prefix_mask = left_pad([self.prefixes[sequences[0]] for sequences in waiting], self.engine.pad_id,
                                    width=width)
        self.stats["prefill_passes"] += 1
        self.stats["prefill_tokens"] += ids.numel()
        self.stats["prefill_real_tokens"] += int(prefix_mask.sum())
        self.stats["prefill_shared"] += sum(len(sequences) - 1 for sequences in waiting)
        timing = self.prefill_clock.start()
        source = [row for row, sequences in enumerate(waiting) for _ in sequences]   # each slot's prefix
        sources = self._to_device(source) if len(source) > len(waiting) else None   # None: all distinct
        slots, waiting = [s for group in slots for s in group], [s for group in waiting for s in group]
        rows, prior = self._to_device(slots), self._to_device([self.prior[i] for i in waiting])
        ids, prefix_mask = self._to_device(ids), self._to_device(prefix_mask)
        columns = (torch.arange(width, device=self.device) + self.column - width) % self.length
        logits = self.engine.prefill_model(input_ids=ids, attention_mask=prefill_mask(prefix_mask),
                                           position_ids=(prefix_mask.cumsum(-1) - 1).clamp(min=0), use_cache=False,
                                           logits_to_keep=1, slot_cache=self.cache, slot_rows=rows,
                                           slot_columns=columns, slot_sources=sources).logits[:, -1]
        prompt_mask = prefix_mask
        if sources is not None:
            logits, prompt_mask = logits.index_select(0, sources), prefix_mask.index_select(0, sources)
        token, logprob = sample_tokens(logits, self.request.temperature, *self.filters)
        sequences = self._to_device(waiting)
        self.tokens[sequences, prior], self.logprobs[sequences, prior] = token, logprob
        self.lengths[sequences] = prior + 1
        self.token[rows], self.sequence[rows], self.generated[rows] = token, sequences, prior + 1
        self.active[rows] = ~torch.isin(token, self.stop_ids) & (self.max_new > prior + 1)
        # Each slot's mask row: its prefix's real columns only (scatter and index_copy: an index
        # put broadcasting (k, 1) rows against (1, W) columns waited for the device).
        mask_rows = torch.zeros((len(slots), self.length), dtype=torch.bool, device=self.device)
        mask_rows.scatter_(1, columns.expand(len(slots), -1), prompt_mask.bool())
        self.mask.view(-1, self.length).index_copy_(0, rows, mask_rows)
        self.position[rows, 0] = prompt_mask.sum(-1)
        timing()

    def _to_device(self, values: torch.Tensor | list[int]) -> torch.Tensor:
        """Host values (ints) on the device, without waiting for the steps launched before
        (records.on_device)."""
        return on_device(values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.long),
                         self.device)

    def _shrink(self, active: torch.Tensor) -> None:
        """Move the live slots (and enough empty ones to fill a power of two) into a cache
        of fewer slots, the first rows of the request's own (no new allocation): the tail of
        the request decodes at a smaller batch."""
        live = active.nonzero().flatten().tolist()
        slots = max(bucket_batch(len(live)), self.engine.fewest_slots)
        empty = (~active).nonzero().flatten().tolist()[:slots - len(live)]
        rows = self._to_device(live + empty)
        smaller = self.engine._cache(slots, self.length)
        smaller.take_rows(self.cache, rows)
        self.cache = smaller
        for name in ("sequence", "generated", "active", "position", "mask", "token", "logprob"):
            setattr(self, name, getattr(self, name)[rows])

    def _end_at_stop_strings(self) -> None:
        """End the live slots whose text now holds a stop string.

        Only the tokens since the last check can complete one, so a tail window is decoded
        (the last EOS_CHECK_EVERY tokens plus as many before them as the longest string has
        characters, and two spare for a character split across tokens); a hit is confirmed
        on the whole row with the function assemble_rollout cuts with, so both agree."""
        stop_strings, decode = self.request.stop_strings, self.engine.decode
        slots = self.active.cpu().nonzero().flatten().tolist()
        if not slots:
            return
        index = torch.tensor(slots, device=self.device)
        rows, generated = self.tokens[self.sequence[index]].cpu(), self.generated[index].cpu().tolist()
        window = EOS_CHECK_EVERY + max(len(s) for s in stop_strings) + 2
        ended = [slot for slot, row, count in zip(slots, rows, generated)
                 if any(s in decode(row[max(0, count - window):count].tolist()) for s in stop_strings)
                 and stop_string_end(row[:count].tolist(), decode, stop_strings) >= 0]
        if ended:
            self.active[torch.tensor(ended, device=self.device)] = False
