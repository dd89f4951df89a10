"""What settling a worker's heap costs (pipeline/roles/host.py settle_heap), thawing the
heap frozen before or not, on the CPU with the Qwen2-0.5B shape loaded in bf16.

A role worker freezes its heap after its build; the rollout settles it again each time a
request meets a new decode slot count (a new compiled graph), the actor after compiling its
update. Thawing first walks the whole heap again (and frees a replaced model); not thawing
collects and freezes only what is new. Here each settle follows --new-objects new tracked
objects, as a compiled graph leaves alive.

    python benchmarks/heap_settle.py
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import save_qwen2_05b  # noqa: E402

from pipeline.models import load_causal_lm  # noqa: E402
from pipeline.roles.host import settle_heap  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-objects", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    model = load_causal_lm(save_qwen2_05b(Path(tempfile.gettempdir()) / "dask-rl-qwen2-0.5b"), device="cpu",
                           dtype=torch.bfloat16)
    settle_heap()
    seconds: dict[str, list[float]] = {"thaw": [], "no thaw": []}
    kept = []
    for _ in range(args.repeats):
        for name, thaw in (("thaw", True), ("no thaw", False)):
            kept.append([{"guard": i, "code": [i, (i,)]} for i in range(args.new_objects)])
            start = time.perf_counter()
            settle_heap(thaw=thaw)
            seconds[name].append(time.perf_counter() - start)
    print(f"{gc.get_freeze_count()} objects frozen at the end ({type(model).__name__} loaded); a settle after "
          f"{args.new_objects} new objects:")
    for name, values in seconds.items():
        print(f"  {name:8s} {min(values) * 1e3:7.1f} ms (best of {len(values)}; all: "
              + ", ".join(f"{v * 1e3:.1f}" for v in values) + ")")
    gc.unfreeze()
    return seconds


if __name__ == "__main__":
    main()
