"""The bad-input drill: run the tests that feed dask-rl bad input and count what was refused.

Each selected test case feeds one bad input (a hostile file, an out-of-range setting, a bad
prompt line, a prompt too long for the model, a bad reward, a scheduler address where
nothing listens) and checks the refusal: its message, its one line, its time. This script
runs them through pytest and prints, per class of input, the cases, how many held and the
slowest case's seconds (pytest's call time: the test's own checks included, fixtures not).

    PYTHONPATH=$PWD python benchmarks/bad_input_drill.py

Run it from the repository root; it takes a few minutes on two cores (the real-loop cases
start a Dask cluster, the CLI cases a process each).
"""

from __future__ import annotations

import sys
from collections import defaultdict

import pytest

# class of input -> the tests (pytest node ids, parametrized cases included) that feed it
DRILL = {
    "hostile resource files (bombs, nesting, size, encoding, tags)":
        ["tests/resources/test_yaml_reader.py::test_a_hostile_file_is_refused_fast_in_one_line"],
    "hostile run files through `dask-rl run`": ["tests/test_cli.py::test_a_hostile_run_file_is_one_line_exit_2"],
    "bad resource values and YAML": ["tests/resources/test_config.py::test_bad_file_gets_one_clear_error",
                                     "tests/resources/test_config.py::test_bad_yaml",
                                     "tests/resources/test_vllm_args.py::"
                                     "test_engine_numbers_out_of_range_are_refused_when_the_file_loads"],
    "bad train values (range, type, nan/inf)": [
        "tests/pipeline/test_config_train.py::test_out_of_range_values_are_rejected",
        "tests/pipeline/test_config_train.py::test_wrong_types_name_the_key_and_an_example",
        "tests/pipeline/test_config_train.py::test_every_float_must_be_finite"],
    "malformed prompt files": ["tests/pipeline/test_data.py::test_a_malformed_jsonl_line_names_the_file_and_the_line"],
    "prompts longer than the context": [
        "tests/pipeline/test_data.py::test_long_prompts_are_refused_with_their_count_and_the_longest",
        "tests/pipeline/test_data.py::test_max_new_tokens_that_fill_the_context_are_refused",
        "tests/pipeline/test_data.py::test_the_trainer_refuses_long_prompts_before_starting_a_cluster",
        "tests/test_cli.py::test_a_prompt_too_long_for_the_model_exits_2_in_one_line_before_a_cluster_starts"],
    "bad rewards at the reward role": [
        "tests/pipeline/test_reward_role.py::test_a_bad_reward_marks_its_sample_with_the_texts_and_the_error",
        "tests/pipeline/test_reward_role.py::test_a_reward_model_scoring_nan_marks_its_samples"],
    "bad samples dropped or refused on the driver": [
        f"tests/pipeline/test_screening.py::test_{name}" for name in (
            "ppo_drops_only_the_bad_row_and_logs_it_with_its_texts",
            "grpo_drops_the_whole_group_of_a_bad_sample_wherever_its_rows_are",
            "non_finite_values_on_response_tokens_are_bad_and_padding_is_not",
            "raise_names_the_role_the_sample_and_the_original_error",
            "too_little_left_refuses_the_step_naming_a_sample",
            "advantages_that_overflow_drop_their_row_and_the_rest_is_built_without_it",
            "overflowing_advantages_refuse_the_step_under_raise")],
    "bad rewards in the real loop": ["tests/pipeline/test_bad_samples.py"],
    "CLI: no scheduler at the address, usage errors": [
        "tests/test_cli.py::test_a_command_pointed_at_no_scheduler_fails_at_once_in_one_line",
        "tests/test_cli.py::test_a_usage_error_is_one_line_with_the_fix"],
}


class _Tally:
    def __init__(self):
        self.cases = defaultdict(list)  # class -> [(passed, seconds)]

    def pytest_runtest_logreport(self, report):
        if report.when != "call":
            return
        for name, selections in DRILL.items():
            if any(report.nodeid.startswith(s) for s in selections):
                self.cases[name].append((report.passed, report.duration))


def main() -> int:
    tally = _Tally()
    code = pytest.main(["-q", "-p", "no:cacheprovider", *[s for group in DRILL.values() for s in group]],
                       plugins=[tally])
    print("\n| input | cases | refused as specified | slowest case (s) |\n|---|---|---|---|")
    for name in DRILL:
        results = tally.cases[name]
        print(f"| {name} | {len(results)} | {sum(p for p, _ in results)} | "
              f"{max((s for _, s in results), default=0):.2f} |")
    total = [r for results in tally.cases.values() for r in results]
    print(f"| all | {len(total)} | {sum(p for p, _ in total)} | |")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
