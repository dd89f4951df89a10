"""What a run keeps under its output directory, as it happens:

    metrics.jsonl       one line per step, appended and flushed when the step ends
    samples.jsonl       a few prompt / response / reward rows per step (train.log_samples)
    tensorboard/        TensorBoard event files (when tensorboard is installed)
    checkpoints/        every train.checkpoint.every_n_steps steps, and at a requested stop
    actor/, critic/     the trained models in Hugging Face format with the tokenizer (at close)

and Weights & Biases when train.wandb_project names a project. A resumed run appends to the
same files, dropping the lines of steps after the checkpoint it resumed from.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from pipeline import checkpoint
from pipeline.config import TrainConfig
from pipeline.events import decode_samples
from pipeline.fleet import states
from pipeline.metrics import StepRecord
from pipeline.records import CarriedRow

logger = logging.getLogger("dask_rl")


class RunOutputs:
    def __init__(self, output_dir: Path, train_config: TrainConfig, tokenizer, roles: tuple[str, ...]):
        self.dir, self.train_config, self.tokenizer, self.roles = Path(output_dir), train_config, tokenizer, roles
        self.dir.mkdir(parents=True, exist_ok=True)
        self.checkpoints = self.dir / "checkpoints"
        self.last_checkpoint: Path | None = None
        self.saved_version = 0   # the policy version of the models under self.dir
        self._wandb = _start_wandb(train_config) if train_config.wandb_project else None
        self._tensorboard = None

    # -- per step ----------------------------------------------------------------------------
    def samples(self, rollout, scores, row_of=None) -> list[dict[str, Any]]:
        """`log_samples` rows of a step as text, with their rewards (spread over the batch) and,
        with `row_of` (group id -> PromptRow), their rows' fields."""
        return decode_samples(self.tokenizer, rollout, scores.values, n=self.train_config.log_samples,
                              components=scores.components, row_of=row_of)

    def log_evaluation(self, figures: dict[str, float]) -> None:
        """An evaluation that finished after the last step: a line of its own, at the step it evaluated."""
        step = int(figures["eval/step"])
        _append(self.dir / "metrics.jsonl", [{"step": step, **figures}])
        writer = self._writer(step)
        if writer is not None:
            for key, value in figures.items():
                writer.add_scalar(key, value, step)
            writer.flush()
        if self._wandb is not None:
            self._wandb.log(figures, step=step)

    def log(self, record: StepRecord) -> None:
        figures = record.figures()
        _append(self.dir / "metrics.jsonl", [figures])
        _append(self.dir / "samples.jsonl", [{"step": record.step, **row} for row in record.samples])
        writer = self._writer(record.step)
        if writer is not None:
            for key, value in figures.items():
                if key != "step":
                    writer.add_scalar(key, value, record.step)
            writer.flush()
        if self._wandb is not None:
            self._wandb.log(figures, step=record.step)

    def _writer(self, first_step: int):
        if self._tensorboard is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional: metrics.jsonl has every figure anyway
                self._tensorboard = False
                return None
            # purge_step: a resumed run's events replace those logged after its checkpoint.
            self._tensorboard = SummaryWriter(str(self.dir / "tensorboard"), purge_step=first_step)
        return self._tensorboard or None

    # -- checkpoints ---------------------------------------------------------------------------
    def due(self, steps_done: int, stopping: bool = False) -> bool:
        """Whether a checkpoint is written now: every `every_n_steps`, and at a requested stop."""
        every = self.train_config.checkpoint.every_n_steps
        return every > 0 and (stopping or steps_done % every == 0)

    def save_checkpoint(self, fleet, batches, steps_done: int) -> Path:
        """Write a checkpoint of the run after `steps_done` steps (see pipeline/checkpoint.py)."""
        index, position = batches.resume_point()
        state = {"step": steps_done, "policy_version": fleet.version, "next_batch": index,
                 "prompt_position": position,
                 # Partial rollouts: the rows the next batch continues (token ids and logprobs).
                 "carried_rows": [dataclasses.asdict(row) for row in batches.resume_carried()]}
        staging = checkpoint.staging_dir(self.checkpoints, steps_done)
        states.export_states(fleet, self.roles, staging)
        self.last_checkpoint = checkpoint.commit(staging, {**state, "algorithm": self.train_config.algorithm,
                                                           "roles": list(self.roles)})
        checkpoint.prune(self.checkpoints, self.train_config.checkpoint.keep_last)
        return self.last_checkpoint

    def find_checkpoint(self, target: str | Path | bool | None) -> tuple[Path, dict[str, Any]] | None:
        """The newest valid checkpoint under `target` (or `target` itself; True: this output
        directory), checked to fit this run; None without a target. Called before any
        worker starts, so that a bad one fails first."""
        if not target:
            return None
        path, state = checkpoint.find(self.dir if target is True else target)
        if state.get("algorithm") != self.train_config.algorithm or set(state.get("roles", ())) != set(self.roles):
            raise checkpoint.CheckpointError(
                f"checkpoint {path} is of a {state.get('algorithm')} run with roles {state.get('roles')}; this run "
                f"is {self.train_config.algorithm} with {list(self.roles)}. Fix: resume with the same algorithm "
                f"and kl_coef (0 runs no reference role).")
        return path, state

    def restore(self, fleet, batches, found: tuple[Path, dict[str, Any]] | None) -> int:
        """Start the run from the checkpoint `found`; returns the steps done before it (0
        without one). The logs lose their lines of steps after the checkpoint's."""
        if found is None:
            return 0
        path, state = found
        states.restore_states(fleet, self.roles, path, state["policy_version"], batches.published_versions)
        checkpoint.restore_rng(path)
        batches.resume_from(state["next_batch"], state["prompt_position"])
        batches.restore_carried(tuple(CarriedRow(**row) for row in state.get("carried_rows", ())))
        for name in ("metrics.jsonl", "samples.jsonl"):
            _drop_from(self.dir / name, state["step"])
        logger.warning("dask-rl: resumed from %s (step %d, policy version %d)", path, state["step"],
                       state["policy_version"])
        self.saved_version = state["policy_version"]
        return state["step"]

    # -- the model -------------------------------------------------------------------------------
    def save_models(self, fleet, directory: str | Path | None = None) -> dict[str, Path]:
        """The actor (and critic) in Hugging Face format, each with the tokenizer beside it."""
        saved = states.save_models(fleet, self.roles, Path(directory or self.dir))
        if directory is None:
            self.saved_version = fleet.version
        for path in saved.values():
            self.tokenizer.save_pretrained(path)
        return saved

    def close(self, fleet) -> None:
        """Save the models if trained since they were last saved here; close the loggers.
        Without a scheduler nothing can be saved (the models live on the workers): that is
        logged, with the newest checkpoint to resume from, and closing goes on."""
        try:
            lost = fleet.scheduler_lost("saving the models at close")
            if lost is not None and fleet.version != self.saved_version:
                logger.warning("dask-rl: the models of policy version %d were not saved: %s Newest checkpoint: %s",
                               fleet.version, lost, self.last_checkpoint or "none (train.checkpoint is off)")
            elif fleet.version != self.saved_version:
                self.save_models(fleet)
        finally:
            if self._tensorboard:
                self._tensorboard.close()
            if self._wandb is not None:
                self._wandb.finish()


def _start_wandb(tc: TrainConfig):
    try:
        import wandb
    except ImportError:
        raise ImportError(f"train.wandb_project: {tc.wandb_project!r} needs wandb. Fix: pip install wandb, "
                          f"or leave wandb_project out.") from None
    return wandb.init(project=tc.wandb_project, config={k: v for k, v in vars(tc).items() if k != "checkpoint"})


def _append(path: Path, rows: list[dict]) -> None:
    if rows:
        with path.open("a") as file:
            file.writelines(json.dumps(row) + "\n" for row in rows)
            file.flush()


def _drop_from(path: Path, step: int) -> None:
    """Keep only the lines of steps before `step` (a resumed run writes the later ones anew)."""
    if path.is_file():
        path.write_text("".join(line for line in path.read_text().splitlines(keepends=True)
                                if _step_of(line) < step))


def _step_of(line: str) -> float:
    try:
        return json.loads(line).get("step", math.inf)
    except json.JSONDecodeError:  # a line cut short by a crash: dropped with the later ones
        return math.inf
