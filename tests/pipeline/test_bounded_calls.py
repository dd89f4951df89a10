"""Reward calls bounded in time in killable child processes: a call that hangs, raises or
kills its process costs that call only; children are reaped; it works in a Dask worker's
task thread, where math-verify's own signal timeouts cannot."""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import cloudpickle
import pytest

from pipeline.rewards import math_accuracy
from pipeline.roles.bounded_calls import BoundedCalls
from resources.cluster import submit

# The helpers below travel by value: neither a child nor a Dask worker imports this test module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

GENEROUS = 120.0  # a bound no healthy call comes near, even on a two-core machine loaded 20 times over
# The timeout for calls meant to run past it (they sleep 600 s). The other calls under it
# return at once (a child's start and load are not counted in a call's timeout), so a few
# seconds are still a wide margin on a loaded machine; each test waits it out once.
SHORT = 4


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def divide(a: float, b: float) -> float:
    return a / b


def exit_now(code: int) -> None:
    os._exit(code)


def segfault() -> None:
    ctypes.string_at(0)   # reads address 0: SIGSEGV


def child_pid() -> int:
    return os.getpid()


class AlarmFired(Exception):
    pass


def interrupted_by_alarm() -> str:
    """Uses SIGALRM as math-verify does: only possible in a process's main thread."""
    def on_alarm(signum, frame):
        raise AlarmFired

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(1)
    try:
        time.sleep(GENEROUS)
        return "slept through"
    except AlarmFired:
        return "the alarm cut the sleep short"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def meet(folder: str, name: str, others: int) -> str:
    """Leaves a mark and waits until `others` other calls left theirs: only calls that run at
    the same time in different processes can all return."""
    Path(folder, name).touch()
    deadline = time.monotonic() + GENEROUS
    while len(os.listdir(folder)) < others + 1:
        if time.monotonic() > deadline:
            return "alone"
        time.sleep(0.05)
    return "met"


