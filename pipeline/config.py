"""The training section of a run file (`train:`) and of the trainer's arguments.

This module reads `train:` into a strict, typed `TrainConfig` (unknown keys, wrong types,
non-finite and out-of-range numbers are errors that name the key, the value and the fix);
pipeline/run_file.py reads the run file as a whole (resources, `train:` and the run's inputs).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

from resources.config import shorten


class TrainConfigError(ValueError):
    """A bad `train:` key or trainer argument; the message names the key and the fix."""


# Counts become loop bounds and tensor sizes, and a product of two of them (prompts_per_step x
# samples_per_prompt rows) must still fit torch's 64-bit sizes: each is at most 2**31 - 1.
MAX_COUNT = 2**31 - 1


@dataclass(frozen=True)
class CheckpointConfig:
    """`train.checkpoint`: save the full training state every `every_n_steps` steps (0 = only
    at a requested stop), keeping the newest `keep_last`."""

    every_n_steps: int = 0
    keep_last: int = 2

    def __post_init__(self):
        for key, low, fix in (("every_n_steps", 0, "use 0 (off) or a number of steps, e.g. 50"),
                              ("keep_last", 1, "keep 1 or more checkpoints, e.g. 2")):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_COUNT:
                raise TrainConfigError(f"train.checkpoint.{key}: {shown(value)} is not allowed. Fix: {fix} "
                                       f"(at most {MAX_COUNT}).")

    @classmethod
    def of(cls, value: Any, source: str) -> CheckpointConfig:
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TrainConfigError(f"{source}: train.checkpoint: {shown(value)} is not a mapping. "
                                   f"Fix: write e.g. checkpoint: {{every_n_steps: 50, keep_last: 2}}.")
        unknown = [key for key in value if key not in ("every_n_steps", "keep_last")]
        if unknown:
            raise TrainConfigError(f"{source}: train.checkpoint: unknown key {shown(unknown[0])}. "
                                   f"Fix: use every_n_steps and keep_last.")
        try:
            return cls(**value)
        except TrainConfigError as error:
            raise TrainConfigError(f"{source}: {error}") from None


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of a run. Every field can be given to HybridTrainer as a keyword."""

    algorithm: str = "ppo"            # "ppo" (critic + GAE) or "grpo" (group-normalised, no critic)
    steps: int = 20                   # policy updates to run
    prompts_per_step: int = 16        # prompts drawn per step
    samples_per_prompt: int = 1       # responses sampled per prompt (the GRPO group size, >= 2 there)
    max_new_tokens: int = 16
    temperature: float = 1.0
    # A response also ends once its text contains one of these strings (kept up to and
    # including the token that completes it); it always ends at the model's EOS ids.
    stop: tuple[str, ...] = ()
    # Sampling filters on the temperature-scaled distribution (0 / 1.0 / 0.0: off); the PPO
    # ratio still uses the unfiltered distribution.
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    actor_lr: float = 1e-4
    critic_lr: float = 1e-4
    kl_coef: float = 0.05             # PPO: per-token reward penalty; GRPO: weight of the KL loss
    clip_ratio: float = 0.2
    value_clip: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    ppo_epochs: int = 1
    mini_batches: int = 1             # optimizer steps per epoch
    # Rows per forward/backward (gradients accumulate), or "auto": 16 rows on a CPU; on a GPU,
    # micro-batches of as many tokens as the free memory fits at the measured bytes per token.
    micro_batch_size: int | str = "auto"
    # Actor, critic and reference run on the rows' real tokens packed into full rows (no
    # padding computed, pipeline/packing.py); false: the padded rows as they are.
    pack_sequences: bool = True
    # With packing, the actor and the reference compute a prompt once for all the rows that
    # share it (a GRPO group's samples): one sequence of the prompt and its responses, each
    # response attending to the prompt and itself (roles/shared_attention.py). Off by
    # default: with 128-token prompts and 8 x 256-token responses it computes 27% fewer
    # tokens, and on an H100 the batch-256 GRPO step took 1.69 against 1.75 s; on
    # long-tailed lengths (mean 215, cut at 1024) an update took 2.00 against 0.98 s packing
    # whole rows, its responses attended in four tiles of similar lengths.
    share_prompts: bool = False
    # Actor and critic recompute each transformer block in the backward pass instead of
    # keeping its activations: far less GPU memory for about a third more update compute.
    gradient_checkpointing: bool = True
    # On GPUs (not under FSDP) the actor and critic compile each transformer block, and the
    # actor its projection onto the vocabulary, with torch.compile (dynamic shapes: one
    # compile serves every micro-batch): the first update takes ~20 s longer, each after it
    # about half as long.
    compile_model: bool = True
    is_cap: float = 2.0               # truncation of the behaviour-policy importance weight
    max_staleness: int = 0            # 0 = on-policy; N = rollouts may be N versions old
    whiten_advantages: bool = True
    grad_clip: float = 1.0
    seed: int = 0
    prompt_column: str = "prompt"     # column holding the prompt text in JSONL/Parquet/datasets
    dtype: str = "float32"            # model dtype on the workers (bfloat16 on GPUs)
    # How new weights reach rollout workers: "auto" (shared memory on the actor's host, a
    # broadcast group to other hosts), or force one of "shm", "cuda_ipc" (readers on the
    # actor's GPU: ~5 ms for 1 GB on an H200), "broadcast", "dask" (the slow fallback).
    weight_sync: str = "auto"
    # A sample whose reward (or reference log-probs, critic values, advantages) is not one
    # finite number: "skip" drops it (GRPO: with its group), logs and counts it; "raise"
    # stops the run at the first one.
    reward_errors: str = "skip"
    # A prompt longer than the model's context minus max_new_tokens: "refuse" the prompt
    # file, "truncate" it (its first tokens are dropped, keeping the end, where the question
    # usually is) or "drop" it.
    long_prompts: str = "refuse"
    # After every N-th update the actor's and critic's rank 0 save model and optimizer state
    # beside the weight snapshots: a group that loses a rank rebuilds from it, exactly.
    # None (auto): every update for roles on CPU; never on a GPU, where a save copies the
    # model and optimizer state out (seconds for a 0.5B model) and the actor falls back to
    # its last published weights with fresh optimizer moments. 0: never.
    recovery_every_n_steps: int | None = None
    checkpoint: CheckpointConfig = CheckpointConfig()
    log_samples: int = 4              # prompt/response/reward rows per step written to samples.jsonl
    wandb_project: str = ""           # log to this Weights & Biases project (needs wandb); "" = off
    # Real tasks. Chat-message prompts are rendered with the tokenizer's chat template (None,
    # the default); true wraps text prompts as one user message too; false refuses messages.
    chat_template: bool | None = None
    system_prompt: str = ""           # put before every conversation without a system message
    # Reward field name -> the dataset column it is read from ({answer: solution}); the
    # other columns keep their names. Every field reaches the reward functions.
    columns: dict[str, str] = field(default_factory=dict)
    reward_weights: list[float] | None = None   # one weight per reward (default 1 each), as TRL names it
    # Seconds one reward function call may take before its sample is dropped (the call runs
    # in a child process that is killed); 0 = no bound, calls run in the worker's thread.
    reward_timeout: float = 60.0
    # Held-out evaluation on eval_prompts: every N steps (0 = never) and/or before training,
    # n samples per prompt, greedy at temperature 0. A sample is correct when its reward is at
    # least eval_correct_reward (pass@1, pass@n and accuracy are counted from that).
    eval_every_n_steps: int = 0
    eval_before_train: bool = False
    eval_samples_per_prompt: int = 1
    eval_temperature: float = 0.0
    eval_correct_reward: float = 1.0
    # -- algorithm options (README "Algorithm options"); the defaults are the plain PPO/GRPO losses.
    loss_agg_mode: str = "token-mean"     # how per-token losses become one (algorithms.aggregate_loss)
    clip_ratio_low: float | None = None   # lower clip eps; None = clip_ratio
    clip_ratio_high: float | None = None  # upper clip eps (DAPO clip-higher); None = clip_ratio
    clip_ratio_c: float | None = None     # dual clip for negative advantages (> 1, e.g. 3.0); None = off
    advantage: str = "auto"               # estimator: auto = gae (ppo) or grpo (grpo); pipeline/advantages.py
    policy_loss: str = "ppo"              # "ppo" (token-level ratio) or "gspo" (sequence-level ratio)
    entropy_coef: float = 0.0             # weight of the entropy bonus in the actor's loss
    lr_warmup_steps: int = 0              # updates of linear warmup (actor and critic)
    lr_schedule: str = "constant"         # decay after warmup: constant, linear or cosine
    lr_min_ratio: float = 0.0             # the decay ends at lr * lr_min_ratio
    weight_decay: float = 0.0             # AdamW weight decay (actor and critic)
    # DAPO's dynamic sampling: groups whose rewards are all equal are left out and more prompts
    # drawn (prompts_per_step at a time, at most filter_groups_max_draws times) until the step
    # has prompts_per_step groups that differ.
    filter_groups: bool = False
    filter_groups_max_draws: int = 4
    # Partial rollouts (the cuda_graph engine): a step's rollout ends once its prompts_per_step
    # groups are complete; unfinished rows continue in the next step's rollout with the newer
    # weights. At most one batch generates ahead (partial.batches_ahead); max_staleness bounds
    # the age of a row's oldest token when it is trained on.
    partial_rollouts: bool = False
    # The first request draws this many times prompts_per_step groups: the pool carried rows
    # come from (later requests draw prompts_per_step; see pipeline/partial.py new_groups).
    partial_request_groups: int = 2
    # True: a carried row still in its decode slot decodes on from the keys and values there,
    # computed by the weights that generated it (its new tokens' behaviour logprobs are of
    # exactly that sampling), instead of having its prompt and tokens prefilled again with
    # the new weights. Faster; but a resumed run, or a row that moves to another rollout
    # worker, is prefilled again, so a resumed run no longer repeats the straight one exactly,
    # and a rollout regenerated after its worker died can differ from the one it replaces
    # (a group is then trained at most once: inflight.Carry).
    partial_keep_kv: bool = False
    overlong_filter: bool = False         # DAPO: responses cut at max_new_tokens leave the loss

    def __post_init__(self):
        for f in fields(self):  # types first, so that the range checks below can compare
            _check_number(f.name, getattr(self, f.name), f.type)
        object.__setattr__(self, "stop", _strings("stop", self.stop))  # a list given in Python too
        rows = self.samples_per_step
        checks = {
            "algorithm": (self.algorithm in ("ppo", "grpo"), "use ppo or grpo"),
            "steps": (self.steps >= 1, "use a positive number"),
            "prompts_per_step": (self.prompts_per_step >= 1, "use a positive number"),
            "samples_per_prompt": (self.samples_per_prompt >= (2 if self.algorithm == "grpo" else 1),
                                   "GRPO compares responses to one prompt: use 2 or more"),
            "max_new_tokens": (self.max_new_tokens >= 1, "use a positive number of tokens"),
            # logits are divided by it: 0 divides by zero, < 0 samples the least likely token.
            "temperature": (self.temperature > 0, "use a temperature > 0 (1.0 samples the model as is)"),
            "top_k": (self.top_k >= 0, "use 0 (off) or the number of most likely tokens to sample from, e.g. 50"),
            "top_p": (0 < self.top_p <= 1, "use 1.0 (off) or a share of the probability mass above 0, e.g. 0.95"),
            "min_p": (0 <= self.min_p < 1,
                      "use 0.0 (off) or a share of the top token's probability below 1, e.g. 0.05"),
            "actor_lr": (self.actor_lr > 0, "use a learning rate > 0, e.g. 1.0e-5"),
            "critic_lr": (self.critic_lr > 0, "use a learning rate > 0, e.g. 1.0e-5"),
            "kl_coef": (self.kl_coef >= 0, "use 0 (no KL term) or a positive weight, e.g. 0.05"),
            "clip_ratio": (self.clip_ratio > 0, "use a ratio > 0, e.g. 0.2"),
            "value_clip": (self.value_clip > 0, "use a range > 0, e.g. 0.2"),
            "gamma": (0 <= self.gamma <= 1, "use a discount from 0 to 1, e.g. 1.0"),
            "lam": (0 <= self.lam <= 1, "use a GAE lambda from 0 to 1, e.g. 0.95"),
            "ppo_epochs": (self.ppo_epochs >= 1, "use 1 or more passes over each batch"),
            # A mini-batch with no rows would be an optimizer step on nothing.
            "mini_batches": (1 <= self.mini_batches <= rows,
                             f"use 1 to {rows} (prompts_per_step x samples_per_prompt rows per step)"),
            "micro_batch_size": (self.micro_batch_size == "auto" or (
                isinstance(self.micro_batch_size, int) and not isinstance(self.micro_batch_size, bool)
                and 1 <= self.micro_batch_size <= MAX_COUNT), "use a positive number of rows or auto"),
            # An on-policy token has weight 1: a cap below 1 would shrink every update.
            "is_cap": (self.is_cap >= 1, "use 1 or more, e.g. 2.0"),
            "max_staleness": (self.max_staleness >= 0, "use 0 (on-policy) or a positive number of versions"),
            "grad_clip": (self.grad_clip > 0, "use a gradient-norm limit > 0, e.g. 1.0"),
            # Per-rollout sampling seeds are derived from it and must fit torch's 64 bits.
            "seed": (0 <= self.seed < 2**32, "use a seed from 0 to 4294967295"),
            "prompt_column": (self.prompt_column != "", "name the column that holds the prompts"),
            "dtype": (self.dtype in ("float32", "bfloat16", "float16"), "use float32, bfloat16 or float16"),
            "recovery_every_n_steps": (self.recovery_every_n_steps is None or (
                not isinstance(self.recovery_every_n_steps, bool) and isinstance(self.recovery_every_n_steps, int)
                and self.recovery_every_n_steps >= 0), "use 0 (never), a positive number of steps, or leave it out"),
            "weight_sync": (self.weight_sync in ("auto", "shm", "cuda_ipc", "broadcast", "dask"),
                            "use auto, shm, cuda_ipc, broadcast or dask"),
            "reward_errors": (self.reward_errors in ("skip", "raise"), "use skip (drop bad samples) or raise"),
            "long_prompts": (self.long_prompts in ("refuse", "truncate", "drop"), "use refuse, truncate or drop"),
            "log_samples": (self.log_samples >= 0, "use 0 (none) or a number of rows, e.g. 4"),
            # One call past this holds a child process that long; a day is the most any check needs.
            "reward_timeout": (0 <= self.reward_timeout <= 86_400, "use 0 (no bound) or seconds up to 86400, e.g. 60"),
            "eval_every_n_steps": (self.eval_every_n_steps >= 0, "use 0 (never) or a number of steps, e.g. 10"),
            "eval_samples_per_prompt": (self.eval_samples_per_prompt >= 1, "use 1 or more samples per prompt"),
            "eval_temperature": (self.eval_temperature >= 0, "use 0 (greedy) or a sampling temperature, e.g. 1.0"),
        }
        checks.update(self._algorithm_checks())
        for key, (ok, fix) in checks.items():
            if not ok:
                raise TrainConfigError(f"train.{key}: {shown(getattr(self, key))} is not allowed. Fix: {fix}.")

    def _algorithm_checks(self) -> dict[str, tuple[bool, str]]:
        """Range checks of the algorithm options (their own block: other keys stay apart)."""
        from pipeline.advantages import ESTIMATORS
        from pipeline.algorithms import LOSS_AGGREGATIONS
        from pipeline.policy_losses import POLICY_LOSSES
        from pipeline.schedules import DECAYS

        def optional(value, ok) -> bool:  # None (the default) or a finite number passing `ok`
            return value is None or (not isinstance(value, bool) and isinstance(value, (int, float))
                                     and math.isfinite(value) and ok(value))

        estimator = self.estimator
        needs = ("gae (the critic-free estimators need algorithm: grpo)" if self.algorithm == "ppo"
                 else "one of " + ", ".join(ESTIMATORS) + " (gae needs algorithm: ppo)")
        return {
            "loss_agg_mode": (self.loss_agg_mode in LOSS_AGGREGATIONS, "use " + ", ".join(LOSS_AGGREGATIONS)),
            "clip_ratio_low": (optional(self.clip_ratio_low, lambda v: 0 < v < 1),
                               "use a ratio between 0 and 1, e.g. 0.2, or leave it out (= clip_ratio)"),
            "clip_ratio_high": (optional(self.clip_ratio_high, lambda v: v > 0),
                                "use a ratio > 0, e.g. 0.28 (DAPO), or leave it out (= clip_ratio)"),
            "clip_ratio_c": (optional(self.clip_ratio_c, lambda v: v > 1),
                             "use a bound > 1, e.g. 3.0, or leave it out (no dual clip)"),
            "advantage": ((estimator == "gae") == (self.algorithm == "ppo") and
                          (estimator == "gae" or estimator in ESTIMATORS),
                          f"with algorithm {self.algorithm} use auto or {needs}"),
            "policy_loss": (self.policy_loss in POLICY_LOSSES, "use " + " or ".join(POLICY_LOSSES)),
            "entropy_coef": (self.entropy_coef >= 0, "use 0 (no entropy bonus) or a small weight, e.g. 0.001"),
            "lr_warmup_steps": (0 <= self.lr_warmup_steps <= self.steps,
                                f"use 0 (no warmup) to {self.steps} (train.steps) updates"),
            "lr_schedule": (self.lr_schedule in DECAYS, "use " + ", ".join(DECAYS)),
            "lr_min_ratio": (0 <= self.lr_min_ratio <= 1, "use a fraction from 0 to 1 of the learning rate"),
            "weight_decay": (self.weight_decay >= 0, "use 0 (none) or a positive weight, e.g. 0.01"),
            # A group of one sample has no spread to compare: every group would be left out.
            "filter_groups": (not self.filter_groups or self.samples_per_prompt >= 2,
                              "use samples_per_prompt of 2 or more with it, or leave it out"),
            "filter_groups_max_draws": (0 <= self.filter_groups_max_draws <= 100,
                                        "use 0 to 100 extra draws a step, e.g. 4"),
            # A carried row's first tokens are a version older than the policy that trains on them.
            "partial_rollouts": (not self.partial_rollouts or (self.max_staleness >= 1 and not self.filter_groups),
                                 "set max_staleness: 1 or more with it (the versions a carried row's tokens may "
                                 "lag), and leave filter_groups off"),
            "partial_keep_kv": (not self.partial_keep_kv or self.partial_rollouts,
                                "it applies to partial rollouts only: set partial_rollouts: true with it, or leave "
                                "it out"),
            "partial_request_groups": (1 <= self.partial_request_groups <= 16,
                                       "use 1 to 16 times prompts_per_step groups in the first request, e.g. 2"),
        }

    @property
    def estimator(self) -> str:
        """The advantage estimator `advantage` names (auto: gae for ppo, grpo for grpo)."""
        if self.advantage != "auto":
            return self.advantage
        return "gae" if self.algorithm == "ppo" else "grpo"

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


