"""Sizing work to the memory a GPU has left, and surviving out-of-memory errors.

Three pieces, used by every role that runs a model on a worker:

- `MicroBatchAllocator`: rows per micro-batch from the memory this process can still
  allocate (`free_bytes`) and the measured peak bytes per token; `backoff` halves after an
  out-of-memory error. Gradients are sums over global token counts, so an optimizer step
  redone with smaller micro-batches gives the same update.
- `in_chunks`: a function over consecutive row slices that, on torch.OutOfMemoryError,
  halves the slice and retries it, keeping the slices already done (no-grad forwards,
  generation: rows are independent, so the result does not depend on the split).
- `report`: every degradation is one warning line (role, what, sizes, reason) and an
  event under DEGRADATION_TOPIC that the driver counts into the step's record.
- `group_min` / `group_max` / `group_any`: what the ranks of a process group agree on, and
  `GroupOutOfMemory`: what a sharded rank raises when it cannot back off by itself.

torch and distributed are imported inside the functions: the resource planning that
imports this package must not load them.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable, TypeVar

from resources.config import ROLES

logger = logging.getLogger("dask_rl")

# The Dask event topic workers log degradations under (Client.get_events reads them).
DEGRADATION_TOPIC = "dask-rl-degradation"
OUT_OF_MEMORY = "out of memory"    # the `cause` of a degradation forced by an allocation failure
LOW_FREE_MEMORY = "free memory"    # the `cause` of work planned smaller from a memory reading
KERNEL_FAILED = "kernel failed"    # the `cause` of a custom GPU kernel replaced by PyTorch's own operators

T = TypeVar("T")

# Rows per micro-batch of `micro_batch_size: auto` where no token budget applies: on a CPU,
# and in the no-grad forwards (reference, critic values, proximal logprobs), whose
# activations are freed layer by layer.
AUTO_ROWS = 16


# The most real tokens a budgeted micro-batch takes, however much memory is free. A pass of
# this many tokens keeps a GPU's matrix units busy; beyond it fewer passes save nothing (a
# 0.5B actor's packed update of 256 long-tailed rows on one H100: 1.80 s at 32 768 tokens a
# micro-batch, 1.97 s at 65 536, 2.02 s at 16 384), and the memory is better left free: a
# rollout engine on the same GPU sizes its decode slots from what is free (peak 7.6 GiB at
# 32 768 against 9.3 GiB at 65 536).
AUTO_MAX_TOKENS = 32768


def rows_per_micro_batch(micro_batch_size: int | str) -> int:
    """A configured micro_batch_size as rows: an int as it is, "auto" as AUTO_ROWS."""
    return AUTO_ROWS if micro_batch_size == "auto" else micro_batch_size


class OutOfMemoryAtOneRow(RuntimeError):
    """Even a single row does not fit: smaller micro-batches cannot help."""


class GroupOutOfMemory(RuntimeError):
    """One rank of a sharded (FSDP) group ran out of memory with micro-batches of `rows` rows.

    The other ranks are waiting in the collectives it left, so the group cannot redo the
    step by itself (as data-parallel ranks do): the driver frees them and redoes the update
    with smaller micro-batches. Raised on the worker, caught on the driver (it travels
    pickled, hence __reduce__).
    """

    def __init__(self, role: str, rows: int, what: str, detail: str):
        super().__init__(f"{role}: out of memory under FSDP in the {what} with micro-batches of {rows} rows "
                         f"({detail})")
        self.role, self.rows, self.what, self.detail = role, rows, what, detail

    def __reduce__(self):
        return type(self), (self.role, self.rows, self.what, self.detail)


@dataclass
class MicroBatchAllocator:
    headroom: float = 0.8                 # share of free memory a micro-batch may plan to use
    bytes_per_token: float | None = None  # the largest peak activation bytes per token seen so far
    max_tokens: int = AUTO_MAX_TOKENS     # the most real tokens a budgeted micro-batch takes

    def rows(self, max_rows: int, tokens_per_row: int, free_bytes: int | None) -> int:
        """Rows per micro-batch: at most `max_rows`, at least 1.

        Without a measurement or a memory reading (CPU) the configured size stands.
        """
        if free_bytes is None or not self.bytes_per_token or tokens_per_row <= 0:
            return max_rows
        fit = int(self.headroom * free_bytes / (self.bytes_per_token * tokens_per_row))
        return max(1, min(max_rows, fit))

    def tokens(self, first_budget: int, free_bytes: int | None) -> int:
        """Real tokens per micro-batch (the budget of packed micro-batches): `first_budget`
        until a measurement and a memory reading exist, then token_budget of them; never
        more than max_tokens."""
        if free_bytes is None or not self.bytes_per_token:
            return min(first_budget, self.max_tokens)
        return min(token_budget(free_bytes, self.bytes_per_token, self.headroom), self.max_tokens)

    def observe(self, peak_bytes: int, tokens: int) -> None:
        """Record a micro-batch's peak extra memory; keep the worst case per token."""
        if tokens > 0 and peak_bytes > 0:
            self.bytes_per_token = max(self.bytes_per_token or 0.0, peak_bytes / tokens)

    def observe_out_of_memory(self, free_bytes: int | None, tokens: int) -> None:
        """A micro-batch of `tokens` tokens did not fit in `free_bytes`: it needs more than
        free_bytes / tokens a token. Remembering that keeps the next plan below the size
        that failed (rows() <= headroom x the failed size) until more memory is free."""
        if free_bytes and tokens > 0:
            self.observe(free_bytes, tokens)

    @staticmethod
    def backoff(rows: int) -> int:
        """The next size after an out-of-memory error at `rows`."""
        if rows <= 1:
            raise OutOfMemoryAtOneRow("out of memory with a micro-batch of one row: the model, its optimizer "
                                      f"state and one sequence do not fit this device{capped_at()}; shorten "
                                      "max_new_tokens or prompts, use fsdp over more GPUs, or a smaller model")
        return rows // 2


