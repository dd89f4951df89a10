"""Changes that wait for a step boundary: asked for from another thread of the driver
(update_resource during train()) or from a shell (`dask-rl scale`, through a queue on the
training's scheduler)."""

from __future__ import annotations

import queue
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

REQUESTS = "dask-rl-resource-requests"   # a distributed.Queue on the training's scheduler


@dataclass
class Pending:
    """A validated change waiting for the training thread to apply it between two steps."""

    request: Any        # the ResourceRequest
    base: Any           # the placement it was validated against
    config: Any         # the placement it leads to
    _done: threading.Event = field(default_factory=threading.Event)
    _result: Any = None
    _error: BaseException | None = None

    def settle(self, apply: Callable[[], Any]) -> None:
        try:
            self._result = apply()
        except BaseException as error:  # handed to the caller's thread, which re-raises it
            self._error = error
        self._done.set()

    def wait(self, training: Callable[[], bool]) -> Any:
        """Until the boundary came. The training thread's own waits are bounded by
        timeout_seconds, and leaving train() settles what is queued, so this ends."""
        while not self._done.wait(0.5):
            if not training():
                self._done.wait(5.0)   # train() is settling the queue as it ends
                break
        if not self._done.is_set():
            raise TimeoutError(f"update_resource({self.request.component!r}): training stopped before a step "
                               f"boundary applied it; call it again")
        if self._error is not None:
            raise self._error
        return self._result


class BoundaryQueue:
    def __init__(self):
        self._queue: queue.Queue[Pending] = queue.Queue()

    def put(self, request, base, config) -> Pending:
        pending = Pending(request, base, config)
        self._queue.put(pending)
        return pending

    def drain(self) -> list[Pending]:
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items


def answer_remote(client, apply: Callable[[dict], list[str]]) -> None:
    """Apply the requests `dask-rl scale` queued on the scheduler; answer each on its reply
    queue with the changes or the error (training goes on unchanged after an error)."""
    from distributed import Queue

    requests = Queue(REQUESTS, client=client)
    while requests.qsize():
        request = requests.get(timeout=5)
        reply = Queue(request.pop("reply_to"), client=client)
        try:
            reply.put({"changes": apply(request)})
        except Exception as error:
            reply.put({"error": f"{type(error).__name__}: {error}"})


def send_remote_request(client, request: dict, timeout: float) -> dict:
    """Queue one update_resource request for the trainer driving this scheduler; wait for its answer."""
    from distributed import Queue

    reply_to = f"dask-rl-reply-{uuid.uuid4().hex[:8]}"
    Queue(REQUESTS, client=client).put({**request, "reply_to": reply_to})
    try:
        return Queue(reply_to, client=client).get(timeout=timeout)
    except TimeoutError:
        return {"error": f"no trainer answered within {timeout:.0f}s: the request is taken at a step boundary "
                         f"of a running train(); is one running on this scheduler?"}
