"""How a task's input reaches its worker: inside the task (through the scheduler) or
scattered to the worker first (Fleet.place, what the update's rows do).

The update's rows (token ids, masks, logprobs, advantages of a batch) are built on the
driver and go to each actor rank's worker. Inside the task, the scheduler unpickles them and
forwards them, and Dask warns "Sending large graph" past 10 MiB; a long-response batch is
tens of MiB a step (256 rows of 1152 tokens ~20 MiB). Scattered (from the driver, Dask's
default routes them through the scheduler), they pass it as opaque bytes it forwards to the
worker, and the task refers to them by key. This times submit-to-
result of a task that only reads its input, one local worker process, each way and size.

    python benchmarks/task_inputs.py            # ~30 s on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from distributed import Client, LocalCluster


def count(values: list) -> int:
    return sum(t.numel() for t in values)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, nargs="*", default=[0.05, 1, 5, 20, 50])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")   # the large-graph warning is what is measured here
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        [address] = client.scheduler_info()["workers"]
        print(f"{'MiB':>6} {'inside the task ms':>20} {'scattered first ms':>20}   (median of {args.repeats}, "
              f"then every run)")
        for mib in args.mib:
            values = [torch.randint(0, 1000, (int(mib * 2**20) // 8,))]
            times = {}
            for way in ("inside", "scattered"):
                runs = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    given = values if way == "inside" else client.scatter(values, workers=[address], hash=False)
                    client.submit(count, given, workers=[address], pure=False).result()
                    runs.append(1000 * (time.perf_counter() - start))
                times[way] = runs
            print(f"{mib:6g} {statistics.median(times['inside']):20.0f} {statistics.median(times['scattered']):20.0f}"
                  f"   {[round(t) for t in times['inside']]} / {[round(t) for t in times['scattered']]}")


if __name__ == "__main__":
    main()
