"""What bounding reward calls in child processes costs (pipeline.roles.bounded_calls).

Prints, per start method (spawn, the one BoundedCalls uses, and forkserver for comparison):
- start: a fresh BoundedCalls's first call of a trivial function (child start, load, call);
- start + math-verify: the same with math_accuracy (the child imports sympy and math-verify);
- per call: the overhead of one short string call over calling it here, from 256 calls;
- after a timeout: what a timed-out call costs beyond its timeout (kill, fresh child, load);
- math_accuracy x256 warm with 1, 2, 4 and 8 children, beside the same calls in-process.

    PYTHONPATH=$PWD python benchmarks/bounded_calls.py

A spawned child imports the parent's main module again (multiprocessing's rule), so a
parent script that imports torch at its top makes every child start pay for torch.
"""

from __future__ import annotations

import os
import time

from pipeline.rewards import math_accuracy
from pipeline.roles.bounded_calls import BoundedCalls

TEXTS = [((f"response number {i}",), {}) for i in range(256)]


def math_calls() -> list[tuple[tuple, dict]]:
    """256 calls, half right: a boxed LaTeX fraction or a plain number against a gold number."""
    return [(("q", rf"so $\boxed{{\frac{{{2 * i}}}{{2}}}}$" if i % 2 else f"it is {i}"),
             {"answer": str(i if i % 4 < 2 else i + 1)}) for i in range(256)]


def seconds(action) -> float:
    began = time.perf_counter()
    action()
    return time.perf_counter() - began


def best(action, repeats: int = 3) -> float:
    return min(seconds(action) for _ in range(repeats))


def start_times(method: str) -> dict[str, float]:
    figures = {}
    with BoundedCalls(30, start_method=method) as calls:
        figures["start"] = seconds(lambda: calls.run(str.upper, TEXTS[:1]))
        here = best(lambda: [str.upper(*args) for args, _ in TEXTS])
        figures["per call"] = (best(lambda: calls.run(str.upper, TEXTS)) - here) / len(TEXTS)
    with BoundedCalls(30, start_method=method) as calls:
        figures["start + math-verify"] = seconds(lambda: calls.run(math_accuracy, math_calls()[:1]))
    with BoundedCalls(1, start_method=method) as calls:
        calls.run(time.sleep, [((0,), {})])
        figures["after a timeout"] = seconds(lambda: calls.run(time.sleep, [((60,), {}), ((0,), {})])) - 1
    return figures


def math_throughput() -> dict[str, float]:
    calls = math_calls()
    figures = {"in-process": best(lambda: [math_accuracy(*a, **k) for a, k in calls])}
    for processes in (1, 2, 4, 8):
        with BoundedCalls(60, processes=processes) as bounded:
            bounded.run(math_accuracy, calls[:processes * 2])   # start and load every child
            figures[f"{processes} children"] = best(lambda: bounded.run(math_accuracy, calls))
    return figures


def main() -> None:
    print(f"{os.cpu_count()} CPU cores")
    for method in ("spawn", "forkserver"):
        figures = start_times(method)
        print(f"{method:>10}: start {figures['start']:.2f} s, start + math-verify "
              f"{figures['start + math-verify']:.2f} s, per call {figures['per call'] * 1e6:.0f} us, "
              f"after a timeout +{figures['after a timeout']:.2f} s")
    figures = math_throughput().items()
    print("math_accuracy x256, warm: " + ", ".join(f"{name} {value:.2f} s" for name, value in figures))


if __name__ == "__main__":
    main()