def shown(value: Any) -> str:
    """`value` as an error message echoes it: its repr, cut short."""
    try:
        return shorten(repr(value))
    except ValueError:  # an int past Python's 4300-digit repr limit
        return f"<an integer of {value.bit_length()} bits>"


def _check_number(key: str, value: Any, type_name: str) -> None:
    """A float field must hold a finite number (nan passes no range check, so it would slip
    through and poison every loss); an int field an int. TrainConfig(...) built in Python
    skips make_train_config's type check, so it is repeated here."""
    if type_name not in ("int", "float"):
        return
    default = TrainConfig.__dataclass_fields__[key].default
    if isinstance(value, bool) or not isinstance(value, int if type_name == "int" else (int, float)):
        raise TrainConfigError(f"train.{key}: {shown(value)} is not allowed. "
                               f"Fix: use {'an integer' if type_name == 'int' else 'a number'}, e.g. {default!r}.")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        raise TrainConfigError(f"train.{key}: {shown(value)} is not allowed. Fix: use a finite number, "
                               f"e.g. {default!r}.")
    if type_name == "int" and key != "seed" and abs(value) > MAX_COUNT:  # the seed has its own range
        raise TrainConfigError(f"train.{key}: {shown(value)} is not allowed. Fix: use at most {MAX_COUNT} "
                               f"(counts become tensor sizes and loop bounds), e.g. {default!r}.")


