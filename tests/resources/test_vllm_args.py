"""`vllm_args` keys are checked when the resource file loads, without importing vllm; the
static key list matches the vllm that scripts/vllm_venv.sh installs (the `vllm` test)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.engines.vllm import vllm_installed
from resources import vllm_keys
from resources.config import ResourceConfigError
from resources.validate import load_resource_config

ROOT = Path(__file__).resolve().parents[2]
CPU_VLLM_FILE = """\
actor:   {device_type: cpu, workers: 1}
reward:  {device_type: cpu, workers: 1}
rollout:
  device_type: cpu
  workers: 1
  strategy: vllm
  vllm_args: {ARGS}
"""


def vllm_file(tmp_path, args: str) -> Path:
    path = tmp_path / "resources.yaml"
    path.write_text(CPU_VLLM_FILE.replace("{ARGS}", args))
    return path


def test_engine_keys_load_as_written(tmp_path):
    path = vllm_file(tmp_path, "{max_model_len: 128, enforce_eager: true, gpu_memory_utilization: 0.5}")
    spec = load_resource_config(path).role("rollout")
    assert spec.vllm_kwargs == {"max_model_len": 128, "enforce_eager": True, "gpu_memory_utilization": 0.5}


def test_a_key_the_engine_does_not_accept_is_refused_naming_it(tmp_path):
    path = vllm_file(tmp_path, "{max_model_len: 128, max_modle_len: 256}")
    with pytest.raises(ResourceConfigError) as caught:
        load_resource_config(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: rollout.vllm_args.max_modle_len: not an argument vLLM's engine accepts")
    assert "(did you mean 'max_model_len'?)" in message and "Fix: use a field of vllm.engine.arg_utils" in message
    assert caught.value.path == "rollout.vllm_args.max_modle_len"


@pytest.mark.parametrize("key, fix", [("model", "the policy being trained"), ("dtype", "train.dtype"),
                                      ("skip_tokenizer_init", "token ids")])
def test_keys_the_rollout_engine_sets_itself_are_refused_with_the_fix(tmp_path, key, fix):
    with pytest.raises(ResourceConfigError, match=f"rollout.vllm_args.{key}: .*set by dask-rl's rollout engine") as caught:
        load_resource_config(vllm_file(tmp_path, f"{{{key}: x}}"))
    assert fix in caught.value.fix


def test_checking_the_keys_of_a_file_imports_no_vllm(tmp_path):
    """In a fresh interpreter (where vllm may well be installed): loading a file with known
    keys, and refusing a bad one, leave vllm unimported when it is absent, and a known key
    never imports it. Importing vllm costs seconds on every `dask-rl run`."""
    good, bad = vllm_file(tmp_path, "{max_model_len: 128}"), tmp_path / "bad.yaml"
    bad.write_text(CPU_VLLM_FILE.replace("{ARGS}", "{nonsense_key: 1}"))
    code = ("import sys; from resources import load_resource_config as load\n"
            f"load({str(good)!r}); print('after good', 'vllm' in sys.modules)\n"
            f"try: load({str(bad)!r})\nexcept ValueError: print('after bad', 'vllm' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert "after good False" in lines
    # Without vllm the bad key is refused from the static list alone; with vllm the installed
    # version is asked too (a newer one may accept the key).
    assert f"after bad {vllm_installed()}" in lines


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_installed(), reason="vllm is not installed here")
def test_the_static_key_list_is_the_installed_vllms():
    import vllm

    installed = vllm_keys.installed_keys()
    assert vllm.__version__ == vllm_keys.VLLM_VERSION, "update VLLM_VERSION and ENGINE_KEYS with the pin"
    missing, extra = sorted(installed - vllm_keys.ENGINE_KEYS), sorted(vllm_keys.ENGINE_KEYS - installed)
    assert not missing and not extra, (
        f"resources/vllm_keys.py is out of date for vllm {vllm.__version__}: add {missing}, remove {extra}")
    # The keys the engine sets itself are real engine keys (the refusal is about the clash).
    assert set(vllm_keys.SET_BY_DASK_RL) <= installed


@pytest.mark.parametrize("args, problem", [
    ("{gpu_memory_utilization: 1.5}", "gpu_memory_utilization: 1.5: expected a fraction of the GPU's memory in (0, 1]"),
    ("{gpu_memory_utilization: 0}", "gpu_memory_utilization: 0: expected a fraction"),
    ("{gpu_memory_utilization: .nan}", "gpu_memory_utilization: nan: expected a fraction"),
    ("{max_model_len: 0}", "max_model_len: 0: expected an integer from 1 to 2147483647 (vLLM takes it as a "
                           "32-bit integer). Fix: use e.g. 4096."),
    ("{max_num_seqs: 2.5}", "max_num_seqs: 2.5: expected an integer from 1 to 2147483647"),
    ("{max_num_batched_tokens: 4294967296}", "max_num_batched_tokens: 4294967296: expected an integer from 1 to"),
    ("{cpu_offload_gb: .inf}", "cpu_offload_gb: inf: not a finite number. Fix: use a finite number, or remove the key"),
])
def test_engine_numbers_out_of_range_are_refused_when_the_file_loads(tmp_path, args, problem):
    with pytest.raises(ResourceConfigError) as caught:
        load_resource_config(vllm_file(tmp_path, args))
    assert f"rollout.vllm_args.{problem}" in str(caught.value)
