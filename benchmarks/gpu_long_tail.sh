#!/usr/bin/env bash
# Long-tail figures on one GPU, each part under its own time limit (seconds, from the *_LIMIT
# variables): PARTS="start tests engine partial prefill attention sharedattention profile sampler update updateshared grpo256 grpo256partial grpo256hosted grpo256fixed grpo64"
# (sampler: decode_profile.py with the exponential race, the sampler before, then the inverse one)
# (updateshared: the batch-256 fixed-length update with and without train.share_prompts, profiled;
# sharedattention: one layer's attention of that update alone, FlexAttention against cuDNN)
# (default: tests engine update; MAX_STALENESS, default 2, for the partial parts; KV="prefill keep",
# the default, times `partial` both ways, at each of REFILL_SHARES (default 16); KEEP_KV=1 runs
# grpo256partial with train.partial_keep_kv; PREFILL_MODES="eager compiled" and LOOKS="lagged
# present" time `partial` each way; REQUEST_GROUPS (default 3) is train.partial_request_groups of
# `partial`, grpo256partial and grpo256hosted (the same run with rollout: {hosted_by: actor}, no
# MPS needed, and HOSTED_CAP, e.g. 9, as the actor's max_gpu_memory_gib); `tests` runs every
# `-m gpu` test under TESTS_PATHS (default tests/); ALLOC_CONF is grpo256partial's PYTORCH_CUDA_ALLOC_CONF for
# dask-rl's workers; UPDATE_ARGS go to packed_update.py; PROFILE_SLOTS, default "256 32", are
# the slot counts decode_profile.py profiles (PROFILE_ARGS, e.g. --unfused, more of its flags); DECODE_ATTENTION=sdpa|kernel is the cuda_graph
# engine's decode attention in every part (`attention` times the two alone); with MPS=1 every part runs under an NVIDIA MPS
# daemon of its own, started here and stopped after, and dask-rl's GRPO runs say gpu_sharing: mps;
# SKIP_TRL=1, DASK_STEPS and GRPO_ARGS (more grpo_vs_trl.py flags) apply to every GRPO part).
# OUT=/tmp/gpu bash benchmarks/gpu_long_tail.sh
# `tests` runs the MPS test first, before this pytest process holds a CUDA context of its own.
# `start` runs the build probe and then a batch-64 GRPO run without TRL twice each: the first
# of each pair pays for compiling bytecode (and decode graphs) on a fresh machine, the second
# starts as a user's later runs do.
# On a fresh H100 each slot count's decode graph takes ~30 s to compile: a long-tailed part meets
# six (256 down to 8 slots), so `engine` needs ~5 min and a long-tailed GRPO run's first step ~3.
OUT=${OUT:-/tmp/gpu-long-tail}
source benchmarks/gpu_setup.sh
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
part() {  # part NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    echo "::: $name: $*"
    timeout "$limit" "$@" 2>&1 | tr '\r' '\n' | grep -v -E "Loading weights|Writing model shards|it/s\]$" \
        | tee "$OUT/$name.log" | grep -v -E "^\s*$|warn" | tail -${TAIL:-30}
    echo "::: $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}
long_tail_partial() {  # long_tail_partial NAME JSON MORE_FLAGS...: the long tail with partial rollouts against TRL
    local name=$1 json=$2; shift 2
    part "$name" ${GRPO_LIMIT:-420} python3 benchmarks/grpo_vs_trl.py --prompts-per-step 32 \
        --new-tokens 1024 --end-probability 0.005 --partial-rollouts --max-staleness ${MAX_STALENESS:-2} \
        --request-groups ${REQUEST_GROUPS:-3} --dask-steps ${DASK_STEPS:-6} ${KEEP_KV:+--partial-keep-kv} "$@" \
        --trl-steps ${TRL_STEPS:-3} ${SKIP_TRL:+--skip-trl} ${GRPO_ARGS:-} ${ALLOC_CONF:+--worker-alloc-conf $ALLOC_CONF} \
        --json "$OUT/$json"
}
if [ -n "${MPS:-}" ]; then   # one CUDA context for every process: kernels of two processes run at once
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/dask-rl-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dask-rl-mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && echo "MPS daemon started ($CUDA_MPS_PIPE_DIRECTORY: $(ls "$CUDA_MPS_PIPE_DIRECTORY" | tr '\n' ' '))"
    GRPO_ARGS="${GRPO_ARGS:-} --gpu-sharing mps"
    trap 'echo quit | nvidia-cuda-mps-control; kill $SMI 2>/dev/null; save_inductor_cache' EXIT
fi
DECODE=${DECODE_ATTENTION:+--decode-attention $DECODE_ATTENTION}
GRPO_ARGS="${GRPO_ARGS:-} $DECODE"
for p in ${PARTS:-tests engine update}; do
    case $p in
        start) for i in 1 2; do part start_probe_$i ${START_LIMIT:-60} python3 benchmarks/start_probe.py; done
               for i in 1 2; do part cluster_start_$i ${START_LIMIT:-60} python3 benchmarks/grpo_vs_trl.py \
                   --prompts-per-step 8 --dask-steps 3 --skip-trl --json "$OUT/cluster_start.json"; done ;;
        tests) part tests ${TESTS_LIMIT:-330} python3 -m pytest -q -m gpu -p no:cacheprovider -s --continue-on-collection-errors \
                   tests/pipeline/test_mps_gpu.py ${TESTS_PATHS:-tests} ${TESTS_K:+-k "$TESTS_K"} ;;
        engine) part engine ${ENGINE_LIMIT:-330} python3 benchmarks/rollout_engines.py --batches 256 --new-tokens 1024 \
                    --long-tail 0.004 0.0075 --skip-generate --repeats 2 $DECODE --json "$OUT/long_tail.json" ;;
        partial) part partial ${PARTIAL_LIMIT:-330} python3 benchmarks/rollout_engines.py --batches 256 --new-tokens 1024 \
                     --long-tail ${LONG_TAIL:-0.004 0.0075} --partial 6 --request-groups ${REQUEST_GROUPS:-3} --max-staleness ${MAX_STALENESS:-2} \
                     --kv ${KV:-prefill keep} --refill-share ${REFILL_SHARES:-16} --prefill ${PREFILL_MODES:-eager} --looks ${LOOKS:-lagged} \
                     $DECODE --json "$OUT/partial.json" ;;
        grpo256hosted) long_tail_partial grpo256hosted grpo256_hosted.json \
                     --hosted-rollout ${HOSTED_CAP:+--max-gpu-memory-gib $HOSTED_CAP} ;;
        grpo256partial) long_tail_partial grpo256partial grpo256_partial.json ;;
        prefill) part prefill ${PREFILL_LIMIT:-240} python3 benchmarks/prefill_passes.py --compile ;;
        profile) part profile ${PROFILE_LIMIT:-150} python3 benchmarks/decode_profile.py --slots ${PROFILE_SLOTS:-256 32} $DECODE ${PROFILE_ARGS:-} ;;
        sampler) for s in race inverse; do part sampler_$s ${PROFILE_LIMIT:-150} python3 benchmarks/decode_profile.py \
                     --slots ${PROFILE_SLOTS:-256} --sampler $s --top 14 $DECODE ${PROFILE_ARGS:-}; done ;;
        attention) part attention ${ATTENTION_LIMIT:-150} python3 benchmarks/decode_attention.py ;;
        sharedattention) part sharedattention ${ATTENTION_LIMIT:-150} python3 benchmarks/shared_attention.py ;;
        update) part update ${UPDATE_LIMIT:-150} python3 benchmarks/packed_update.py --json "$OUT/packed_update.json" ${UPDATE_ARGS:-} ;;
        updateshared) TAIL=${TAIL:-80} part updateshared ${UPDATE_LIMIT:-200} python3 benchmarks/packed_update.py --rows 256 \
                     --samples 8 --max-response 256 --mean-response 1e9 --token-caps --compile-model --share-prompts \
                     --only "packed, compile_model" --profile --json "$OUT/packed_update_shared.json" ;;
        grpo256) part grpo256 ${GRPO_LIMIT:-420} python3 benchmarks/grpo_vs_trl.py --prompts-per-step 32 \
                     --new-tokens 1024 --end-probability 0.005 --dask-steps ${DASK_STEPS:-6} --trl-steps ${TRL_STEPS:-3} \
                     ${SKIP_TRL:+--skip-trl} ${GRPO_ARGS:-} --json "$OUT/grpo256_long.json" ;;
        grpo256fixed) part grpo256fixed ${FIXED_LIMIT:-300} python3 benchmarks/grpo_vs_trl.py --prompts-per-step 32 --dask-steps ${DASK_STEPS:-6} \
                     --trl-steps ${TRL_STEPS:-3} ${SKIP_TRL:+--skip-trl} ${GRPO_ARGS:-} --json "$OUT/grpo256_fixed.json" ;;
        grpo64) part grpo64 ${G64_LIMIT:-240} python3 benchmarks/grpo_vs_trl.py --prompts-per-step 8 --dask-steps ${DASK_STEPS:-8} \
                    --trl-steps ${TRL_STEPS:-3} ${SKIP_TRL:+--skip-trl} ${GRPO_ARGS:-} --json "$OUT/grpo64_fixed.json" ;;
    esac
done
