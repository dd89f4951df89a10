"""How each role's worker builds its model (the RoleHost recipes): plain arguments from the
train settings and the placement, never the config objects themselves."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

from pipeline.config import TrainConfig
from pipeline.models import materialize
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
                                     dtype=tc.dtype, engine_args=placement.role("rollout").vllm_kwargs),
        "actor": functools.partial(actor.ActorRole, actor_dir, lr=tc.actor_lr,
                                   strategy=placement.role("actor").strategy, grad_clip=tc.grad_clip,
                                   dtype=tc.dtype, gradient_checkpointing=tc.gradient_checkpointing,
                                   recovery_path=recovery_path(snapshot_dir, "actor"), weight_decay=tc.weight_decay),
    }
    if callable(reward_model) and not hasattr(reward_model, "save_pretrained"):
        recipes["reward"] = functools.partial(reward.RewardRole, actor_dir, function=reward_model)
    else:
        recipes["reward"] = functools.partial(reward.RewardRole, actor_dir,
                                              model_dir=materialize(reward_model, output_dir / "reward-init",
                                                                    key="reward_model"))
    if "reference" in roles:
        recipes["reference"] = functools.partial(reference.ReferenceRole, model_dir(reference_model, "reference"),
                                                 dtype=tc.dtype, micro_batch_size=tc.micro_batch_size)
    if "critic" in roles:
        recipes["critic"] = functools.partial(
            critic.CriticRole, model_dir(critic_model, "critic"), lr=tc.critic_lr,
            strategy=placement.role("critic").strategy, grad_clip=tc.grad_clip,
            gradient_checkpointing=tc.gradient_checkpointing, recovery_path=recovery_path(snapshot_dir, "critic"),
            weight_decay=tc.weight_decay)
    return recipes
