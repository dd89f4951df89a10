"""The `train:` section: strict typed TrainConfig, and whole run files such as the quickstart."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
from conftest import python_peak

from pipeline.config import TrainConfig, TrainConfigError, make_train_config
from pipeline.run_file import load_run_file
from resources.config import ResourceConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RESOURCES = """\
actor:   {device_type: cpu, workers: 1}
reward:  {device_type: cpu, workers: 1}
rollout: {device_type: cpu, workers: 1}
"""


def test_known_keys_are_checked_and_applied_over_the_defaults():
    config = make_train_config({"steps": 3, "actor_lr": 1, "whiten_advantages": False, "algorithm": "grpo",
                                "samples_per_prompt": 4})
    assert (config.steps, config.samples_per_prompt, config.whiten_advantages) == (3, 4, False)
    assert config.actor_lr == 1.0 and isinstance(config.actor_lr, float)  # an int is a fine float
    assert config.critic_lr == TrainConfig().critic_lr  # untouched keys keep their defaults
    assert config.samples_per_step == 16 * 4  # default prompts_per_step (16) x samples_per_prompt (4)


def test_an_unknown_key_is_rejected_with_a_did_you_mean():
    with pytest.raises(TrainConfigError) as error:
        make_train_config({"stpes": 10})
    message = str(error.value)
    assert "unknown training key 'stpes'" in message
    assert "Did you mean 'steps'? Fix: use that key." in message
    with pytest.raises(TrainConfigError, match=r"unknown training key 'zzzzzz'. Fix: use one of algorithm, steps, "):
        make_train_config({"zzzzzz": 1})  # nothing close: the keys themselves, cut short


def test_a_run_input_misspelt_in_the_train_section_suggests_the_input():
    with pytest.raises(TrainConfigError, match="Did you mean 'prompts'"):
        make_train_config({"promts": "p.jsonl"})


@pytest.mark.parametrize("key, value, expected", [
    ("steps", "ten", "train.steps: 'ten' should be an int"),
    ("steps", True, "train.steps: True should be an int"),   # YAML `true` is not a count
    ("steps", 2.5, "train.steps: 2.5 should be an int"),
    ("actor_lr", "1e-3", "train.actor_lr: '1e-3' should be a float"),  # YAML reads 1e-3 as a string
    ("kl_coef", False, "train.kl_coef: False should be a float"),
    ("whiten_advantages", 1, "train.whiten_advantages: 1 should be a bool"),
    ("prompt_column", 3, "train.prompt_column: 3 should be a str"),
])
def test_wrong_types_name_the_key_and_an_example(key, value, expected):
    with pytest.raises(TrainConfigError) as error:
        make_train_config({key: value}, source="run.yaml: train")
    message = str(error.value)
    assert message.startswith("run.yaml: train: ") and expected in message
    assert f"Fix: write e.g. {key}: {getattr(TrainConfig(), key)!r}" in message


def test_grpo_needs_at_least_two_samples_per_prompt():
    with pytest.raises(TrainConfigError) as error:
        make_train_config({"algorithm": "grpo", "samples_per_prompt": 1}, source="run.yaml: train")
    message = str(error.value)
    assert message.startswith("run.yaml: train: train.samples_per_prompt: 1 is not allowed")
    assert "use 2 or more" in message
    assert make_train_config({"algorithm": "ppo", "samples_per_prompt": 1}).samples_per_prompt == 1


@pytest.mark.parametrize("values, key", [
    ({"algorithm": "dpo"}, "algorithm"), ({"steps": 0}, "steps"), ({"max_staleness": -1}, "max_staleness"),
    ({"dtype": "fp8"}, "dtype"), ({"micro_batch_size": 0}, "micro_batch_size"),
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": 0}, "temperature"),
    ({"temperature": -1.0}, "temperature"), ({"actor_lr": 0}, "actor_lr"), ({"critic_lr": -1e-5}, "critic_lr"),
    ({"kl_coef": -0.01}, "kl_coef"), ({"clip_ratio": 0}, "clip_ratio"), ({"value_clip": -0.2}, "value_clip"),
    ({"gamma": 1.01}, "gamma"), ({"gamma": -0.1}, "gamma"), ({"lam": 1.5}, "lam"), ({"lam": -0.5}, "lam"),
    ({"ppo_epochs": 0}, "ppo_epochs"), ({"mini_batches": 0}, "mini_batches"), ({"is_cap": 0.5}, "is_cap"),
    ({"grad_clip": 0}, "grad_clip"), ({"seed": -1}, "seed"), ({"seed": 2**32}, "seed"),
    ({"prompt_column": ""}, "prompt_column"), ({"reward_errors": "ignore"}, "reward_errors"),
    ({"long_prompts": "cut"}, "long_prompts"), ({"weight_sync": "nccl"}, "weight_sync"),
    ({"top_k": -1}, "top_k"), ({"top_p": 0}, "top_p"), ({"top_p": 1.01}, "top_p"), ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.0}, "min_p"),
    # 2 prompts x 1 sample = 2 rows: a third mini-batch would have none.
    ({"prompts_per_step": 2, "mini_batches": 3}, "mini_batches"),
])
def test_out_of_range_values_are_rejected(values, key):
    with pytest.raises(TrainConfigError, match=f"train.{key}: .* is not allowed. Fix: "):
        make_train_config(values)


@pytest.mark.parametrize("values", [
    {"gamma": 0}, {"gamma": 1}, {"lam": 0}, {"lam": 1}, {"kl_coef": 0}, {"is_cap": 1}, {"seed": 0},
    {"seed": 2**32 - 1}, {"prompts_per_step": 2, "samples_per_prompt": 2, "mini_batches": 4},
    {"temperature": 1e-3}, {"clip_ratio": 1e-9}, {"top_k": 0}, {"top_k": 1}, {"top_p": 1.0}, {"top_p": 1e-6},
    {"min_p": 0.0}, {"min_p": 0.99},
])
def test_values_on_the_edge_of_each_range_are_accepted(values):
    config = make_train_config(values)
    assert all(getattr(config, key) == value for key, value in values.items())


def test_a_range_error_names_the_key_the_value_and_the_fix():
    with pytest.raises(TrainConfigError) as error:
        make_train_config({"lam": 1.5}, source="run.yaml: train")
    assert str(error.value) == ("run.yaml: train: train.lam: 1.5 is not allowed. "
                                "Fix: use a GAE lambda from 0 to 1, e.g. 0.95.")
    with pytest.raises(TrainConfigError) as error:
        make_train_config({"is_cap": 0.5})
    assert str(error.value).endswith("train.is_cap: 0.5 is not allowed. Fix: use 1 or more, e.g. 2.0.")
    with pytest.raises(TrainConfigError) as error:
        make_train_config({"prompts_per_step": 2, "mini_batches": 3})
    assert "train.mini_batches: 3 is not allowed. Fix: use 1 to 2 (prompts_per_step" in str(error.value)


FLOAT_KEYS = [f.name for f in fields(TrainConfig) if f.type == "float"]


@pytest.mark.parametrize("value, shown", [(float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf")])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_must_be_finite(key, value, shown):
    with pytest.raises(TrainConfigError) as error:
        make_train_config({key: value})
    default = getattr(TrainConfig(), key)
    assert str(error.value).endswith(f"train.{key}: {shown} is not allowed. "
                                     f"Fix: use a finite number, e.g. {default!r}.")


def test_float_keys_cover_the_numeric_hyperparameters():
    assert set(FLOAT_KEYS) == {"temperature", "actor_lr", "critic_lr", "kl_coef", "clip_ratio", "value_clip",
                               "gamma", "lam", "is_cap", "grad_clip", "top_p", "min_p", "reward_timeout",
                               "eval_temperature", "eval_correct_reward",
                               "entropy_coef", "lr_min_ratio", "weight_decay"}  # the algorithm options' block


def test_stop_strings_are_a_strict_list_of_non_empty_strings(tmp_path):
    assert TrainConfig().stop == ()
    assert make_train_config({"stop": ["</answer>", "\n\n"]}).stop == ("</answer>", "\n\n")
    assert TrainConfig(stop=["x"]).stop == ("x",)  # a list given in Python becomes a tuple too
    fix = "Fix: write e.g. stop: ['</answer>'] (a list of strings), or leave it out."
    with pytest.raises(TrainConfigError) as error:
        make_train_config({"stop": "</answer>"}, source="run.yaml: train")
    assert str(error.value) == f"run.yaml: train: train.stop: '</answer>' should be a list of strings. {fix}"
    for bad, shown in (([""], "''"), (["a", 3], "3"), ([None], "None")):
        with pytest.raises(TrainConfigError, match=f"train.stop: {shown} in .* is not allowed: every entry must be a "
                                                   f"non-empty string"):
            make_train_config({"stop": bad})
    with pytest.raises(TrainConfigError, match="train.stop: '' in"):
        TrainConfig(stop=("",))
    # From a run file: a YAML list.
    path = tmp_path / "run.yaml"
    path.write_text(RESOURCES + "train:\n  stop: ['</answer>', 'Question:']\n  top_p: 0.9\n  top_k: 40\n")
    train = load_run_file(path).train
    assert (train.stop, train.top_p, train.top_k, train.min_p) == (("</answer>", "Question:"), 0.9, 40, 0.0)


def test_an_int_too_large_for_a_float_is_an_error_not_an_overflow():
    with pytest.raises(TrainConfigError, match=r"train.actor_lr: 1000.*\.\.\. is too large for a float"):
        make_train_config({"actor_lr": 10**400})


def test_a_config_built_in_python_is_checked_too():
    with pytest.raises(TrainConfigError, match=r"train.steps: '5' is not allowed. Fix: use an integer, e.g. 20."):
        TrainConfig(steps="5")
    with pytest.raises(TrainConfigError, match="train.gamma: nan is not allowed"):
        TrainConfig(gamma=float("nan"))


def test_a_long_value_is_echoed_cut_short():
    with pytest.raises(TrainConfigError) as error:
        make_train_config({"algorithm": "x" * 100_000})
    message = str(error.value)
    assert "train.algorithm: 'xxxx" in message
    assert "... is not allowed. Fix: use ppo or grpo." in message and len(message) < 200
    with pytest.raises(TrainConfigError) as error:
        make_train_config({"k" * 100_000: 1})
    # The message lists the known keys; the key echoed is cut short whatever their number.
    listed = len(", ".join(f.name for f in fields(TrainConfig)))
    assert "unknown training key 'kkk" in str(error.value) and len(str(error.value)) < 250 + listed


def test_the_quickstart_run_file():
    run = load_run_file(EXAMPLES / "quickstart.yaml")
    assert set(run.resources.roles) == {"actor", "critic", "reference", "reward", "rollout"}
    for role, spec in run.resources.roles.items():
        assert (spec.device_type, spec.device_ids, spec.workers) == ("cpu", (), 1), role
    assert run.resources.role("rollout").strategy == "hf"
    assert run.resources.timeout_seconds == 180.0
    assert run.train == TrainConfig(algorithm="ppo", steps=40, prompts_per_step=32, max_new_tokens=12,
                                    actor_lr=0.001, critic_lr=0.001, kl_coef=0.01, ppo_epochs=2,
                                    micro_batch_size=32, seed=0)
    assert run.inputs["actor_model"] == "tiny"
    assert run.inputs["reward_function"] == "pipeline.rewards:digit_fraction"
    # `prompts` is relative to the run file, not to the directory the command ran in.
    assert Path(run.inputs["prompts"]) == (EXAMPLES / "quickstart_prompts.jsonl").resolve()
    assert Path(run.inputs["prompts"]).is_absolute()


def test_the_hosted_example_places_the_rollout_in_the_actors_process():
    run = load_run_file(EXAMPLES / "hosted_cpu.yaml")
    rollout = run.resources.role("rollout")
    assert (rollout.hosted_by, rollout.strategy, rollout.device_type, rollout.workers) == ("actor", "hf", "cpu", 1)
    assert run.resources.hosted_roles("actor") == ("rollout",)
    assert (run.train.algorithm, run.train.kl_coef) == ("grpo", 0.0)


def test_the_hosted_gpu_example_caps_the_one_process_that_generates_and_trains():
    """Its resources as an 80 GiB GPU's machine reads them (this one has no GPU)."""
    from resources.devices import GpuInfo
    from resources.plan import plan_workers
    from resources.validate import parse_resource_config
    from resources.yaml_reader import read_yaml

    gpu = GpuInfo(index=0, name="H100", total_bytes=80 << 30, free_bytes=80 << 30, used_bytes=0,
                  utilization_pct=0, process_count=0)
    config = parse_resource_config(read_yaml(EXAMPLES / "hosted_gpu.yaml", "hosted_gpu.yaml"), gpus=[gpu])
    rollout, actor = config.role("rollout"), config.role("actor")
    assert (rollout.hosted_by, rollout.strategy, rollout.device_type) == ("actor", "cuda_graph", "cuda")
    assert (list(actor.device_ids), actor.max_gpu_memory_gib) == ([0], 4)
    [process] = [worker for worker in plan_workers(config) if worker.role == "actor"]
    assert process.resources == {"actor": 1, "rollout": 1} and process.env_dict["CUDA_VISIBLE_DEVICES"] == "0"


