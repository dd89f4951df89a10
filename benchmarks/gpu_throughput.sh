#!/usr/bin/env bash
# Issue-8 figures on the GPU machine, each part under its own time limit so that a slow part
# still leaves the others' output: PARTS="engines grpo32 grpo8 gputests" (default: all, in this order:
# the engines part fills Inductor's cache with the decode graphs the GRPO runs use).
# All parts take about 10 minutes on a fresh machine (Inductor's cache cold): split them over
# calls with PARTS where one call is limited to less.
#   OUT=/tmp/gpu-throughput bash benchmarks/gpu_throughput.sh
OUT=${OUT:-/tmp/gpu-throughput}
source benchmarks/gpu_setup.sh
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
part() {  # part NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    echo "::: $name: $*"
    timeout "$limit" "$@" 2>&1 | tr '\r' '\n' | grep -v -E "Loading weights|Writing model shards|it/s\]$" \
        | tee "$OUT/$name.log" | grep -v -E "^\s*$|warn" | tail -40
    echo "::: $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}
for p in ${PARTS:-engines grpo32 grpo8 gputests}; do
    case $p in
        grpo8) part grpo8 220 python3 benchmarks/grpo_vs_trl.py --prompts-per-step 8 --dask-steps 10 --trl-steps 4 \
                   --json "$OUT/grpo8.json" ;;
        grpo32) part grpo32 330 python3 benchmarks/grpo_vs_trl.py --prompts-per-step 32 --dask-steps 6 --trl-steps 3 \
                   --micro-batches 16 64 --json "$OUT/grpo32.json" ;;
        engines) part engines 200 python3 benchmarks/rollout_engines.py --batches 64 256 --repeats 2 ;;
        gputests) part gputests 150 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/pipeline/test_engines_gpu.py \
                      tests/resources/test_allocator_gpu.py::test_cuda_graph_engine_batch_follows_the_memory_another_process_leaves ;;
    esac
done
