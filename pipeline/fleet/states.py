"""Saving and restoring the trainable roles' state through their workers: the model in
Hugging Face format, and the full model + optimizer state that a checkpoint holds.

Every rank runs the task (gathering a sharded model is collective); rank 0 writes. The
files are written by the workers, so the output directory must be one path that the actor's
and critic's hosts and the driver share (one machine, or a shared filesystem).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.fleet.reconcile import TRAINABLE_EXPORTS
from pipeline.roles import actor, critic
from pipeline.roles.host import role_ready

SAVE_PRETRAINED = {"actor": actor.save_pretrained, "critic": critic.save_pretrained}


def _on_every_rank(fleet, role: str, fn, path: str, what: str) -> None:
    members = fleet.groups.members(role) or fleet.addresses(role)
    futures = [fleet.submit(role, fn, path, tag=f"{what.split()[0]}-r{rank}", workers=[address])
               for rank, address in enumerate(members)]
    fleet.wait(role, futures, what)


def save_models(fleet, roles: tuple[str, ...], directory: Path) -> dict[str, Path]:
    """<directory>/actor (and /critic): the current weights in Hugging Face format."""
    saved = {}
    for role in roles:
        if role in SAVE_PRETRAINED:
            _on_every_rank(fleet, role, SAVE_PRETRAINED[role], str(directory / role), "saving its model")
            saved[role] = directory / role
    return saved


def export_states(fleet, roles: tuple[str, ...], directory: Path) -> None:
    """<directory>/<role>.pt: full model and optimizer state of each trainable role."""
    for role in roles:
        if role in TRAINABLE_EXPORTS:
            _on_every_rank(fleet, role, TRAINABLE_EXPORTS[role], str(directory / f"{role}.pt"),
                           "exporting its state for a checkpoint")


def restore_states(fleet, roles: tuple[str, ...], directory: Path, version: int, keep: int) -> None:
    """Start the trainable roles from <directory>/<role>.pt and publish the actor's weights
    as `version`. Every worker loads the model now (the critic serves values before its
    first update); the optimizer state comes with the first group formed, whatever its
    size, so the worker counts may differ from those of the saved run."""
    for role in roles:
        if role not in TRAINABLE_EXPORTS:
            continue
        path = str(directory / f"{role}.pt")
        futures = [fleet.submit(role, role_ready, role, path, tag="resume", workers=[address])
                   for address in fleet.addresses(role)]
        fleet.wait(role, futures, "loading the checkpoint")
        fleet.groups.restore_paths[role] = path
    first = fleet.addresses("actor")[0]
    handle = fleet.submit("actor", actor.publish_loaded, version, fleet.snapshot_dir, fleet.publish_transport(),
                          keep, tag="resume-publish", workers=[first])
    fleet.published(fleet.wait("actor", [handle], "publishing the checkpoint's weights")[0], first)
