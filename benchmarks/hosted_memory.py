"""What hosting the rollout in the actor's process saves, on CPU workers: the same GRPO run
with `rollout: {hosted_by: actor}` and with a rollout worker of its own, one after the other.
Printed for each: worker processes, the peak of the actor's and rollout's processes' memory
(unique set size, summed, sampled every 0.2 s), the peak of the published weight snapshots
under /dev/shm, and the steady step.

    python benchmarks/hosted_memory.py        # a 1024-wide, 4-layer model (~40 M parameters); ~2 min

On GPUs the same comparison against TRL is `benchmarks/grpo_vs_trl.py --hosted-rollout`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sampling import Sampler  # noqa: E402

from pipeline import HybridTrainer  # noqa: E402
from pipeline.models import create_tiny_model  # noqa: E402
from pipeline.rewards import digit_fraction  # noqa: E402
from resources import load_resource_config  # noqa: E402

ENGINE = {"strategy": "cuda_graph", "cuda_graph_args": {"fuse_projections": False}}
LAYOUTS = {
    "hosted": {"hosted_by": "actor", **ENGINE},
    "apart": {"device_type": "cpu", "workers": 1, **ENGINE},
}


class Peaks(Sampler):
    """Samples the unique memory of some processes and the bytes of the weight snapshots
    published under a directory."""

    def __init__(self, pids: list[int], directory: str):
        super().__init__(0.2)
        self.processes = [psutil.Process(pid) for pid in pids]
        self.directory = Path(directory)
        self.memory = self.files = 0

    def sample(self) -> None:
        self.memory = max(self.memory, sum(p.memory_full_info().uss for p in self.processes))
        if self.directory.is_dir():
            # The published versions (the recovery states beside them are written either way).
            self.files = max(self.files, sum(f.stat().st_size for f in self.directory.glob("policy-v*")))


def run(placement: str, model_dir: str, args) -> dict:
    config = load_resource_config({"actor": {"device_type": "cpu", "workers": 1},
                                   "reward": {"device_type": "cpu", "workers": 1},
                                   "rollout": LAYOUTS[placement], "timeout_seconds": 600})
    trainer = HybridTrainer(model_dir, digit_fraction, config, algorithm="grpo", prompts=PROMPTS,
                            prompts_per_step=args.prompts_per_step, samples_per_prompt=4,
                            max_new_tokens=args.new_tokens, kl_coef=0.0, actor_lr=1e-4, seed=0, show_progress=False,
                            dashboard_address=":0", output_dir=tempfile.mkdtemp(prefix=f"hosted-memory-{placement}-"))
    try:
        client = trainer.fleet.client
        pids = client.run(os.getpid)
        roles = {w["address"] for role in ("actor", "rollout") for w in trainer.fleet.cluster.workers_of(role)}
        with Peaks([pids[address] for address in roles], trainer.fleet.snapshot_dir) as peaks:
            records = trainer.train(args.steps)
    finally:
        trainer.close()
    return {"processes": len(pids), "actor_and_rollout_processes": len(roles), "memory": peaks.memory,
            "snapshots": peaks.files, "step": statistics.median(r.seconds for r in records[1:]),
            "rewards": [round(r.reward_mean, 4) for r in records]}


PROMPTS = [f"what is {a} plus {b}? answer: " for a in range(8) for b in range(4)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    model_dir = str(create_tiny_model(Path(tempfile.mkdtemp(prefix="hosted-memory-model-")) / "model",
                                      hidden_size=args.hidden, layers=args.layers, heads=2))
    results = {placement: run(placement, model_dir, args) for placement in LAYOUTS}
    for placement, r in results.items():
        print(f"{placement:>6}: {r['processes']} worker processes ({r['actor_and_rollout_processes']} for actor and "
              f"rollout), their peak {r['memory'] / 2**20:.0f} MiB; published snapshots at most "
              f"{r['snapshots'] / 2**20:.0f} MiB; step {r['step']:.2f} s; rewards {r['rewards']}", flush=True)
    hosted, apart = results["hosted"], results["apart"]
    print(f"hosted / apart: actor and rollout memory {hosted['memory'] / apart['memory']:.2f}x "
          f"({(apart['memory'] - hosted['memory']) / 2**20:.0f} MiB less), snapshots "
          f"{(apart['snapshots'] - hosted['snapshots']) / 2**20:.0f} MiB less, step {hosted['step'] / apart['step']:.2f}x; "
          f"same rewards: {hosted['rewards'] == apart['rewards']}")


if __name__ == "__main__":
    main()
