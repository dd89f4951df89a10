# Source this on the GPU machine (no registry there): installs the Dask wheels carried in
# .whl/ (dask, distributed, dask-cuda and their pure-Python needs, fetched beforehand with
# `pip download --only-binary=:all: --python-version 3.12 ...`) into .site/, puts them on the path,
# creates $OUT and starts an nvidia-smi trace of per-process GPU memory into $OUT/gpu_apps.csv
# (stopped when the calling script exits).
set -uo pipefail
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target .site .whl/*.whl && export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-compute-apps=timestamp,pid,used_memory --format=csv -lms 500 > "$OUT/gpu_apps.csv" &
SMI=$!
trap 'kill $SMI 2>/dev/null' EXIT
