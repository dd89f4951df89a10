# Source this on the GPU machine (no registry there): installs the Dask wheels carried in
# .whl/ (dask, distributed, dask-cuda and their pure-Python needs, fetched beforehand with
# `pip download --only-binary=:all: --python-version 3.12 ...`) into .site/, puts them on the path,
# creates $OUT and starts an nvidia-smi trace of per-process GPU memory into $OUT/gpu_apps.csv
# (stopped when the calling script exits). It also lets Python keep compiled bytecode (in
# /tmp/pycache): the lent image sets PYTHONDONTWRITEBYTECODE and ships few .pyc files, so
# every process there compiled torch's and transformers' sources again (import transformers
# 9-16 s instead of 6 s), which a pip-installed environment never does.
set -uo pipefail
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target .site .whl/*.whl && export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-compute-apps=timestamp,pid,used_memory --format=csv -lms 500 > "$OUT/gpu_apps.csv" &
SMI=$!
trap 'kill $SMI 2>/dev/null' EXIT
