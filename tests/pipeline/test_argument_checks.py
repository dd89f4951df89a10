"""The Python API's and the shell's arguments go through the resource and run files' checks:
update_resource (and so `dask-rl scale`, which the trainer answers with it), adapt()'s
bounds, the trainer's keywords and the commands' numbers. A wrong type or value is one error
naming the argument, the limit and the fix, before anything changes (pure: no cluster)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import MAX_COUNT, TrainConfigError, make_train_config
from pipeline.fleet.reconcile import ResourceRequest, requested_config
from pipeline.fleet.scaling import checked_bounds
from resources import ResourceConfigError, load_resource_config
from resources.config import AdaptiveBounds
from resources.validate import MAX_ROLE_WORKERS, MAX_TIMEOUT_SECONDS

ROOT = Path(__file__).resolve().parents[2]
CONFIG = load_resource_config({"actor": {"device_type": "cpu", "workers": 2, "strategy": "ddp"},
                               "reward": {"device_type": "cpu"}, "rollout": {"device_type": "cpu"},
                               "timeout_seconds": 60})


@pytest.mark.parametrize("request_, error, message", [
    # The report: a TypeError from a comparison, naming neither the argument nor the fix.
    (ResourceRequest("reward", workers="2", strategy="data_parallel"), ResourceConfigError,
     "update_resource: reward.workers: '2': not an integer from 1 to 1024 (one process each). Fix: set workers: 1"),
    (ResourceRequest("reward", workers=2.0, strategy="data_parallel"), ResourceConfigError, "reward.workers: 2.0: not"),
    (ResourceRequest("reward", workers=True, strategy="data_parallel"), ResourceConfigError,
     "reward.workers: true: not an integer"),
    (ResourceRequest("rollout", workers=10**9, strategy="hf"), ResourceConfigError,
     f"rollout.workers: 1000000000: not an integer from 1 to {MAX_ROLE_WORKERS}"),
    (ResourceRequest("reward", workers=2, strategy=3), ResourceConfigError, "reward.strategy: 3: not a reward strategy"),
    (ResourceRequest("reward", device_type="gpu"), ValueError, "device_type='gpu'. Fix: use 'cuda' or 'cpu'"),
    (ResourceRequest(["reward"], workers=2), ValueError, "unknown component ['reward']. Fix: use one of"),
    (ResourceRequest("reward", device_ids="3"), ValueError, "give workers=N, not device_ids"),
    (ResourceRequest("reward", workers=-1), ValueError, "would remove the last reward worker"),
])
def test_update_resource_arguments_get_the_resource_files_checks(request_, error, message):
    with pytest.raises(error) as caught:
        requested_config(CONFIG, request_)
    assert type(caught.value) is error and message in str(caught.value)


def test_a_good_request_is_the_file_it_describes_and_keeps_the_files_name():
    changed = requested_config(CONFIG, ResourceRequest("reward", workers=3, strategy="data_parallel"))
    assert (changed.role("reward").workers, changed.role("reward").strategy) == (3, "data_parallel")
    assert changed.role("actor") == CONFIG.role("actor") and changed.source == CONFIG.source
    # The critic, placed with the actor, given a count of its own.
    critic = requested_config(CONFIG, ResourceRequest("critic", workers=1)).role("critic")
    assert (critic.workers, critic.placed_with) == (1, None)


def test_a_rollout_keeps_its_engines_options_until_it_changes_engine():
    tuned = load_resource_config({**CONFIG.to_dict(), "rollout": {
        "device_type": "cpu", "strategy": "cuda_graph", "cuda_graph_args": {"decode_attention": "sdpa"}}})
    grown = requested_config(tuned, ResourceRequest("rollout", workers=2)).role("rollout")
    assert (grown.workers, grown.engine_kwargs) == (2, {"decode_attention": "sdpa"})
    other = requested_config(tuned, ResourceRequest("rollout", workers=2, strategy="hf")).role("rollout")
    assert (other.strategy, other.engine_kwargs) == ("hf", {})
    # vLLM's arguments too: once they made the change fail ("vllm_args only apply to strategy vllm")
    on_vllm = load_resource_config({**CONFIG.to_dict(), "rollout": {
        "device_type": "cpu", "strategy": "vllm", "vllm_args": {"max_model_len": 128}}})
    assert requested_config(on_vllm, ResourceRequest("rollout", workers=1, strategy="hf")).role("rollout").vllm_args == ()


@pytest.mark.parametrize("bounds, message", [
    ({"rollout": (3, 1)}, "adapt(bounds=...): adaptive.rollout: {min: 3, max: 1}: need integers with 1 <= min <= max"),
    ({"rollout": ("1", 3)}, "adaptive.rollout: {min: '1', max: 3}: need integers"),
    ({"rollout": (1, 10**6)}, f"need integers with 1 <= min <= max <= {MAX_ROLE_WORKERS}"),
    ({"rollout": 3}, "adaptive.rollout: 3: bounds need exactly min and max"),
    ({"rolout": (1, 2)}, "adaptive.rolout: not a role (did you mean 'rollout'?)"),
])
def test_adapt_bounds_get_the_resource_files_checks(bounds, message):
    with pytest.raises(ResourceConfigError) as caught:
        checked_bounds(CONFIG, bounds)
    assert message in str(caught.value)


def test_adapt_bounds_as_tuples_or_bounds_are_the_files_bounds():
    assert checked_bounds(CONFIG, {"rollout": (1, 3), "reward": AdaptiveBounds(1, 2)}) == {
        "rollout": AdaptiveBounds(1, 3), "reward": AdaptiveBounds(1, 2)}
    with pytest.raises(ValueError, match="bounds=5. Fix: pass a mapping"):
        checked_bounds(CONFIG, 5)


def test_timeout_seconds_is_bounded_by_what_its_waits_take():
    import datetime
    import threading

    # The limit itself is accepted and fits every wait it feeds.
    limit = load_resource_config({**CONFIG.to_dict(), "timeout_seconds": MAX_TIMEOUT_SECONDS}).timeout_seconds
    datetime.timedelta(seconds=limit)
    assert limit < threading.TIMEOUT_MAX
    with pytest.raises(ResourceConfigError, match=f"at most {MAX_TIMEOUT_SECONDS}"):
        load_resource_config({**CONFIG.to_dict(), "timeout_seconds": 1e14})


@pytest.mark.parametrize("values, message", [
    ({"steps": 10**12}, f"train.steps: 1000000000000 is not allowed. Fix: use at most {MAX_COUNT}"),
    ({"max_new_tokens": 2**40}, "train.max_new_tokens: 1099511627776 is not allowed"),
    ({"checkpoint": {"keep_last": 10**10}}, f"train.checkpoint.keep_last: 10000000000 is not allowed. Fix: keep 1 or "
                                            f"more checkpoints, e.g. 2 (at most {MAX_COUNT})"),
])
def test_train_counts_are_bounded(values, message):
    with pytest.raises(TrainConfigError) as caught:
        make_train_config(values)
    assert message in str(caught.value)
    assert make_train_config({"seed": 2**32 - 1}).seed == 2**32 - 1  # the seed keeps its own range


@pytest.mark.parametrize("args, message", [
    (["scale", "tcp://127.0.0.1:1", "--role", "reward", "--timeout", "1e14"],
     "argument --timeout: 1e14 is not a number of seconds from 0.001 to 10000000"),
    (["scale", "tcp://127.0.0.1:1", "--role", "reward", "--workers", "two"], "argument --workers: 'two' is not a number"),
    (["scale", "tcp://127.0.0.1:1", "--role", "reward", "--workers", "5000"],
     "argument --workers: 5000 is not a number of workers from 0 to 1024"),
    (["worker", "tcp://127.0.0.1:1", "--role", "reward", "--workers", "0"], "--workers: 0 is not a number of workers"),
    (["worker", "tcp://127.0.0.1:1", "--role", "reward", "--timeout", "nan"], "--timeout: nan is not a number of"),
    (["scheduler", "--port", "70000"], "argument --port: 70000 is not a TCP port from 0 to 65535"),
])
def test_command_numbers_are_bounded_with_the_limit_in_one_line(args, message):
    result = subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, cwd=ROOT,
                            timeout=120)
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.splitlines()) == 1


def test_a_change_says_how_many_workers_the_role_has_in_all_and_how_many_the_trainer_manages():
    from pipeline.fleet.reconcile import ResourceChange

    connected = ResourceChange("rollout", ("rollout-1", "rollout-2"), (), ("rollout-host-0", "rollout-1", "rollout-2"),
                               (), "hf", 12.0, managed=("rollout-1", "rollout-2"))
    assert str(connected) == ("rollout: +['rollout-1', 'rollout-2'] -[] -> 2 CPU workers managed by this trainer, 3 in "
                              "all (1 joined from elsewhere, not counted by workers=N), strategy hf (12.0s)")
    local = ResourceChange("reward", ("reward-1",), (), ("reward-0", "reward-1"), (), "data_parallel", 3.0,
                           managed=("reward-0", "reward-1"))
    assert str(local) == "reward: +['reward-1'] -[] -> 2 CPU workers, strategy data_parallel (3.0s)"
