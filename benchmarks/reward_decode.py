"""What the reward role's decoding of a batch costs (pipeline/roles/reward.py), on the CPU:
rows of a rollout turned into prompt and response texts, as every step's scoring starts.

Qwen2-0.5B's tokenizer, --rows rows in groups of --samples (one prompt each), prompts of
--prompt tokens and responses of --response, random token ids. Two ways: each row's ids
taken and decoded on its own (as before), and the role's way (every row's ids in one pass,
each group's prompt decoded once). Prints milliseconds, best of --repeats.

    python benchmarks/reward_decode.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import save_qwen2_05b  # noqa: E402

from pipeline.models import load_tokenizer  # noqa: E402
from pipeline.records import Rollout  # noqa: E402
from pipeline.roles.reward import RewardRole  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(save_qwen2_05b(Path(tempfile.gettempdir()) / "dask-rl-qwen2-0.5b"))
    rows, width = args.rows, args.prompt + args.response
    ids = torch.randint(0, len(tokenizer) - 1000, (rows, width), generator=torch.Generator().manual_seed(0))
    ids[:, :args.prompt] = ids[torch.arange(rows) // args.samples * args.samples, :args.prompt]
    rollout = Rollout(input_ids=ids, attention_mask=torch.ones(rows, width, dtype=torch.long),
                      response_mask=torch.ones(rows, args.response), behavior_logprobs=torch.zeros(rows, args.response),
                      group_ids=torch.arange(rows) // args.samples, policy_version=0, prompt_length=args.prompt)
    role = RewardRole.__new__(RewardRole)   # its decoding only: no reward functions or processes
    role.tokenizer = tokenizer

    def row_by_row():
        pairs = [rollout.token_ids(row) for row in range(rows)]
        return ([tokenizer.decode(p, skip_special_tokens=True) for p, _ in pairs],
                [tokenizer.decode(r, skip_special_tokens=True) for _, r in pairs])

    best = {}
    for name, decode in (("row by row", row_by_row), ("the role's", lambda: role.texts(rollout))):
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            texts = decode()
            times.append(time.perf_counter() - start)
        best[name] = (min(times), texts)
    assert best["row by row"][1] == best["the role's"][1], "the two ways decode differently"
    print(f"{rows} rows (groups of {args.samples}), prompts {args.prompt} + responses {args.response} tokens:")
    for name, (seconds, _) in best.items():
        print(f"  {name:11s} {seconds * 1e3:7.1f} ms (best of {args.repeats})")
    return {name: seconds for name, (seconds, _) in best.items()}


if __name__ == "__main__":
    main()
