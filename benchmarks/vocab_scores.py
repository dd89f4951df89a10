"""The response tokens' logprobs (and entropy) over one chunk of logits, forward and backward:
pipeline/vocab_scores.py's one autograd function against the chunk differentiated op by op
under checkpointing (the way before it; packed_update.py's --autograd-projection).

Random float32 data over a Qwen2-sized vocabulary: `--tokens` hidden states of size
`--hidden` projected onto `--vocab` logits by a linear head without a bias. Eager on the
CPU (the tests' path) by default; on a GPU with --device cuda, and --compiled for the
passes over the logits through torch.compile (a compiled model's path). Prints the median of
`--repeats` runs each way, after one warm-up run.

    python benchmarks/vocab_scores.py                 # ~1 minute on a 2-core CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.roles.forward import _project_logits  # noqa: E402
from pipeline.vocab_scores import projected_scores  # noqa: E402


def _project(head, hidden, tokens, temperature: float, entropy_grad: bool | None):
    return _project_logits(head(hidden), tokens, temperature, entropy_grad)


_compiled_project = torch.compile(_project, dynamic=True)


def autograd_projection(head, hidden, tokens, temperature: float, entropy_grad: bool | None, compiled: bool):
    """The projection as it was before vocab_scores: each chunk's logits, log-softmax and
    entropy differentiated op by op, the chunk checkpointed (recomputed in the backward)."""
    project = _compiled_project if compiled else _project
    if not torch.is_grad_enabled():
        return project(head, hidden, tokens, temperature, entropy_grad)
    return checkpoint(project, head, hidden, tokens, temperature, entropy_grad, use_reentrant=False)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compiled", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=args.device)
    hidden = torch.randn(args.tokens, args.hidden, device=args.device, requires_grad=True)
    tokens = torch.randint(0, args.vocab, (args.tokens,), device=args.device)

    def seconds(way, entropy_grad) -> float:
        def once() -> float:
            start = time.perf_counter()
            logprobs, _ = way(head, hidden, tokens, 1.0, entropy_grad, args.compiled)
            logprobs.sum().backward()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            return time.perf_counter() - start
        once()
        return statistics.median(once() for _ in range(args.repeats))

    print(f"{args.tokens} tokens x {args.vocab} vocabulary, hidden {args.hidden}, {args.device}"
          f"{', compiled' if args.compiled else ''}: forward and backward, median of {args.repeats}")
    for label, entropy_grad in (("logprobs only", None), ("and the entropy as a figure", False)):
        before, now = seconds(autograd_projection, entropy_grad), seconds(projected_scores, entropy_grad)
        print(f"  {label:28} op by op {before:6.3f} s   one function {now:6.3f} s")


if __name__ == "__main__":
    main()
