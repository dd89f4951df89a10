"""The quickstart with its rollout role on SLURM jobs against the quickstart on local workers.

    PYTHONPATH=$PWD python benchmarks/slurm_quickstart.py            # as root, slurm-wlm + munge installed

Starts a single-node SLURM on this machine (tests/slurm_node.py), runs `dask-rl run
examples/quickstart.yaml` and `dask-rl run examples/quickstart_slurm.yaml` (same seed), and
prints each run's mean reward over its first and last 8 steps, its wall time and the
per-step difference between the two runs, plus when the rollout job was submitted and when
its worker joined (from the trainer's log).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from slurm_node import LocalSlurm  # noqa: E402


def run(example: str, output: Path, env: dict) -> tuple[list[dict], float, str]:
    began = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(ROOT / "examples" / example),
                             "--dashboard-address", ":0", "--output-dir", str(output)],
                            capture_output=True, text=True, env=env, timeout=900)
    seconds = time.perf_counter() - began
    if result.returncode:
        raise SystemExit(f"{example} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return records, seconds, result.stderr


def summary(name: str, records: list[dict], seconds: float) -> None:
    rewards = [r["reward"] for r in records]
    print(f"{name}: {len(records)} steps, reward first 8 {sum(rewards[:8]) / 8:.3f}, "
          f"last 8 {sum(rewards[-8:]) / 8:.3f}, wall {seconds:.1f} s")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="dask-rl-slurm-") as tmp:
        tmp = Path(tmp)
        node = LocalSlurm(tmp / "slurm").start()
        env = {**os.environ, **node.env, "PYTHONPATH": str(ROOT)}
        try:
            local, local_seconds, _ = run("quickstart.yaml", tmp / "local", env)
            queued, queued_seconds, log = run("quickstart_slurm.yaml", tmp / "slurm-run", env)
        finally:
            node.stop()
    summary("local workers       ", local, local_seconds)
    summary("rollout on SLURM job", queued, queued_seconds)
    gaps = [abs(a["reward"] - b["reward"]) for a, b in zip(local, queued)]
    print(f"per-step reward difference: max {max(gaps):.4f}, mean {sum(gaps) / len(gaps):.4f}")
    print("\n".join(line for line in log.splitlines() if "SLURM job" in line))


if __name__ == "__main__":
    main()
