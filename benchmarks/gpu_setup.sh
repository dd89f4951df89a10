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
# Inductor's compile cache between calls. A fresh machine compiles each decode graph in ~30 s
# and reads it from the cache in ~2 s, so a cache carried in .inductor/ (the parts a call
# left in $OUT as inductor.tgz.*, copied there) is unpacked first, and with SAVE_INDUCTOR=1
# the cache is packed into $OUT at exit when it fits what a call can send back (3 parts).
# It lives in .inductor-cache/ (ignored by git), which a warm machine keeps between calls.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.inductor-cache}
mkdir -p "$TORCHINDUCTOR_CACHE_DIR"
if compgen -G ".inductor/inductor.tgz.*" >/dev/null; then
    cat .inductor/inductor.tgz.* | tar -xz -C "$TORCHINDUCTOR_CACHE_DIR" \
        && echo "inductor cache: $(du -sh "$TORCHINDUCTOR_CACHE_DIR" | cut -f1) restored from .inductor/"
fi
save_inductor_cache() {
    [ -n "${SAVE_INDUCTOR:-}" ] || return 0
    tar -C "$TORCHINDUCTOR_CACHE_DIR" -czf /tmp/inductor.tgz . || return 0
    local bytes; bytes=$(stat -c %s /tmp/inductor.tgz)
    if [ "$bytes" -le $((45 * 1024 * 1024)) ]; then
        split -b 15m -a 1 /tmp/inductor.tgz "$OUT/inductor.tgz." && echo "inductor cache: $((bytes >> 20)) MiB into $OUT"
    else
        echo "inductor cache: $((bytes >> 20)) MiB packed, more than a call sends back (45 MiB): not saved"
    fi
}
trap 'kill $SMI 2>/dev/null; save_inductor_cache' EXIT