TRAIN_FIELDS = {f.name: f for f in fields(TrainConfig)}
# Run inputs that may sit in the `train:` section of a run file besides the hyperparameters.
INPUT_KEYS = ("actor_model", "reward_model", "reward_function", "critic_model", "reference_model",
              "prompts", "eval_prompts", "output_dir")


def make_train_config(values: Mapping[str, Any], *, source: str = "trainer arguments",
                      base: TrainConfig | None = None) -> TrainConfig:
    """A TrainConfig from `values`, type-checked key by key."""
    checked = {}
    for key, value in values.items():
        if key not in TRAIN_FIELDS:
            close = difflib.get_close_matches(shorten(str(key)), list(TRAIN_FIELDS) + list(INPUT_KEYS), n=1)
            # With a likely match, that one; else the keys (the TrainConfig fields), cut short.
            fix = (f"Did you mean {close[0]!r}? Fix: use that key." if close else
                   f"Fix: use one of {shorten(', '.join(TRAIN_FIELDS), 300)} (every TrainConfig field).")
            raise TrainConfigError(f"{source}: unknown training key {shown(key)}. {fix}")
        checked[key] = _coerce(key, value, TRAIN_FIELDS[key].type, source)
    try:
        return replace(base or TrainConfig(), **checked)
    except TrainConfigError as error:  # a value check in __post_init__: say where it came from
        raise TrainConfigError(f"{source}: {error}") from None


