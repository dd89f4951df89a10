#!/usr/bin/env bash
# Where dask-rl's GPU memory goes on the GRPO work of benchmarks/grpo_vs_trl.py (batch 64, no
# TRL): the same run under a few settings, one after another on one GPU.
#   OUT=/tmp/gpu-memory bash benchmarks/gpu_memory_variants.sh
OUT=${OUT:-/tmp/gpu-memory}
source benchmarks/gpu_setup.sh
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
run() {  # run NAME ENV... -- ARGS...
    local name=$1; shift
    local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
    local start=$SECONDS
    echo "::: $name: ${envs[*]} $*"
    env "${envs[@]}" timeout 200 python3 benchmarks/grpo_vs_trl.py --prompts-per-step 8 --dask-steps 6 --skip-trl \
        --json "$OUT/$name.json" "$@" 2>&1 | grep -E "^dask-rl|^  |Error|error" | grep -v -E "warn|Loading" | tail -20
    echo "::: $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}
for v in ${VARIANTS:-chunk1024 chunk512 expandable}; do
    case $v in
        chunk1024) run chunk1024 X=1 -- ;;
        chunk512) run chunk512 X=1 -- --logit-chunk 512 ;;
        chunk256) run chunk256 X=1 -- --logit-chunk 256 ;;
        expandable) run expandable PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -- --logit-chunk 512 ;;
    esac
done