def running(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie is a child nobody reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def exists(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def no_args(*values) -> list[tuple[tuple, dict]]:
    return [((v,), {}) for v in values]


# ------------------------------------------------------------------------------------------

def test_a_call_past_the_timeout_costs_that_call_only():
    with BoundedCalls(timeout=SHORT) as calls:
        [(first_pid, _)] = calls.run(child_pid, [((), {})])
        began = time.monotonic()
        results = calls.run(nap, no_args(0, 600, 0.01, 0))
        took = time.monotonic() - began
        [(second_pid, _)] = calls.run(child_pid, [((), {})])
    assert results == [(0, None), (None, f"timed out after {SHORT} s"), (0.01, None), (0, None)]
    assert took < GENEROUS          # bounded: the 600 s call cost SHORT plus a fresh child's start
    assert first_pid != second_pid  # the sleeper's child was killed and replaced ...
    assert not exists(first_pid)    # ... and reaped, not left a zombie


def test_a_call_that_raises_gives_its_exception_as_text():
    with BoundedCalls(timeout=GENEROUS) as calls:
        [(pid_before, _)] = calls.run(child_pid, [((), {})])
        results = calls.run(divide, [((1, 2), {}), ((1, 0), {}), ((3,), {"b": 4})])
        [(pid_after, _)] = calls.run(child_pid, [((), {})])
    assert results == [(0.5, None), (None, "ZeroDivisionError: division by zero"), (0.75, None)]
    assert pid_before == pid_after   # an exception costs no process


def test_a_child_that_dies_costs_the_call_in_progress():
    with BoundedCalls(timeout=GENEROUS) as calls:
        assert calls.run(exit_now, no_args(3)) == [(None, "the child process running it died (exit code 3)")]
        assert calls.run(segfault, [((), {})]) == [(None, "the child process running it died (killed by SIGSEGV)")]
        assert calls.run(divide, [((6, 3), {})]) == [(2.0, None)]   # a fresh child goes on


def test_a_function_using_sigalrm_works_from_a_non_main_thread():
    outcome = {}

    def from_a_thread():
        with BoundedCalls(timeout=GENEROUS) as bounded, BoundedCalls(timeout=None) as here:
            outcome["child"] = bounded.run(interrupted_by_alarm, [((), {})])
            outcome["here"] = here.run(interrupted_by_alarm, [((), {})])

    thread = threading.Thread(target=from_a_thread)
    thread.start()
    thread.join()
    assert outcome["child"] == [("the alarm cut the sleep short", None)]   # the child's main thread
    [(value, error)] = outcome["here"]   # in-process, in this thread, signal refuses
    assert value is None and error.startswith("ValueError: signal only works in main thread")


def test_timeout_none_or_zero_calls_in_process():
    lock = threading.Lock()   # a closure over a lock cannot be pickled: only in-process can run it

    def holds_a_lock(x):
        with lock:
            return x + 1

    for timeout in (None, 0):
        with BoundedCalls(timeout) as calls:
            assert calls.run(holds_a_lock, no_args(1, 2)) == [(2, None), (3, None)]
            assert calls.run(divide, [((1, 0), {})]) == [(None, "ZeroDivisionError: division by zero")]
            assert calls.child_pids() == []
    with BoundedCalls(timeout=5) as calls, pytest.raises(ValueError, match="cannot be pickled.*timeout to 0"):
        calls.run(holds_a_lock, no_args(1))


def test_bad_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="timeout=-1"):
        BoundedCalls(-1)
    with pytest.raises(ValueError, match="processes=0"):
        BoundedCalls(1, processes=0)
    with pytest.raises(ValueError, match="start_method='fork'.*unsafe"):
        BoundedCalls(1, start_method="fork")


def test_an_unpicklable_argument_or_value_costs_that_call():
    with BoundedCalls(timeout=GENEROUS) as calls:
        results = calls.run(divide, [((threading.Lock(), 1), {}), ((4, 2), {})])
        returned = calls.run(threading.Lock, [((), {})])
    assert results[0][0] is None and results[0][1].startswith("the call cannot be sent to a child process: TypeError")
    assert results[1] == (2.0, None)
    assert returned[0][0] is None and returned[0][1].startswith("the value cannot be sent back: TypeError")


def test_closing_leaves_no_child_process():
    calls = BoundedCalls(timeout=GENEROUS, processes=2)
    calls.run(nap, no_args(0, 0, 0, 0))
    pids = calls.child_pids()
    assert len(pids) == 2 and all(running(p) for p in pids)
    calls.close()
    calls.close()   # twice is harmless
    # Only its own children: other tests of this process may have started workers.
    assert not any(exists(p) for p in pids) and not [c for c in multiprocessing.active_children() if c.pid in pids]
    with pytest.raises(RuntimeError, match="after close"):
        calls.run(nap, no_args(0))

    forgotten = BoundedCalls(timeout=GENEROUS)   # an owner that never closes: garbage collection does
    [(pid, _)] = forgotten.run(child_pid, [((), {})])
    del forgotten
    gc.collect()
    assert not exists(pid)


def test_a_child_does_not_outlive_a_parent_killed_outright(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent("""
        import os, sys, threading, time
        from pipeline.roles.bounded_calls import BoundedCalls
        if __name__ == "__main__":
            calls = BoundedCalls(timeout=600)
            [(pid, _)] = calls.run(os.getpid, [((), {})])
            print(pid, flush=True)
            threading.Thread(target=calls.run, args=(time.sleep, [((600,), {})])).start()
            time.sleep(1)
            os._exit(0)   # no close(), no atexit: as if killed
    """))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=GENEROUS)
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + GENEROUS
    while running(pid) and time.monotonic() < deadline:   # mid-call, it still notices and exits
        time.sleep(0.1)
    assert not running(pid)