def _strings(key: str, value: Any, source: str = "") -> tuple[str, ...]:
    """A list-of-strings key (a YAML list, or a list/tuple in Python) as a tuple; anything
    else, or an empty string in it (it would end every response at once), is an error."""
    example = f"Fix: write e.g. {key}: ['</answer>'] (a list of strings), or leave it out."
    where = f"{source}: " if source else ""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TrainConfigError(f"{where}train.{key}: {shown(value)} should be a list of strings. {example}")
    for item in value:
        if not isinstance(item, str) or item == "":
            raise TrainConfigError(f"{where}train.{key}: {shown(item)} in {shown(list(value))} is not allowed: "
                                   f"every entry must be a non-empty string. {example}")
    return tuple(value)


def _coerce(key: str, value: Any, type_name: str, source: str) -> Any:
    if type_name == "CheckpointConfig":
        return CheckpointConfig.of(value, source)
    if type_name == "tuple[str, ...]":
        return _strings(key, value, source)
    if type_name.endswith(" | None"):  # optional: null (or leaving the key out) means "auto"
        if value is None:
            return None
        type_name = type_name.removesuffix(" | None")
    if type_name == "int | str":  # a count or the word auto (the value check is TrainConfig's)
        return value
    if type_name == "dict[str, str]":
        if not (isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) and k and v
                                                   for k, v in value.items())):
            raise TrainConfigError(f"{source}: train.{key}: {shown(value)} should map names to names. "
                                   f"Fix: write e.g. {key}: {{answer: solution}}.")
        return dict(value)
    if type_name == "list[float]":
        if not (isinstance(value, (list, tuple)) and value and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)):
            raise TrainConfigError(f"{source}: train.{key}: {shown(value)} should be a list of finite numbers. "
                                   f"Fix: write e.g. {key}: [1.0, 0.5].")
        return [float(v) for v in value]
    expected = {"int": int, "float": (int, float), "bool": bool, "str": str}[type_name]
    if isinstance(value, bool) and type_name != "bool" or not isinstance(value, expected):
        article = "an" if type_name == "int" else "a"
        raise TrainConfigError(f"{source}: train.{key}: {shown(value)} should be {article} {type_name}. "
                               f"Fix: write e.g. {key}: {_example(key, type_name)}.")
    if type_name == "float":
        try:
            return float(value)
        except OverflowError:  # an int of hundreds of digits: no float holds it
            raise TrainConfigError(f"{source}: train.{key}: {shown(value)} is too large for a float. "
                                   f"Fix: write e.g. {key}: {getattr(TrainConfig(), key)!r}.") from None
    return value


def _example(key: str, type_name: str) -> str:
    default = getattr(TrainConfig(), key)
    if default is None or default == "":
        return {"bool": "true", "str": "'...'"}.get(type_name, "1")
    return repr(default)
