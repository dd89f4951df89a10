"""examples/gsm8k.yaml end to end on CPU: a GSM8K-format file written here (a handful of
hand-made problems), turned into rows by scripts/prep_gsm8k.py, trained with the example's own
train settings on a tiny local model whose tokenizer has Qwen's chat template."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PROBLEMS = [
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = <<3+4=7>>7\n#### 7"),
    ("A box holds 12 eggs. How many eggs are in 2 boxes?", "12 * 2 = <<12*2=24>>24\n#### 24"),
    ("Sara had 1,200 dollars and spent 200. How much is left?", "1200 - 200 = <<1200-200=1000>>1000\n#### 1,000"),
    ("There are 9 birds and 5 fly away. How many remain?", "9 - 5 = <<9-5=4>>4\n#### 4"),
    ("Each of 6 kids gets 2 pens. How many pens in all?", "6 * 2 = <<6*2=12>>12\n#### 12"),
    ("A rope of 10 m is cut in half. How long is each part?", "10 / 2 = <<10/2=5>>5\n#### 5"),
]


def test_prep_script_turns_gsm8k_rows_into_chat_rows_with_final_answers(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": [q for q, _ in PROBLEMS], "answer": [a for _, a in PROBLEMS]}), source)
    out = tmp_path / "rows.jsonl"
    done = subprocess.run([sys.executable, "scripts/prep_gsm8k.py", str(source), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["answer"] for r in rows] == ["7", "24", "1000", "4", "12", "5"]  # the comma dropped
    assert rows[0]["prompt"][0]["role"] == "system"
    assert rows[0]["prompt"][1] == {"role": "user", "content": PROBLEMS[0][0]}
    assert rows[2]["solution"] == PROBLEMS[2][1]


@pytest.mark.slow
def test_the_gsm8k_example_trains_and_evaluates_on_cpu(tmp_path):
    test_prep_script_turns_gsm8k_rows_into_chat_rows_with_final_answers(tmp_path)
    run = yaml.safe_load((ROOT / "examples" / "gsm8k.yaml").read_text())
    train = run["train"]
    # The example as written, but on CPU workers and the tiny chat model, for 4 short steps.
    train.update(actor_model="tiny-chat", prompts=str(tmp_path / "rows.jsonl"),
                 eval_prompts=str(tmp_path / "rows.jsonl"), steps=4, prompts_per_step=3, samples_per_prompt=2,
                 max_new_tokens=8, dtype="float32", eval_every_n_steps=2, actor_lr=1e-3)
    train["reward_function"][1]["kwargs"] = {"max_response_tokens": 8, "buffer_tokens": 4}
    cpu = {"device_type": "cpu", "workers": 1}
    run_file = tmp_path / "gsm8k_cpu.yaml"
    run_file.write_text(yaml.safe_dump({"actor": cpu, "reward": cpu, "rollout": {**cpu, "strategy": "hf"},
                                        "timeout_seconds": 300, "train": train}))
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", str(run_file), "--dashboard-address", ":0",
                           "--output-dir", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "reward" in line]
    assert len(steps) == 4
    assert all("rewards/gsm8k_accuracy/mean" in line and "rewards/soft_overlong_penalty/mean" in line for line in steps)
    evaluated = sorted(int(line["eval/step"]) for line in lines if "eval/accuracy" in line)
    assert evaluated == [0, 2, 4]   # eval_before_train, every 2 steps, and the final weights
    samples = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert all(s["fields"]["answer"] in {"7", "24", "1000", "4", "12", "5"} for s in samples)
