"""Turn GSM8K's layout (columns `question` and `answer`, the answer's last line `#### N`) into
dask-rl rows: a chat prompt, the final answer, and the worked solution.

    python scripts/prep_gsm8k.py train.parquet gsm8k_train.jsonl      # a local copy
    python scripts/prep_gsm8k.py openai/gsm8k:main:test gsm8k_test.jsonl  # through `datasets` and the hub

Each output line: {"prompt": [{"role": "system", ...}, {"role": "user", "content": question}],
"answer": "72", "solution": the original answer text}. The answer is the number after the last
"####" with thousands separators removed, which is what pipeline.rewards:gsm8k_accuracy and
math_accuracy compare against.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SYSTEM = ("Solve the math problem. Reason briefly, then write the final answer on its own line "
          "as '#### <number>'.")


def final_answer(solution: str) -> str:
    """The number after the last '####' of a GSM8K answer, without thousands separators."""
    if "####" not in solution:
        raise ValueError(f"no '####' line in the answer {solution[-80:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "").replace("$", "")


def gsm8k_rows(records, system: str = SYSTEM) -> list[dict]:
    rows = []
    for i, record in enumerate(records):
        try:
            question, solution = record["question"], record["answer"]
            rows.append({"prompt": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                         "answer": final_answer(solution), "solution": solution})
        except (KeyError, ValueError) as error:
            raise SystemExit(f"row {i}: {error}. Fix: give GSM8K's layout (columns question and answer).") from None
    return rows


def read_source(source: str) -> list[dict]:
    path = Path(source)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    name, _, rest = source.partition(":")   # hub id[:config[:split]]
    config, _, split = rest.partition(":")
    from datasets import load_dataset

    return load_dataset(name, config or "main", split=split or "train").to_list()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a .parquet or .jsonl file in GSM8K's layout, or hub_id[:config[:split]]")
    parser.add_argument("output", help="the .jsonl file to write")
    parser.add_argument("--system", default=SYSTEM, help="the system prompt put before each question")
    args = parser.parse_args(argv)
    rows = gsm8k_rows(read_source(args.source), args.system)
    with open(args.output, "w") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows)} rows to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
