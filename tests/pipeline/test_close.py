"""Closing a run: quiet on a healthy cluster (no error logged, no traceback printed, with the
dashboard's Bokeh server stopping with the scheduler), and the installed Bokeh inside
pyproject's bound that keeps it so."""

from __future__ import annotations

import logging
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from pipeline.rewards import digit_fraction
from pipeline.trainer import HybridTrainer
from resources import load_resource_config

ROOT = Path(__file__).resolve().parents[2]
# The smallest run that still starts its own scheduler, dashboard and three worker processes.
LAYOUT = {"actor": {"device_type": "cpu", "workers": 1}, "reward": {"device_type": "cpu", "workers": 1},
          "rollout": {"device_type": "cpu", "workers": 1}, "timeout_seconds": 120}
GRPO = dict(algorithm="grpo", kl_coef=0.0, samples_per_prompt=2, prompts_per_step=4, max_new_tokens=4,
            micro_batch_size=8, show_progress=False)


class Errors(logging.Handler):
    """Every record at ERROR or above, or carrying a traceback, from any logger of this process
    (the scheduler and its Bokeh server run here: distributed's `terminate` handler logs here)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        if record.levelno >= logging.ERROR or record.exc_info:
            self.lines.append(f"{record.name} {record.levelname}: {record.getMessage()}")


def test_the_installed_bokeh_is_inside_the_bound_pyproject_sets():
    """dask/distributed#9350: Bokeh 3.10 makes every close log a RuntimeError; the bound keeps it out."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    bokeh = next(Requirement(d) for d in dependencies if re.match(r"bokeh\b", d))
    assert not bokeh.specifier.contains("3.10.0")
    assert bokeh.specifier.contains(version("bokeh")), f"bokeh {version('bokeh')} is installed, pyproject asks {bokeh}"


@pytest.mark.slow  # its own scheduler, dashboard and three workers (~30 s); the bound above guards the default run
def test_closing_a_run_that_started_its_cluster_logs_no_error_and_prints_no_traceback(tiny_model, prompts, tmp_path,
                                                                                     capfd):
    """A real run: its own scheduler with the dashboard, three workers, one step, the models saved
    at close, then the cluster closed. Bokeh 3.10 fails this with distributed 2026.7.1."""
    errors = Errors()
    root = logging.getLogger()
    root.addHandler(errors)
    try:
        trainer = HybridTrainer(tiny_model, digit_fraction, load_resource_config(LAYOUT), prompts=prompts, steps=1,
                                dashboard_address=":0", output_dir=str(tmp_path), **GRPO)
        with trainer:
            trainer.train()
            # What an error about workers that did not come back would say of their Nannies.
            assert trainer.fleet.cluster.nanny_states("actor")["actor-0"].startswith("Nanny running, worker pid ")
            capfd.readouterr()  # what the start printed is not the close's
        assert trainer.fleet.client.status == "closed"
    finally:
        root.removeHandler(errors)
    printed = capfd.readouterr()
    assert (tmp_path / "actor" / "config.json").is_file()  # the close did its work
    assert errors.lines == []
    # The worker processes write to the same stderr: a traceback of theirs shows here. One
    # race is Dask's own, not the close's: a worker's heartbeat that was already on its way
    # when the scheduler closed logs "Failed to communicate with scheduler during heartbeat"
    # (seen once on a loaded machine); the bokeh failure this test is for is not that.
    err = _without_heartbeat_race(printed.err)
    assert "Traceback" not in err + printed.out and " ERROR " not in err, printed.err[-3000:]


def _without_heartbeat_race(err: str) -> str:
    """stderr less a worker's log record of a heartbeat that met the closing scheduler (the
    record and its traceback run up to the next log line)."""
    kept, skipping = [], False
    for line in err.splitlines():
        if " - distributed." in line and " - " in line:   # a new log record starts
            skipping = "Failed to communicate with scheduler during heartbeat" in line
        if not skipping:
            kept.append(line)
    return "\n".join(kept)