def test_prompts_resolve_relative_to_the_run_file_from_any_directory(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "p.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "run.yaml").write_text(RESOURCES + "train: {prompts: data/p.jsonl, steps: 2}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    run = load_run_file("../run.yaml")
    assert run.inputs["prompts"] == str((tmp_path / "data" / "p.jsonl").resolve())
    assert run.train.steps == 2


def test_a_typo_in_the_train_section_fails_naming_the_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(RESOURCES + "train:\n  steps: 5\n  kl_coeff: 0.1\n")
    with pytest.raises(TrainConfigError) as error:
        load_run_file(path)
    message = str(error.value)
    assert str(path) in message
    assert "'kl_coeff'" in message and "Did you mean 'kl_coef'?" in message


def test_a_bad_value_in_the_train_section_names_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(RESOURCES + "train: {algorithm: grpo, samples_per_prompt: 1}\n")
    with pytest.raises(TrainConfigError, match=f"^{path}: train: train.samples_per_prompt: 1 is not allowed"):
        load_run_file(path)


def test_a_train_section_that_is_not_a_mapping_is_an_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(RESOURCES + "train: [steps, 5]\n")
    with pytest.raises(TrainConfigError, match="train: .* is not a mapping"):
        load_run_file(path)


def test_a_key_written_twice_is_an_error_not_last_wins(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(RESOURCES + "train:\n  steps: 5\n  steps: 50\n")
    with pytest.raises(ResourceConfigError, match="duplicate key 'steps'"):
        load_run_file(path)


def test_a_bad_resource_key_in_a_run_file_fails_before_the_train_section(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(RESOURCES.replace("reward:  {device_type", "reward:  {device_typ") + "train: {stepz: 1}\n")
    with pytest.raises(ResourceConfigError, match=r"reward\.device_typ: unknown key"):
        load_run_file(path)


def test_a_missing_run_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_run_file(tmp_path / "nope.yaml")


def test_a_hostile_run_file_is_refused_fast(tmp_path):
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]  # 9**10 values
    path = tmp_path / "run.yaml"
    path.write_text(RESOURCES + "train:\n  steps: 5\n" + "\n".join(f"  {line}" for line in lines) + "\n")
    with python_peak(16 << 20), pytest.raises(ResourceConfigError) as error:  # 9**10 values never built
        load_run_file(path)
    message = str(error.value)
    assert message.startswith(f"{path}: line ") and "anchors and aliases expand to more than" in message
    assert "Fix: write the values out" in message


def test_a_run_file_that_is_not_utf8_names_the_file_and_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(RESOURCES.encode() + b"train: {prompt_column: \xff}\n")
    with pytest.raises(ResourceConfigError, match=f"^{path}: line 4: not UTF-8 text .* Fix: save the file as UTF-8"):
        load_run_file(path)


def test_a_run_file_with_nan_names_the_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(RESOURCES + "train: {steps: 2, actor_lr: .nan}\n")
    with pytest.raises(TrainConfigError, match=rf"^{path}: train: train.actor_lr: nan is not allowed. "
                                               r"Fix: use a finite number, e.g. 0.0001.$"):
        load_run_file(path)


def test_a_prompt_path_too_long_for_the_os_is_kept_as_written(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(RESOURCES + f"train: {{steps: 2, prompts: {'p' * 5000}.jsonl}}\n")
    assert load_run_file(path).inputs["prompts"] == "p" * 5000 + ".jsonl"


@pytest.mark.parametrize("values, message", [
    ({"columns": {"answer": 3}}, "train.columns: {'answer': 3} should map names to names. Fix: write e.g. "
                                 "columns: {answer: solution}."),
    ({"reward_weights": [1.0, "x"]}, "train.reward_weights: [1.0, 'x'] should be a list of finite numbers."),
    ({"reward_weights": [1.0, float("nan")]}, "train.reward_weights: [1.0, nan] should be a list of finite numbers."),
    ({"chat_template": "yes"}, "train.chat_template: 'yes' should be a bool. Fix: write e.g. chat_template: true."),
    ({"reward_timeout": -1.0}, "train.reward_timeout: -1.0 is not allowed. Fix: use 0 (no bound) or seconds up to "
                               "86400, e.g. 60."),
    ({"eval_samples_per_prompt": 0}, "train.eval_samples_per_prompt: 0 is not allowed. Fix: use 1 or more"),
    ({"eval_temperature": -0.5}, "train.eval_temperature: -0.5 is not allowed. Fix: use 0 (greedy)"),
])
def test_real_task_keys_are_checked_with_the_key_and_the_fix(values, message):
    with pytest.raises(TrainConfigError) as error:
        make_train_config(values)
    assert message in str(error.value)


def test_real_task_keys_take_their_values():
    tc = make_train_config({"columns": {"answer": "solution"}, "reward_weights": [1, 0.5], "chat_template": True,
                            "system_prompt": "be brief", "eval_every_n_steps": 5})
    assert (tc.columns, tc.reward_weights, tc.chat_template, tc.system_prompt) == (
        {"answer": "solution"}, [1.0, 0.5], True, "be brief")
    assert TrainConfig().chat_template is None and TrainConfig().reward_timeout == 60.0
