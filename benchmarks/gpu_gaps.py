"""Where a profiled GPU sat idle, and what the host was doing then.

A torch.profiler trace (Chrome JSON, `prof.export_chrome_trace`) holds the GPU's kernels and
the host's operators. The GPU is busy where some kernel, copy or memset runs; between the
first and the last of them, the rest of the time it waited for the host to enqueue work.
Each such gap is charged to the host operators running at the time, each to its innermost
operator (its own time, not its children's), once for each of the two busiest host threads
(the Python thread, and in a backward pass autograd's own thread, which launches its
kernels), so the tables say which host work the GPU waited on.

    python benchmarks/gpu_gaps.py trace.json      # or gaps_report(path) after a profile
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
HOST_CATEGORIES = {"cpu_op", "user_annotation"}


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, overlapping intervals joined: the union as disjoint (start, end) pairs."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def idle_gaps(busy: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The holes between disjoint sorted busy intervals."""
    return [(a_end, b_start) for (_, a_end), (b_start, _) in zip(busy, busy[1:]) if b_start > a_end]


def self_intervals(events: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Nested (start, end, name) host events -> (start, end, name) pieces where `name` is the
    innermost event running. Events of one thread nest (a child lies inside its parent)."""
    pieces: list[tuple[float, float, str]] = []
    stack: list[list] = []          # [start, end, name, cursor]: cursor = where its own time resumes

    def close_until(time: float) -> None:
        while stack and stack[-1][1] <= time:
            start, end, name, cursor = stack.pop()
            if end > cursor:
                pieces.append((cursor, end, name))
            if stack:
                stack[-1][3] = max(stack[-1][3], end)

    for start, end, name in sorted(events, key=lambda e: (e[0], -e[1])):
        close_until(start)
        if stack and start > stack[-1][3]:
            pieces.append((stack[-1][3], start, stack[-1][2]))
        if stack:
            stack[-1][3] = max(stack[-1][3], start)
        stack.append([start, min(end, stack[-1][1]) if stack else end, name, start])
    close_until(float("inf"))
    return sorted(pieces)


def charge(gaps: list[tuple[float, float]], pieces: list[tuple[float, float, str]]) -> Counter:
    """Microseconds of `gaps` spent in each piece's name; time no host event covers is
    charged to "(no operator: Python, or waiting)"."""
    spent: Counter = Counter()
    j = 0
    for gap_start, gap_end in gaps:
        covered = 0.0
        while j < len(pieces) and pieces[j][1] <= gap_start:
            j += 1
        k = j
        while k < len(pieces) and pieces[k][0] < gap_end:
            overlap = min(gap_end, pieces[k][1]) - max(gap_start, pieces[k][0])
            if overlap > 0:
                spent[pieces[k][2]] += overlap
                covered += overlap
            k += 1
        spent["(no operator: Python, or waiting)"] += (gap_end - gap_start) - covered
    return spent


def gaps_report(trace_path: str, rows: int = 15, min_gap_us: float = 0.0) -> dict:
    """Print and return the GPU's busy and idle time over the trace and the host operators
    its gaps (at least `min_gap_us` long) are charged to."""
    with open(trace_path) as handle:
        trace = json.load(handle)
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") in DEVICE_CATEGORIES]
    if not device:
        print("no GPU kernels in the trace")
        return {}
    busy = merged(device)
    gaps = [gap for gap in idle_gaps(busy) if gap[1] - gap[0] >= min_gap_us]
    host = defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_CATEGORIES:
            host[e.get("tid")].append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "?")))
    threads = sorted(host, key=lambda tid: -len(host[tid]))[:2]
    spent = {tid: charge(gaps, self_intervals(host[tid])) for tid in threads}
    span = busy[-1][1] - busy[0][0]
    busy_us = sum(end - start for start, end in busy)
    idle_us = sum(end - start for start, end in gaps)
    sizes = sorted((end - start for start, end in gaps), reverse=True)
    print(f"GPU span {span / 1e3:.1f} ms: busy {busy_us / 1e3:.1f} ms ({busy_us / span:.0%}), idle "
          f"{idle_us / 1e3:.1f} ms in {len(gaps)} gaps (longest {sizes[0] / 1e3 if sizes else 0:.2f} ms; "
          f"{sum(s for s in sizes if s >= 100) / 1e3:.1f} ms in gaps of 100 us or more)")
    for tid, charged in spent.items():
        print(f"{f'host operator the GPU waited on (thread {tid}, {len(host[tid])} operators)':<66} {'ms':>8} "
              f"{'share':>6}")
        for name, micros in charged.most_common(rows):
            if micros <= 0:
                break
            print(f"  {name[:64]:<64} {micros / 1e3:8.1f} {micros / max(idle_us, 1e-9):6.1%}")
    return {"span_ms": span / 1e3, "busy_ms": busy_us / 1e3, "idle_ms": idle_us / 1e3, "gaps": len(gaps),
            "waited_on_ms": {str(tid): {name: micros / 1e3 for name, micros in charged.most_common(rows)}
                             for tid, charged in spent.items()}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a torch.profiler Chrome trace (JSON)")
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--min-gap-us", type=float, default=0.0, help="ignore shorter gaps")
    args = parser.parse_args(argv)
    gaps_report(args.trace, args.rows, args.min_gap_us)


if __name__ == "__main__":
    main()