def test_an_owner_process_that_never_closes_still_exits(tmp_path):
    # A Dask worker is such a process: multiprocessing's exit handler runs as its work returns
    # and joins its non-daemonic children, so children left open must not be among them.
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing, os, signal
        from pipeline.roles.bounded_calls import BoundedCalls

        HELD = []   # as a worker plugin holds the reward role's calls for the whole run

        def owner(report):
            HELD.append(BoundedCalls(timeout=600))
            report.send(HELD[0].run(os.getpid, [((), {})])[0][0])   # returns without close()

        if __name__ == "__main__":
            context = multiprocessing.get_context("spawn")
            receive, report = context.Pipe(duplex=False)
            process = context.Process(target=owner, args=(report,))
            process.start()
            pid = receive.recv()
            process.join(timeout=120)
            print(pid, process.exitcode)
            if process.exitcode is None:   # the failure this test is for: leave no process behind
                os.kill(pid, signal.SIGKILL)
                process.kill()
    """))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    pid, exit_code = done.stdout.split()
    assert exit_code == "0"          # not "None": the owner did not hang at exit
    assert not running(int(pid))


def test_processes_run_calls_in_parallel(tmp_path):
    # Two calls that each wait for the other: they can only both return "met" in two processes.
    with BoundedCalls(timeout=GENEROUS, processes=2) as calls:
        results = calls.run(meet, [((str(tmp_path), "a", 1), {}), ((str(tmp_path), "b", 1), {})])
    assert results == [("met", None), ("met", None)]
    with BoundedCalls(timeout=SHORT, processes=2) as calls:   # a timeout in one child spares the other's calls
        assert calls.run(nap, no_args(600, 0, 0, 0)) == [(None, f"timed out after {SHORT} s"), (0, None), (0, None),
                                                         (0, None)]


# math_accuracy through BoundedCalls, here and in a Dask worker ---------------------------------

def math_batch(size: int = 256) -> tuple[list[tuple[tuple, dict]], list[float]]:
    """`size` math_accuracy calls, every other one right: response boxes i, gold is i or i + 1/2
    written as a LaTeX fraction or a decimal."""
    calls, expected = [], []
    for i in range(size):
        right = i % 2 == 0
        gold = str(i) if right else f"{i}.5"
        response = rf"The answer is $\boxed{{\frac{{{2 * i}}}{{2}}}}$." if i % 4 == 0 else f"So it is {i}."
        calls.append((("q", response), {"answer": gold, "completion_ids": [1, 2, 3]}))
        expected.append(1.0 if right else 0.0)
    return calls, expected


def test_math_accuracy_on_256_responses_through_child_processes(measured):
    calls, expected = math_batch()
    began = time.perf_counter()
    here = [math_accuracy(*args, **kwargs) for args, kwargs in calls]
    in_process = time.perf_counter() - began
    assert here == expected
    for processes in (1, 2):
        with BoundedCalls(timeout=GENEROUS, processes=processes) as bounded:
            began = time.perf_counter()
            first = bounded.run(math_accuracy, calls)          # includes starting the children
            started = time.perf_counter() - began
            began = time.perf_counter()
            second = bounded.run(math_accuracy, calls)
            warm = time.perf_counter() - began
        assert first == second == [(value, None) for value in expected]
        measured(f"math_accuracy x256, processes={processes}: {started:.2f} s with the children's start, "
                 f"{warm:.2f} s warm (in-process in this thread: {in_process:.2f} s)")


def test_start_time_and_per_call_overhead(measured):
    texts = no_args(*(f"response {i}" for i in range(256)))
    began = time.perf_counter()
    [str.upper(*args) for args, _ in texts]
    in_process = time.perf_counter() - began
    with BoundedCalls(timeout=GENEROUS) as calls:
        began = time.perf_counter()
        calls.run(str.upper, texts[:1])
        start = time.perf_counter() - began
        began = time.perf_counter()
        results = calls.run(str.upper, texts)
        bounded = time.perf_counter() - began
    assert [value for value, _ in results] == [f"RESPONSE {i}" for i in range(256)]
    measured(f"BoundedCalls (spawn): child start + first call {start:.2f} s; 256 short string calls "
             f"{bounded * 1000:.0f} ms = {(bounded - in_process) / 256 * 1e6:.0f} us overhead per call")


def scores_in_a_worker(calls: list) -> dict:
    """Task: the math batch, a hanging call and a SIGALRM call through BoundedCalls, in a
    worker's task thread; what was left running once they closed."""
    with BoundedCalls(timeout=GENEROUS, processes=2) as bounded:
        began = time.perf_counter()
        bounded.run(math_accuracy, calls[:2])   # both children start and load math-verify
        started = time.perf_counter() - began
        began = time.perf_counter()
        scores = bounded.run(math_accuracy, calls)
        took = time.perf_counter() - began
        alarm = bounded.run(interrupted_by_alarm, [((), {})])
        pids = bounded.child_pids()
    with BoundedCalls(timeout=SHORT) as bounded:
        hang = bounded.run(nap, no_args(600, 0))
        pids += bounded.child_pids()
    return {"scores": scores, "started": started, "took": took, "hang": hang, "alarm": alarm,
            "main_thread": threading.current_thread() is threading.main_thread(),
            # Only these calls' children: the worker may hold a reward role's own.
            "left": [p for p in pids if exists(p)]}


def test_bounded_calls_in_a_dask_worker_task_thread(shared_cluster, measured):
    calls, expected = math_batch()
    out = submit(shared_cluster.client, "reward", scores_in_a_worker, calls, tag="bounded").result(timeout=500)
    assert out["main_thread"] is False   # a task thread, where signal.alarm would raise
    assert out["scores"] == [(value, None) for value in expected]
    assert out["hang"] == [(None, f"timed out after {SHORT} s"), (0, None)]
    assert out["alarm"] == [("the alarm cut the sleep short", None)]
    assert out["left"] == []
    measured(f"in a Dask worker's task thread, processes=2: children start + load math-verify "
             f"{out['started']:.2f} s, then math_accuracy x256 {out['took']:.2f} s")
