"""Submitting role tasks and waiting for them, with readable keys and bounded waits."""

from __future__ import annotations

import uuid
from typing import Any, Callable, Iterable

from distributed import Client, Future, wait


class RoleTimeout(TimeoutError):
    """A wait on a role's tasks ran past timeout_seconds."""


def submit(client: Client, role: str, fn: Callable, *args: Any, tag: str = "",
           workers: list[str] | None = None, **kwargs: Any) -> Future:
    """Run `fn(*args)` on a worker carrying `role`; the key reads `role-fn-tag-xxxxxxxx`
    so the dashboard groups and colours tasks by role and function."""
    key = f"{role}-{fn.__name__.replace('_', '-')}-{tag}-{uuid.uuid4().hex[:8]}"
    return client.submit(fn, *args, key=key, resources={role: 1}, pure=False, workers=workers,
                         allow_other_workers=False, **kwargs)


def wait_role(client: Client, futures: Iterable[Future], role: str, what: str, timeout: float) -> list:
    """Results of `futures`, or RoleTimeout naming the role, the workers and what was awaited."""
    futures = list(futures)
    done, pending = wait(futures, timeout=timeout)
    if pending:
        raise RoleTimeout(_describe_stuck(client, pending, role, what, timeout))
    return client.gather(futures)


def _describe_stuck(client: Client, pending, role: str, what: str, timeout: float) -> str:
    keys = {f.key for f in pending}
    processing = client.processing()
    holders = sorted({worker for worker, tasks in processing.items() if keys & set(tasks)})
    role_workers = [addr for addr, w in client.scheduler_info()["workers"].items()
                    if w.get("resources", {}).get(role)]
    where = (f"still running on {', '.join(holders)}" if holders else
             "not running anywhere" + ("" if role_workers else f": there is no live {role} worker"))
    return (f"{role}: waited {timeout:.0f}s (timeout_seconds) for {what}; {len(keys)} task(s) {where} "
            f"(keys {sorted(keys)[:3]}). Fix: check the {role} workers' logs on the dashboard, add a "
            f"{role} worker with update_resource, or raise timeout_seconds.")
