"""`dask-rl run` as a user runs it: a subprocess, a run file, an exit code."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


def dask_rl(*args: str, timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def test_a_bad_resource_key_exits_2_with_one_line_naming_the_key(tmp_path):
    run_file = tmp_path / "run.yaml"
    run_file.write_text(QUICKSTART.read_text().replace("reward:    {device_type: cpu, workers: 1}",
                                                       "reward:    {device_type: cpu, wrokers: 1}"))
    assert "wrokers" in run_file.read_text()
    result = dask_rl("run", str(run_file), "--output-dir", str(tmp_path / "out"), timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # one line, no traceback
    assert "Traceback" not in result.stderr
    assert str(run_file) in lines[0] and "reward.wrokers" in lines[0] and "did you mean 'workers'" in lines[0]
    assert "Fix:" in lines[0]
    assert not (tmp_path / "out").exists()  # failed before anything started


def test_a_bad_train_key_exits_2_with_one_line_naming_the_key(tmp_path):
    run_file = tmp_path / "run.yaml"
    run_file.write_text(QUICKSTART.read_text().replace("  ppo_epochs: 2", "  ppo_epoch: 2")
                        .replace("quickstart_prompts.jsonl", str(ROOT / "examples" / "quickstart_prompts.jsonl")))
    result = dask_rl("run", str(run_file), timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "'ppo_epoch'" in lines[0] and "Did you mean 'ppo_epochs'?" in lines[0]


def test_a_missing_prompt_file_exits_2_naming_it(tmp_path):
    run_file = tmp_path / "run.yaml"
    run_file.write_text(QUICKSTART.read_text())  # its prompts file is not beside this copy
    result = dask_rl("run", str(run_file), timeout=120)
    assert result.returncode == 2
    assert "train.prompts: 'quickstart_prompts.jsonl' does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_malformed_prompt_line_exits_2_naming_the_file_and_line(tmp_path):
    prompts = tmp_path / "quickstart_prompts.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    run_file = tmp_path / "run.yaml"
    run_file.write_text(QUICKSTART.read_text())  # its prompts are the bad file beside it
    result = dask_rl("run", str(run_file), "--output-dir", str(tmp_path / "out"), timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"{prompts} line 2: not valid JSON" in lines[0] and "Fix: write one JSON object per line" in lines[0]
    assert not (tmp_path / "out").exists()  # failed before anything started


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_strategy_vllm_without_vllm_exits_2_with_the_install_hint_before_anything_starts(tmp_path):
    run_file = tmp_path / "run.yaml"
    run_file.write_text(QUICKSTART.read_text().replace("strategy: hf}", "strategy: vllm}")
                        .replace("quickstart_prompts.jsonl", str(ROOT / "examples" / "quickstart_prompts.jsonl")))
    assert "strategy: vllm" in run_file.read_text()
    result = dask_rl("run", str(run_file), "--output-dir", str(tmp_path / "out"), timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "rollout.strategy: vllm, but vllm is not installed" in lines[0] and "scripts/vllm_venv.sh" in lines[0]
    assert not (tmp_path / "out").exists()  # failed before anything started


def _free_address() -> str:
    """A local TCP address nothing listens at (the OS just handed the port out and took it back)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


def _one_line_error(result: subprocess.CompletedProcess, progress: str = "") -> str:
    """The one line of an error; lines starting with `progress` (a progress bar) are not part of it."""
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if not (progress and line.startswith(progress))]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "Fix:" in lines[0]
    return lines[0]


CONNECTING = {
    "scale": ["scale", "{address}", "--role", "rollout", "--workers", "2"],
    "worker": ["worker", "{address}", "--role", "reward"],
    "run --scheduler-address": ["run", str(QUICKSTART), "--scheduler-address", "{address}"],
}


@pytest.mark.parametrize("args", CONNECTING.values(), ids=CONNECTING.keys())
def test_a_command_pointed_at_no_scheduler_fails_at_once_in_one_line(args, measured):
    address = _free_address()
    start = time.perf_counter()
    result = dask_rl(*(a.format(address=address) for a in args), timeout=120)
    seconds = time.perf_counter() - start
    line = _one_line_error(result)
    assert line.startswith(f"dask-rl {args[0]}: no Dask scheduler at {address} (connection refused). "
                           "Fix: start one with `dask-rl scheduler`")
    # Python's start and imports included; Dask's own connect would retry for 30 s.
    assert seconds < 15, seconds
    measured(f"dask-rl {args[0]} to a closed port: refused in {seconds:.1f} s (process start included)")


