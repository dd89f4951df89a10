"""`dask-rl run` as a user runs it: a subprocess, a run file, an exit code."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
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


@pytest.mark.parametrize("model", ["/nonexistent/dask-rl-model", "examples"])
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
