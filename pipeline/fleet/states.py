"""Saving and restoring the trainable roles' state through their workers: the model in
Hugging Face format, and the full model + optimizer state that a checkpoint holds.

Every rank runs the task (gathering a sharded model is collective); rank 0 writes. The
files are written by the workers, so the output directory must be one path that the actor's
and critic's hosts and the driver share (one machine, or a shared filesystem).
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.fleet.reconcile import TRAINABLE_EXPORTS
from pipeline.roles import actor, critic
from pipeline.roles.host import role_ready

SAVE_PRETRAINED = {"actor": actor.save_pretrained, "critic": critic.save_pretrained}
logger = logging.getLogger("dask_rl")


def _on_every_rank(fleet, role: str, fn, path: str, what: str, members: list[str] | None = None) -> list:
    members = members if members is not None else list(fleet.groups.members(role) or fleet.addresses(role))
    futures = [fleet.submit(role, fn, path, tag=f"{what.split()[0]}-r{rank}", workers=[address])
               for rank, address in enumerate(members)]
    return fleet.wait(role, futures, what)


def _live_members(fleet, role: str) -> list[str]:
    """The workers to save `role` from: its current group when every member is live; after a
    lost rank (a run that ended on the fault) only the group's live members, never a task
    pinned to a worker that is gone; [] when none of them can save it."""
    live = fleet.addresses(role)
    members = list(fleet.groups.members(role) or live)
    alive = [address for address in members if address in live]
    if len(alive) == len(members):
        return members
    if not alive:
        logger.warning("dask-rl: %s: no worker of its group %s is live, so its model is not saved (its recovery "
                       "state is %s)", role, members, fleet.recovery_path(role))
        return []
    if fleet.groups.strategy(role) == "fsdp":  # a sharded model is gathered by every rank: it cannot be
        logger.warning("dask-rl: %s: its group lost %s; its sharded model cannot be gathered without them, so it is "
                       "not saved (its recovery state is %s)", role, sorted(set(members) - set(alive)),
                       fleet.recovery_path(role))
        return []
    logger.warning("dask-rl: %s: its group lost %s; saving from the live members %s", role,
                   sorted(set(members) - set(alive)), alive)
    return alive


def save_models(fleet, roles: tuple[str, ...], directory: Path) -> dict[str, Path]:
    """<directory>/actor (and /critic): the current weights in Hugging Face format, written
    by rank 0 of the role's group. A role whose group lost that rank is not saved (logged)."""
    saved = {}
    for role in roles:
        if role not in SAVE_PRETRAINED:
            continue
        members = _live_members(fleet, role)
        written = members and any(_on_every_rank(fleet, role, SAVE_PRETRAINED[role], str(directory / role),
                                                 "saving its model", members))
        if written:
            saved[role] = directory / role
        elif members:  # rank 0, the writer, is gone; the others hold the same weights but no rank 0
            logger.warning("dask-rl: %s: rank 0 of its group is gone, so its model is not saved; its recovery "
                           "state is %s", role, fleet.recovery_path(role))
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
