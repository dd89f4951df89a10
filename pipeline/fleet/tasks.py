"""Submitting role tasks and waiting for them, with readable keys and bounded waits."""

from __future__ import annotations

import logging
import time
from concurrent.futures import CancelledError
from typing import Iterable

from distributed import Client, Future, wait
from distributed.comm import CommClosedError

from pipeline import events

# submit lives with the role-tagged workers it targets, so that pipeline.roles.sync can use it
# without importing this driver-side module; the driver modules keep importing it from here.
from resources.cluster import live_workers, role_addresses, submit, task_key  # noqa: F401


logger = logging.getLogger("dask_rl")


class RoleTimeout(TimeoutError):
    """A wait on a role's tasks ran past timeout_seconds."""


class WorkerLost(RuntimeError):
    """A task pinned to one worker (a rank of a process group) lost that worker: it would
    wait forever for it, so the wait ends as soon as the worker is gone. `role`, where known,
    is the role whose group lost it."""

    def __init__(self, message: str, role: str | None = None):
        super().__init__(message)
        self.role = role


class SchedulerLost(ConnectionError):
    """The client lost its scheduler (the process died, or its host went away): every task
    and result went with it, so no wait can end well; the message names the address."""


def scheduler_lost(client: Client, doing: str) -> SchedulerLost | None:
    """SchedulerLost naming the scheduler and what was under way, if the client lost it
    (Dask's client retries for its connect timeout, then closes); None while it is connected."""
    if client.status == "running":
        return None
    address = getattr(client.scheduler, "address", None) or "?"
    return SchedulerLost(
        f"the Dask scheduler at {address} is gone (the client is {client.status}) while {doing}; its tasks and "
        f"results went with it. Fix: restart it (`dask-rl scheduler`), start the role workers again (`dask-rl "
        f"worker`), and resume the run from its newest checkpoint (resume=True, or `dask-rl run FILE --resume`).")


def scheduler_lost_after(client: Client, error: BaseException, doing: str, settle: float = 5.0
                         ) -> SchedulerLost | None:
    """scheduler_lost, for an error that may be the first sign of the loss: a closed
    connection or a cancelled future can reach the caller a moment before the client sees its
    scheduler's stream close and leaves "running", so then it gets up to `settle` seconds to
    see it (other errors, a timeout or a file not found, are not kept waiting)."""
    lost = scheduler_lost(client, doing)
    deadline = time.monotonic() + settle
    connection = isinstance(error, (CommClosedError, ConnectionError, CancelledError))
    while lost is None and connection and time.monotonic() < deadline:
        time.sleep(0.1)
        lost = scheduler_lost(client, doing)
    return lost


def wait_role(client: Client, futures: Iterable[Future], role: str, what: str, timeout: float,
              pinned: dict[str, tuple[str, ...]] | None = None) -> list:
    """Results of `futures`, or RoleTimeout naming the role, the workers and what was awaited.

    The first failed task ends the wait at once (its siblings, e.g. the other ranks of one
    process group, are cancelled), and so does the loss of a worker a pending task is pinned
    to (`pinned`: key -> the addresses it may run on): WorkerLost. While the role has no live
    worker a warning says that it waits for a replacement.
    """
    futures = list(futures)
    deadline = time.monotonic() + timeout
    warned = False
    fetch_seconds = 5.0
    while True:
        lost = scheduler_lost(client, f"waiting for {role}: {what}")
        if lost is not None:  # its futures were cancelled with it: nothing below would end well
            raise lost
        # "lost": it had finished, but the worker holding its result died before the result
        # was fetched. Dask computes it again (or, pinned to that worker, cannot): pending.
        pending = [f for f in futures if f.status in ("pending", "lost")]
        failed = [f for f in futures if f.status == "error"]
        if failed:
            client.cancel(pending)
            failed[0].result()
        # Dask cancels a task whose inputs were scattered to a worker that died (Fleet.place).
        cancelled = [f for f in futures if f.status == "cancelled"]
        if cancelled and pinned:
            _raise_if_pinned_worker_gone(client, cancelled + pending, pinned, role, what, settle=5.0)
        if not pending:
            # Not client.gather: when the worker holding a result dies before it is fetched,
            # Dask reschedules the task, and a task pinned to that worker would make gather
            # wait forever. A bounded fetch notices it (the task is pending or lost again) and
            # goes back to the checks above; a merely slow transfer gets a longer bound next time.
            try:
                return [f.result(timeout=fetch_seconds) for f in futures]
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise RoleTimeout(f"{role}: waited {timeout:.0f}s (timeout_seconds) for {what}; its results "
                                      f"could not be fetched. Fix: check the {role} workers' logs on the "
                                      f"dashboard or raise timeout_seconds.") from None
                fetch_seconds *= 2
                continue
        if pinned:
            _raise_if_pinned_worker_gone(client, pending, pinned, role, what)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RoleTimeout(_describe_stuck(client, pending, role, what, timeout))
        try:
            wait(pending, timeout=min(remaining, 1.0 if pinned else 5.0), return_when="FIRST_COMPLETED")
        except CancelledError:   # one was cancelled while waited for: the checks above say why
            continue
        except TimeoutError:
            if not warned and not role_addresses(client, role):
                logger.warning("dask-rl: %s has no live worker; waiting up to %.0fs for a replacement "
                               "(update_resource or `dask-rl worker ... --role %s`) to finish %s",
                               role, remaining, role, what)
                events.emit("fault", f"{role} has no live worker; waiting up to {remaining:.0f}s for a replacement "
                            f"to finish {what}", client=client, role=role)
                warned = True


def _raise_if_pinned_worker_gone(client: Client, pending: list[Future], pinned: dict[str, tuple[str, ...]],
                                 role: str, what: str, settle: float = 0.0) -> None:
    """WorkerLost if a worker a task of `pending` is pinned to has left. `settle`: seconds to
    give the scheduler's list of workers to catch up with a loss it has already acted on."""
    stuck = [f for f in pending if f.key in pinned]
    if not stuck:
        return
    deadline = time.monotonic() + settle
    while True:
        live = set(live_workers(client))
        gone = sorted({address for f in stuck for address in pinned[f.key]
                       if not any(a in live for a in pinned[f.key])})
        if gone or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if gone:
        client.cancel(pending)
        raise WorkerLost(f"{role}: worker {', '.join(gone)} left the cluster during {what}; its task was pinned "
                         f"there and cannot run elsewhere", role=role)


def _describe_stuck(client: Client, pending, role: str, what: str, timeout: float) -> str:
    keys = {f.key for f in pending}
    processing = client.processing()
    holders = sorted({worker for worker, tasks in processing.items() if keys & set(tasks)})
    role_workers = role_addresses(client, role)
    where = (f"still running on {', '.join(holders)}" if holders else
             "not running anywhere" + ("" if role_workers else f": there is no live {role} worker"))
    return (f"{role}: waited {timeout:.0f}s (timeout_seconds) for {what}; {len(keys)} task(s) {where} "
            f"(keys {sorted(keys)[:3]}). Fix: check the {role} workers' logs on the dashboard, add a "
            f"{role} worker with update_resource, or raise timeout_seconds.")