def capped_at() -> str:
    """", under this process's cap of N GiB (...)" where a cap (a role's max_gpu_memory_gib)
    holds this process below its GPU, else "": an out-of-memory error's likeliest fix then."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return ""
    fraction = cap_fraction(torch.cuda.current_device())
    if fraction >= 1.0:
        return ""
    cap = fraction * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return (f", under this process's cap of {cap / 2**30:.1f} GiB (raise the role's max_gpu_memory_gib; a "
            f"rollout hosted by the actor keeps its KV cache within the actor's)")


def token_budget(free_bytes: int, bytes_per_token: float, headroom: float) -> int:
    """The most tokens whose activations (`bytes_per_token` each, measured at its peak)
    fit in `headroom` x `free_bytes`; at least 1."""
    return max(1, int(headroom * free_bytes / bytes_per_token))


def free_bytes(device: Any) -> int | None:
    """Bytes this process can still allocate on `device`; None off CUDA (no reading).

    The GPU's free memory (other processes' use already taken out) plus what torch's
    caching allocator holds without using it, within this process's cap
    (torch.cuda.set_per_process_memory_fraction): under a cap the device may be nearly
    empty and still refuse the next allocation.
    """
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    available = free + torch.cuda.memory_reserved(device) - allocated
    return max(0, min(available, int(cap_fraction(device) * total) - allocated))


def cap_fraction(device: Any) -> float:
    """The share of `device`'s memory torch may allocate in this process
    (torch.cuda.set_per_process_memory_fraction, a role's max_gpu_memory_gib); 1.0 without
    a cap or on a torch before 2.6, which cannot read it."""
    import torch

    read = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return 1.0 if read is None else read(device)


def limit_gpu_memory(gib: float, device: Any = 0) -> float | None:
    """Cap what this process allocates through torch on `device` at `gib` GiB (a role's
    max_gpu_memory_gib): the caching allocator refuses more, and free_bytes, by which
    micro-batches, generation slots and KV caches are sized, counts only what is left under
    it. Returns the fraction of the device's memory set; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, gib * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def release_cached(device: Any = None) -> None:
    """Hand the blocks torch cached but no longer uses back to the GPU (after an
    out-of-memory error: the next, smaller attempt and co-located roles need them)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized() and (
            device is None or torch.device(device).type == "cuda"):
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class Degradation:
    """Work made smaller so that it fits: what, on which role, from what size to what, why."""

    role: str
    what: str        # e.g. "reference logprobs", "optimizer step"
    before: int
    after: int
    unit: str        # "rows per chunk", "rows per micro-batch", "sequences per batch"
    cause: str       # OUT_OF_MEMORY, LOW_FREE_MEMORY or KERNEL_FAILED
    detail: str      # the error's first line, or the memory reading

    def line(self) -> str:
        return f"{self.role}: {self.what}: {self.before} -> {self.after} {self.unit} ({self.cause}: {self.detail})"


# This process's latest degradations, oldest first (bounded: a worker lives for a whole run).
_REPORTED: deque[Degradation] = deque(maxlen=1000)


def reported() -> list[Degradation]:
    """The degradations this process reported (a worker's own view; the driver reads events)."""
    return list(_REPORTED)


def report(what: str, before: int, after: int, unit: str, cause: str, detail: str, *,
           role: str | None = None, client: Any = None) -> Degradation:
    """Log one degradation as one line and publish it as an event: from a Dask worker, or,
    for a decision the driver takes about `role`, through the driver's `client`."""
    worker = _current_worker()
    degradation = Degradation(role or _role_of(worker), what, before, after, unit, cause,
                              " ".join(str(detail).split())[:200])
    _REPORTED.append(degradation)
    logger.warning("dask-rl: degraded %s", degradation.line())
    if worker is not None:
        worker.log_event(DEGRADATION_TOPIC, {**asdict(degradation), "worker": str(worker.name)})
    elif client is not None:
        client.log_event(DEGRADATION_TOPIC, {**asdict(degradation), "worker": "driver"})
    return degradation


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _current_worker():
    try:
        from distributed import get_worker

        return get_worker()
    except (ImportError, ValueError):  # not inside a Dask task
        return None


def _role_of(worker) -> str:
    if worker is None:
        return "local"
    resources = worker.state.total_resources
    return next((name for name in resources if name in ROLES), str(worker.name))


def in_chunks(fn: Callable[[slice], T], num_rows: int, rows: int, *, what: str, device: Any = None,
              unit: str = "rows per chunk", on_shrink: Callable[[int], None] | None = None) -> tuple[list[T], int]:
    """`fn` over consecutive row slices of at most `rows` rows, in order.

    An out-of-memory error halves the slice size until it is below the slice that failed
    (a power of two stays one) and retries that slice; the slices already done are kept,
    so `fn` must treat rows independently (no-grad forwards, generation). `on_shrink(size)`
    runs before the retry (an engine drops buffers sized for the old size there). Returns
    the outputs and the size the last slice ran with. One row that does not fit raises
    OutOfMemoryAtOneRow.
    """
    import torch

    outputs: list[T] = []
    start, rows = 0, max(1, rows)
    while start < num_rows:
        part = slice(start, min(start + rows, num_rows))
        failure = None
        try:
            outputs.append(fn(part))
        except torch.OutOfMemoryError as error:
            failure = first_line(error)
        # Outside the except block: its traceback held the failed attempt's tensors.
        if failure is None:
            start = part.stop
            continue
        smaller = rows
        while smaller >= part.stop - part.start:
            smaller = MicroBatchAllocator.backoff(smaller)
        if on_shrink is not None:
            on_shrink(smaller)
        release_cached(device)
        report(what, rows, smaller, unit, OUT_OF_MEMORY, failure)
        rows = smaller
    return outputs, rows


def group_min(value: int, device: Any = "cpu") -> int:
    """The smallest `value` over the ranks of the default process group, through one
    all_reduce; `value` itself where no group of several ranks is running. Every rank
    must call it (a collective)."""
    return _all_reduce(value, "MIN", device)


def group_max(value: int, device: Any = "cpu") -> int:
    """The largest `value` over the ranks (one all_reduce; every rank must call it)."""
    return _all_reduce(value, "MAX", device)


def group_any(flag: bool, device: Any = "cpu") -> bool:
    """Whether `flag` is true on any rank (one all_reduce; every rank must call it)."""
    return bool(_all_reduce(int(flag), "MAX", device))


def _all_reduce(value: int, op: str, device: Any) -> int:
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    # NCCL reduces CUDA tensors only; gloo reduces CPU tensors.
    where = device if dist.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor([value], dtype=torch.int64, device=where)
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op))
    return int(tensor.item())
