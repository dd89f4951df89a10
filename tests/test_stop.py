"""Stopping a real `dask-rl run`: Ctrl-C (SIGINT to the whole foreground process group, as a
terminal sends it) and SIGTERM (what a batch scheduler sends on preemption), then --resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import checkpoint

ROOT = Path(__file__).resolve().parents[1]

RUN_FILE = """
actor:   {{device_type: cpu, workers: 1}}
reward:  {{device_type: cpu, workers: 1}}
rollout: {{device_type: cpu, workers: 1}}
timeout_seconds: 120
train:
  actor_model: tiny
  reward_function: pipeline.rewards:digit_fraction
  prompts: {prompts}
  algorithm: grpo
  kl_coef: 0.0
  samples_per_prompt: 2
  prompts_per_step: 4
  max_new_tokens: 6
  steps: {steps}
  checkpoint: {{every_n_steps: 1000}}
"""


def _start(tmp_path: Path, steps: int = 500) -> tuple[subprocess.Popen, Path, Path]:
    run_file = tmp_path / "run.yaml"
    run_file.write_text(RUN_FILE.format(prompts=ROOT / "examples" / "quickstart_prompts.jsonl", steps=steps))
    out, scratch = tmp_path / "out", tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}  # what the run leaves in temp directories lands here
    process = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", str(run_file), "--output-dir", str(out),
                                "--dashboard-address", ":0", "--sample-every", "1"], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return process, out, scratch


def _wait_for_steps(process: subprocess.Popen, out: Path, steps: int, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        if process.poll() is not None or time.monotonic() > deadline:
            stdout, stderr = process.communicate(timeout=60)
            pytest.fail(f"the run ended or stalled before {steps} steps: {stdout[-2000:]} {stderr[-3000:]}")
        time.sleep(0.5)


def _files_left(directory: Path) -> list[Path]:
    """Files under `directory`, less the two lock files Dask keeps in its scratch space for
    every process that will use it (they hold no data of a run)."""
    return [p for p in directory.rglob("*") if not p.is_dir() and p.name not in ("global.lock", "purge.lock")]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_signal_stops_the_run_cleanly_keeping_model_checkpoint_and_metrics(tmp_path, how, measured):
    process, out, scratch = _start(tmp_path)
    _wait_for_steps(process, out, 2)
    sent = time.monotonic()
    if how == "ctrl-c":
        os.killpg(process.pid, signal.SIGINT)   # the terminal signals every process of the group
    else:
        os.kill(process.pid, signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    seconds = time.monotonic() - sent
    measured(f"dask-rl run stopped by {how}: exited {seconds:.1f}s after the signal (2 shared CPU cores)")
    assert process.returncode == (130 if how == "ctrl-c" else 143), stderr[-3000:]
    assert "Traceback" not in stderr and "still alive" not in stderr and "leaked" not in stderr, stderr[-3000:]
    last = stdout.strip().splitlines()[-1]
    assert last.startswith(f"dask-rl: stopped by {'SIGINT' if how == 'ctrl-c' else 'SIGTERM'} after step")
    assert f"model in {out / 'actor'}" in last and "checkpoint in" in last and "metrics in" in last
    assert "sample (reward" in stdout  # --sample-every 1
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(len(steps)))
    path, state = checkpoint.find(out)
    assert state["step"] == len(steps) and f"after step {len(steps)}" in last
    assert (out / "actor" / "model.safetensors").is_file()
    assert _files_left(scratch) == [], _files_left(scratch)  # the workers' scratch space is gone
    assert list(Path("/dev/shm").glob(f"dask-rl-{process.pid}-*")) == []  # no weight snapshot left

    if how == "ctrl-c":  # and the stopped run goes on from its checkpoint to train.steps in all
        resumed = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(tmp_path / "run.yaml"),
                                  "--output-dir", str(out), "--dashboard-address", ":0", "--resume",
                                  "--steps", str(len(steps) + 2)], cwd=ROOT, capture_output=True, text=True, timeout=400)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        again = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert again == list(range(len(steps) + 2))


@pytest.mark.slow
def test_a_second_ctrl_c_exits_at_once(tmp_path):
    process, out, _ = _start(tmp_path)
    _wait_for_steps(process, out, 1)
    os.killpg(process.pid, signal.SIGINT)
    time.sleep(0.2)
    sent = time.monotonic()
    os.killpg(process.pid, signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 130
    assert time.monotonic() - sent < 10
    assert "interrupted again; exiting now" in stderr and "Traceback" not in _without_tracker_noise(stderr)
    assert list(Path("/dev/shm").glob(f"dask-rl-{process.pid}-*")) == []


def _without_tracker_noise(stderr: str) -> str:
    """stderr less a traceback of CPython's multiprocessing resource tracker: when a second
    Ctrl-C kills the processes that share it mid-message, the tracker (a process of its own,
    started by multiprocessing, not by dask-rl) may print a KeyError for a semaphore name it
    was told to forget twice. It holds nothing of the run's; everything else must stay quiet."""
    blocks = stderr.split("Traceback (most recent call last):")
    kept = [blocks[0]] + [b for b in blocks[1:] if "multiprocessing/resource_tracker.py" not in b.split("\n\n")[0]]
    return "Traceback (most recent call last):".join(kept)
