"""How each role's worker builds its model (the RoleHost recipes): plain arguments from the
train settings and the placement, never the config objects themselves."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

from pipeline.config import TrainConfig
from pipeline.models import materialize
from pipeline.reward_specs import RewardSpec, reward_name, unique_names
from pipeline.roles import actor, critic, reference, reward, rollout
from pipeline.roles.saved_state import recovery_path
from resources.config import ResourceConfig


def role_recipes(tc: TrainConfig, placement: ResourceConfig, roles: tuple[str, ...], actor_dir: str,
                 output_dir: Path, *, reward_model: Any, critic_model: Any, reference_model: Any,
                 snapshot_dir: str) -> dict[str, Callable]:
    """role -> a no-argument builder of the role object; models given as objects are saved
    under `output_dir` first (workers load from paths). A trainable role's worker whose
    process was restarted picks up the role's recovery state in `snapshot_dir`."""
    def model_dir(model: Any, role: str) -> str:
        return actor_dir if model is None else materialize(model, output_dir / f"{role}-init", key=f"{role}_model")

    recipes: dict[str, Callable] = {
        "rollout": functools.partial(rollout.RolloutRole, actor_dir, engine=placement.role("rollout").strategy,
                                     dtype=tc.dtype, engine_args=placement.role("rollout").engine_kwargs,
                                     hosted_by=placement.role("rollout").hosted_by),
        "actor": functools.partial(actor.ActorRole, actor_dir, lr=tc.actor_lr,
                                   strategy=placement.role("actor").strategy, grad_clip=tc.grad_clip,
                                   dtype=tc.dtype, gradient_checkpointing=tc.gradient_checkpointing,
                                   compile_model=tc.compile_model, recovery_path=recovery_path(snapshot_dir, "actor"),
                                   weight_decay=tc.weight_decay),
    }
    recipes["reward"] = functools.partial(reward.RewardRole, actor_dir, timeout=tc.reward_timeout,
                                          rewards=reward_specs(reward_model, tc.reward_weights, output_dir))
    if "reference" in roles:
        recipes["reference"] = functools.partial(reference.ReferenceRole, model_dir(reference_model, "reference"),
                                                 dtype=tc.dtype, micro_batch_size=tc.micro_batch_size,
                                                 pack_sequences=tc.pack_sequences, share_prompts=tc.share_prompts)
    if "critic" in roles:
        recipes["critic"] = functools.partial(
            critic.CriticRole, model_dir(critic_model, "critic"), lr=tc.critic_lr,
            strategy=placement.role("critic").strategy, grad_clip=tc.grad_clip,
            gradient_checkpointing=tc.gradient_checkpointing, compile_model=tc.compile_model,
            recovery_path=recovery_path(snapshot_dir, "critic"), weight_decay=tc.weight_decay)
    return recipes


def reward_specs(rewards: Any, weights: list[float] | None, output_dir: Path) -> list[RewardSpec]:
    """One RewardSpec per reward of `rewards` (a function, a reward model, or a list of them),
    weighted by train.reward_weights; reward models given as paths, hub ids or objects are
    checked (and objects saved) here, before any worker starts."""
    items = list(rewards) if isinstance(rewards, (list, tuple)) else [rewards]
    if not items:
        raise ValueError("reward_model: the list of rewards is empty. Fix: give at least one reward function "
                         "or reward model.")
    if weights is not None and len(weights) != len(items):
        raise ValueError(f"train.reward_weights: {len(weights)} weights for {len(items)} rewards. Fix: give one "
                         f"weight per reward, in the order of the rewards.")
    is_function = [callable(item) and not hasattr(item, "save_pretrained") for item in items]
    names = unique_names([reward_name(item) if function else "reward_model"
                          for item, function in zip(items, is_function)])
    specs = []
    for i, (item, function, name) in enumerate(zip(items, is_function, names)):
        weight = 1.0 if weights is None else weights[i]
        if function:
            specs.append(RewardSpec(name, weight, function=item))
        else:
            where = output_dir / ("reward-init" if i == 0 else f"reward-init-{i}")
            specs.append(RewardSpec(name, weight, model_dir=materialize(item, where, key="reward_model")))
    return specs
