# Source this on the GPU machine (no registry there): installs the Dask wheels carried in
# .whl/ (fetched here with ../shared/tools/gpu-wheels.sh) into .site/ and puts them on the path.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target .site .whl/*.whl && export PYTHONPATH=$PWD/.site:$PWD
