#!/usr/bin/env bash
# Issue-12 figures on the GPU machine (about 2-3 minutes on one H200): real out-of-memory
# errors under a per-process memory cap (actor update, reference forward, HF scoring) and the
# cuda_graph engine's batch following the memory another process leaves. Prints the cap, the
# configured and chosen micro-batch, step times before and after, and the equality of results.
#   OUT=/tmp/allocator-gpu bash benchmarks/allocator_gpu.sh
OUT=${OUT:-/tmp/allocator-gpu}
source benchmarks/gpu_setup.sh
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider tests/resources/test_allocator_gpu.py -s 2>&1 \
    | tee "$OUT/allocator_gpu.log" | grep -v -E "^\s*$|Warning|warn"
echo "::: allocator_gpu: exit ${PIPESTATUS[0]}"
