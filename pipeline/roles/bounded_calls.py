"""Calls bounded in time and isolated in child processes, for reward functions.

A reward that hangs (math-verify can take minutes on a pathological response) or crashes
its process must cost its own sample only, never the run, the worker or a thread for good.
A Python thread cannot be stopped, a process can: BoundedCalls keeps up to `processes`
children, ships each distinct function to a child once (cloudpickle), hands a free child
one call at a time and reads one reply per call, so a timeout or a crash costs exactly the
call in progress; that child is killed and a fresh one serves the calls that remain.

Start method: spawn. The parent is a multi-threaded Dask worker that has imported torch,
where fork would copy locks other threads hold. spawn rather than forkserver: forkserver's
server is shared by every library in the process and its preload list is process-wide
state, while a spawned child is this module's alone, a direct child that join() reaps; and
forkserver started no faster here, since its children too import the parent's main module
again and the function's modules (benchmarks/bounded_calls.py measures both). That price,
a fresh interpreter (under a second on two cores, plus a torch-importing main script's
imports), is paid when the owner starts and again only after a timeout or a crash; a call
costs a round trip on a pipe (about 0.1 to 0.4 ms). Calls run in the child's main thread,
so a function may use SIGALRM (math-verify's own timeouts do).

This module imports only the standard library and cloudpickle: a child starts light.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import wait
from typing import Any, Callable, Iterable

import cloudpickle

Call = tuple[tuple, dict]              # (args, kwargs) of one call
Result = tuple[Any, "str | None"]      # (value, None) or (None, what went wrong)

START_METHODS = ("spawn", "forkserver")


class BoundedCalls:
    """Runs calls of picklable functions in child processes, each bounded by `timeout` seconds.

    `timeout=None` or 0: every call runs here, in the caller's thread, with no child (for a
    function that cannot be pickled, or a user who wants that); a call that hangs then holds
    the caller's thread for good. `processes`: how many children serve calls in parallel,
    each call going to a free one. `load_timeout`: seconds a child may take to start and
    import a function's modules (not counted in any call's `timeout`).
    One batch at a time: `run` from several threads takes turns. Close it (or use `with`)
    to end the children; it is also closed when garbage-collected or at exit. Children are
    daemonic, so a function cannot start multiprocessing children of its own there (it may
    start subprocesses); give such a function timeout 0.
    """

    def __init__(self, timeout: float | None, *, processes: int = 1, start_method: str = "spawn",
                 load_timeout: float = 120.0):
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout={timeout!r}: give seconds > 0, or None or 0 to call in-process")
        if not isinstance(processes, int) or processes < 1:
            raise ValueError(f"processes={processes!r}: give a whole number of child processes, 1 or more")
        if start_method not in START_METHODS:
            raise ValueError(f"start_method={start_method!r}: use one of {START_METHODS} (fork is unsafe in a "
                             f"multi-threaded parent)")
        self.timeout = timeout or None
        self.load_timeout = load_timeout
        self._context = multiprocessing.get_context(start_method)
        self._children = [_Child() for _ in range(processes)]   # each started on first use
        self._lock = threading.Lock()
        self._close = weakref.finalize(self, _stop_all, self._children)

    def run(self, function: Callable, calls: Iterable[Call]) -> list[Result]:
        """One (value, None) or (None, "what went wrong") per call, in order. A call that raises
        gives its exception as text ("ZeroDivisionError: division by zero"); one past the
        timeout gives "timed out after N s" (its child is killed, a fresh one serves the calls
        that remain); one whose child dies says how it died."""
        calls = list(calls)
        if self.timeout is None:
            return [_call_here(function, args, kwargs) for args, kwargs in calls]
        if not self._close.alive:
            raise RuntimeError("BoundedCalls.run after close(): make a new BoundedCalls")
        try:
            payload = cloudpickle.dumps(function)
        except Exception as error:
            raise ValueError(f"{_name(function)} cannot be pickled for a child process ({_describe(error)}). "
                             f"Fix: define it at module level, or set the reward timeout to 0 to call it "
                             f"in-process, unbounded.") from error
        with self._lock:
            return _Batch(self, payload, calls).run()

    def child_pids(self) -> list[int]:
        """The process ids of the children running now (for monitoring and tests)."""
        return [c.process.pid for c in self._children if c.process is not None]

    def close(self) -> None:
        """End every child (killed if it is mid-call) and reap it; calling it again does nothing."""
        with self._lock:
            self._close()

    def __enter__(self) -> BoundedCalls:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Child:
    """One child process and the functions it holds; `task` is what it is doing now:
    None (idle), ("load", None) or ("call", index), to finish before `deadline`. The batch
    that gave the task clears it when it settles it, also after stop()."""

    def __init__(self):
        self.process = self.conn = self.task = None
        self.loaded: set[str] = set()
        self.deadline = 0.0

    def ensure_running(self, context) -> None:
        if self.process is not None and self.process.is_alive():
            return
        if self.process is not None:   # died while idle (OOM killer, a stray alarm): reap, replace
            self.stop()
        parent_end, child_end = context.Pipe()
        # Daemonic: a worker process runs multiprocessing's exit handler as soon as its work
        # returns, before any atexit hook, and it joins every non-daemonic child, which would
        # wait forever on a child whose owner never closed it; daemonic children it ends first.
        process = context.Process(target=_serve, args=(child_end,), name="dask-rl-bounded-calls",
                                  daemon=True)
        try:
            process.start()
        finally:
            child_end.close()
        self.process, self.conn = process, parent_end

    def send(self, message: tuple, task: tuple, seconds: float) -> None:
        self.conn.send(message)   # pickles first: an unpicklable message raises before writing
        self.task, self.deadline = task, time.monotonic() + seconds

    def stop(self) -> str:
        """Kill the process if it still runs, reap it, and say how it ended."""
        process, self.process, self.loaded = self.process, None, set()
        self.conn.close()
        if process.is_alive():
            process.kill()
        process.join()
        code = process.exitcode
        process.close()
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _stop_all(children: list[_Child]) -> None:
    for child in children:
        if child.process is not None:
            child.stop()


class _Batch:
    """One run(): hands calls to free children, reads replies, enforces deadlines."""

    def __init__(self, owner: BoundedCalls, payload: bytes, calls: list[Call]):
        self.owner, self.payload, self.calls = owner, payload, calls
        self.digest = hashlib.sha256(payload).hexdigest()   # the same function pickles the same
        self.waiting = deque(range(len(calls)))
        self.results: list[Result | None] = [None] * len(calls)

    def run(self) -> list[Result]:
        children = self.owner._children
        for child in children:   # a batch cut short (KeyboardInterrupt) left a call running there
            if child.task is not None:
                child.stop()
                child.task = None
        while self.waiting or any(c.task for c in children):
            for child in children:
                if child.task is None and self.waiting:
                    self._give_work(child)
            self._collect([c for c in children if c.task])
        return self.results

    def _give_work(self, child: _Child) -> None:
        child.ensure_running(self.owner._context)
        if self.digest not in child.loaded:
            try:
                child.send(("load", self.digest, self.payload), ("load", None), self.owner.load_timeout)
            except OSError:
                self._fail_waiting(f"the function could not be loaded in a child process: it died as it "
                                   f"started ({child.stop()})")
            return
        index = self.waiting.popleft()
        args, kwargs = self.calls[index]
        try:
            child.send(("call", self.digest, args, kwargs), ("call", index), self.owner.timeout)
        except OSError:   # it died just now, before the call reached it
            self.results[index] = (None, f"the child process died before the call ({child.stop()})")
        except Exception as error:   # the arguments cannot be pickled
            self.results[index] = (None, f"the call cannot be sent to a child process: {_describe(error)}")

    def _collect(self, busy: list[_Child]) -> None:
        """Wait for the first reply or deadline, then settle every child that has one."""
        if not busy:
            return
        soonest = min(c.deadline for c in busy)
        ready = wait([c.conn for c in busy], timeout=max(0.0, soonest - time.monotonic()))
        for child in busy:
            if child.conn in ready:
                try:
                    ok, value = child.conn.recv()
                except (EOFError, OSError):
                    self._settle(child, None, f"the child process running it died ({child.stop()})")
                    continue
                self._settle(child, value if ok else None, None if ok else value)
            elif time.monotonic() >= child.deadline:
                child.stop()
                self._settle(child, None, self._overtime(child.task[0]))

    def _settle(self, child: _Child, value: Any, error: str | None) -> None:
        (kind, index), child.task = child.task, None
        if kind == "call":
            self.results[index] = (value, error)
        elif error is None:
            child.loaded.add(self.digest)
        else:
            self._fail_waiting(f"the function could not be loaded in a child process: {error}")

    def _overtime(self, kind: str) -> str:
        if kind == "call":
            return f"timed out after {self.owner.timeout:g} s"
        return f"starting a child and loading the function took longer than {self.owner.load_timeout:g} s"

    def _fail_waiting(self, error: str) -> None:
        """A function that cannot load fails the same way in every child: fail its calls at once."""
        while self.waiting:
            self.results[self.waiting.popleft()] = (None, error)


def _call_here(function: Callable, args: tuple, kwargs: dict) -> Result:
    try:
        return function(*args, **kwargs), None
    except Exception as error:   # the user's function: any failure is this call's
        return None, _describe(error)


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _name(function: Callable) -> str:
    return getattr(function, "__qualname__", None) or repr(function)


def _serve(conn) -> None:
    """The child: load functions, run calls in this main thread, send one reply each;
    ends when the parent closes the pipe, or dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the parent's to handle; it closes us
    _exit_with_parent()
    functions: dict[str, Callable] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "load":
            _, digest, payload = message
            reply = _attempt(lambda: functions.__setitem__(digest, cloudpickle.loads(payload)))
        else:
            _, digest, args, kwargs = message
            reply = _attempt(lambda: functions[digest](*args, **kwargs))
        try:
            conn.send(reply)
        except Exception as error:   # a value that cannot be pickled: say so instead
            conn.send((False, f"the value cannot be sent back: {_describe(error)}"))


def _attempt(thunk: Callable[[], Any]) -> tuple[bool, Any]:
    try:
        return True, thunk()
    except Exception as error:
        return False, _describe(error)


def _exit_with_parent() -> None:
    """A parent killed outright cannot close us: a watcher thread ends this process when the
    parent's end of the sentinel pipe closes, even while a call runs in the main thread."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return

    def watch():
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
