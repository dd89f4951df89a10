#!/usr/bin/env bash
# The quickstart with every role on GPU 0, on the GPU machine. Writes its log, the metrics
# and an nvidia-smi trace of per-process GPU memory into ${OUT:-/tmp/gpu-quickstart}.
OUT=${OUT:-/tmp/gpu-quickstart}
source benchmarks/gpu_setup.sh
start=$(date +%s)
timeout "${RUN_TIMEOUT:-300}" python3 -m pipeline.cli run examples/quickstart_gpu.yaml --output-dir "$OUT/run" \
  --dashboard-address :0 2>&1 | tr '\r' '\n' | grep -v "Loading weights" > "$OUT/log.txt"
echo "exit: $? wall seconds: $(( $(date +%s) - start ))" | tee -a "$OUT/log.txt"
tail -25 "$OUT/log.txt"
echo "distinct GPU processes: $(tail -n +2 "$OUT/gpu_apps.csv" | cut -d, -f2 | sort -u | wc -l)"
echo "peak MiB per pid:"; tail -n +2 "$OUT/gpu_apps.csv" | awk -F, '{gsub(/ MiB/,"",$3); if ($3>m[$2]) m[$2]=$3} END {for (p in m) print p, m[p]}'
