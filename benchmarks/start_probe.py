"""Where a GPU role worker's start goes: each piece of building the rollout role, timed in a
fresh process (run it twice: the second shows what the OS page cache saves).

Prints seconds for: importing torch, CUDA's context, importing transformers' model and
tokenizer modules, the tokenizer, the model read onto the CPU, the move to the GPU in bf16,
and the cuda_graph engine's construction; then the same model loaded straight onto the GPU.

    python benchmarks/start_probe.py            # Qwen2-0.5B's shape, random weights, ~20 s
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "dask-rl-qwen2-0.5b"))
    args = parser.parse_args()
    clock = time.perf_counter()
    marks: list[tuple[str, float]] = []

    def mark(what: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        marks.append((what, now - clock))
        print(f"{what}: {now - clock:.2f} s", flush=True)
        clock = now

    import torch
    mark("import torch")
    torch.zeros(1, device="cuda")
    mark("CUDA context")
    import transformers.modeling_utils  # noqa: F401
    import transformers.models.auto.modeling_auto  # noqa: F401
    import transformers.models.auto.tokenization_auto  # noqa: F401
    mark("import transformers (the workers' background imports)")
    from benchmarks.shapes import save_qwen2_05b
    from pipeline.models import load_causal_lm, load_tokenizer
    model_dir = str(save_qwen2_05b(args.model_dir))
    mark("model files (created if missing)")
    tokenizer = load_tokenizer(model_dir)
    mark("tokenizer")
    model = load_causal_lm(model_dir, device="cpu", dtype=torch.bfloat16)
    mark("model onto the CPU")
    model = model.to("cuda")
    torch.cuda.synchronize()
    mark("model to the GPU")
    from pipeline.engines.cuda_graph import CudaGraphEngine
    CudaGraphEngine(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, device="cuda",
                    decode=tokenizer.decode)
    mark("cuda_graph engine")
    del model
    again = load_causal_lm(model_dir, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    mark("model straight onto the GPU (again)")
    del again
    print("total " + f"{sum(seconds for _, seconds in marks):.2f} s", flush=True)


if __name__ == "__main__":
    main()