HOSTILE_RUN_FILES = {
    "alias bomb": ("a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 10)), "anchors and aliases expand to"),
    "deep nesting": ("actor: " + "[" * 50_000 + "]" * 50_000 + "\n", "nested deeper than 32 levels"),
    "binary": (b"\x7fELF\x02\x01\x01" + bytes(range(128)) * 64, "character #x007f is not allowed in YAML"),
    "not utf-8": (b"actor: {device_type: cpu}\nreward: caf\xe9\n", "line 2: not UTF-8 text"),
    "2 MiB": ("# " + "x" * (2 << 20) + "\n", "larger than 1 MiB"),
}


@pytest.mark.parametrize("content, problem", HOSTILE_RUN_FILES.values(), ids=HOSTILE_RUN_FILES.keys())
def test_a_hostile_run_file_is_one_line_exit_2(tmp_path, content, problem):
    run_file = tmp_path / "run.yaml"
    run_file.write_bytes(content if isinstance(content, bytes) else content.encode())
    line = _one_line_error(dask_rl("run", str(run_file), timeout=60))
    assert line.startswith(f"dask-rl: {run_file}: ") and problem in line and len(line) < 400


def test_a_usage_error_is_one_line_with_the_fix():
    line = _one_line_error(dask_rl("run", "--steps", "many", "x.yaml", timeout=60))
    assert line == "dask-rl run: argument --steps: invalid int value: 'many'. Fix: see `dask-rl run --help`."


def test_debug_shows_the_traceback_as_well():
    result = dask_rl("scale", "nonsense", "--role", "rollout", "--debug", timeout=60)
    assert result.returncode == 2
    assert "Traceback (most recent call last)" in result.stderr and "check_scheduler" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "dask-rl scale: 'nonsense' is not a scheduler address (missing port number in address 'nonsense'). "
        "Fix: write it as tcp://HOST:PORT, e.g. tcp://127.0.0.1:8786")


def test_a_prompt_too_long_for_the_model_exits_2_in_one_line_before_a_cluster_starts(tmp_path):
    (tmp_path / "quickstart_prompts.jsonl").write_text('{"prompt": "hi"}\n' + json.dumps({"prompt": "9" * 300}) + "\n")
    run_file = tmp_path / "run.yaml"
    run_file.write_text(QUICKSTART.read_text())  # its prompts are the file beside it
    result = dask_rl("run", str(run_file), "--output-dir", str(tmp_path / "out"), timeout=120)
    line = _one_line_error(result, progress="Writing model shards")  # the tiny model is saved first
    assert line.startswith("dask-rl run: prompts: 1 of 2 prompts are longer than 244 tokens (the model's context "
                           "of 256 minus train.max_new_tokens 12); the longest, prompt 1, has 300")
    assert "train.long_prompts: truncate" in line
    assert "dashboard at" not in result.stdout  # refused before the cluster started


def test_any_other_error_is_one_line_with_its_type_and_a_fix():
    from pipeline.cli import one_line

    assert one_line(RuntimeError("worker died\n  while loading")) == (
        "RuntimeError: worker died while loading. Fix: rerun with --debug for the traceback, and check the "
        "workers' logs on the dashboard")
    assert one_line(ValueError("train.x: 1 is not allowed. Fix: use 2.")) == "train.x: 1 is not allowed. Fix: use 2."
    assert one_line(KeyError("unknown role 'x'")).startswith("unknown role 'x'. Fix:")  # not "'unknown role...'"
    assert len(one_line(RuntimeError("x" * 10_000))) == 1000


@pytest.mark.slow
def test_quickstart_learns_to_answer_with_digits(tmp_path):
    steps = 40  # examples/quickstart.yaml: train.steps
    result = dask_rl("run", str(QUICKSTART), "--dashboard-address", ":0", "--output-dir", str(tmp_path),
                     timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == steps
    assert [r["step"] for r in records] == list(range(steps))
    rewards = [r["reward"] for r in records]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    # digit_fraction of a random tiny model's text is ~0.3; PPO drives it to ~0.9.
    assert last >= first + 0.3, (first, last)
    assert "mean reward of the first" in result.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not importlib.util.find_spec("torch") or not __import__("torch").cuda.is_available(),
                    reason="needs an NVIDIA GPU")
def test_the_hosted_gpu_example_trains_in_one_capped_process(tmp_path):
    """examples/hosted_gpu.yaml as a user runs it: one GPU process that generates and trains
    under its 4 GiB cap, rewards rising as on CPU."""
    result = dask_rl("run", str(ROOT / "examples" / "hosted_gpu.yaml"), "--dashboard-address", ":0",
                     "--output-dir", str(tmp_path), timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(30))
    rewards = [r["reward"] for r in records]
    assert sum(rewards[-8:]) / 8 >= sum(rewards[:8]) / 8 + 0.2, rewards


def test_the_readme_python_block_is_examples_python_api_py():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## In Python\n\n```python\n", 1)[1].split("```\n", 1)[0]
    assert block == (ROOT / "examples" / "python_api.py").read_text()


@pytest.mark.slow
def test_the_readme_python_example_runs():
    result = subprocess.run([sys.executable, "examples/python_api.py"], cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "reward " in result.stdout and "rollout: +['rollout-1']" in result.stdout
    model_dir = result.stdout.strip().splitlines()[-1].split("the model is in ")[1]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(model_dir).config.tie_word_embeddings


def test_version_prints_the_package_version():
    from pipeline import __version__

    result = dask_rl("--version", timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"dask-rl {__version__}"


@pytest.mark.parametrize("model", ["/nonexistent/dask-rl-model",
                                   pytest.param("examples", marks=pytest.mark.slow)])   # a second process start
def test_a_bad_actor_model_exits_2_with_one_line_naming_the_key(tmp_path, model):
    run_file = tmp_path / "run.yaml"
    run_file.write_text(QUICKSTART.read_text().replace("actor_model: tiny", f"actor_model: {ROOT / model}")
                        .replace("quickstart_prompts.jsonl", str(ROOT / "examples" / "quickstart_prompts.jsonl")))
    result = dask_rl("run", str(run_file), "--output-dir", str(tmp_path / "out"), timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith(f"dask-rl: actor_model: '{ROOT / model}'") and "Fix:" in lines[0]
    assert ("holds no config.json" if model == "examples" else "no local directory") in lines[0]
