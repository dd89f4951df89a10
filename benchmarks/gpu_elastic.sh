#!/usr/bin/env bash
# On the GPU machine: move the reference role onto GPU 0 and back while PPO trains on GPU 0,
# with an nvidia-smi trace showing the GPU-0 reference process appear and go.
OUT=${OUT:-/tmp/gpu-elastic}
source benchmarks/gpu_setup.sh
timeout "${RUN_TIMEOUT:-240}" python3 benchmarks/elastic_scaling.py examples/elastic_gpu.yaml --role reference \
  --move 20:cuda=0 --move 120:cpu=1 --steps 220 2>&1 | grep -v "Loading weights\|Writing model" > "$OUT/log.txt"
echo "exit: $?"
grep '^{' "$OUT/log.txt" | grep -v '"step"' ; grep '"step"' "$OUT/log.txt" | cut -c1-150
echo "GPU processes over time (pid: first seen, last seen):"
tail -n +2 "$OUT/gpu_apps.csv" | awk -F, '{if (!($2 in f)) f[$2]=$1; l[$2]=$1} END {for (p in f) print p, f[p], l[p]}'
