OUT=${OUT:-/tmp/gpu}; source benchmarks/gpu_setup.sh; export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -c "import transformers, torch; print(transformers.__version__, torch.__version__)"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/pipeline/test_engines_gpu.py 2>&1 | grep -v "Loading weights" | tail -25
timeout 330 python3 benchmarks/rollout_engines.py --batches 256 --new-tokens 1024 --long-tail 0.004 0.0075 --skip-generate --repeats 2 --json $OUT/long_tail.json 2>&1 | grep -v "Loading weights" | tail -20
