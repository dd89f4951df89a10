"""The trainable roles' ranks on the driver: which workers an update runs on, the process
group over them, and what losing one costs.

A rank cannot run elsewhere: when its worker dies, the update is redone on a full group
once the Nanny's restarted worker (or a new one) is back, every rank rebuilt from the saved
state (roles/saved_state.py). `RankKeeper` is the Fleet's part that decides this; it reads
the Fleet's placement, cluster, groups and newest weights. What it changes: the groups'
generation, and ranks left stuck in a collective, which it restarts (free_survivors).
"""

from __future__ import annotations

import contextlib
import logging
import time

from pipeline.fleet.groups import ProcessGroups
from pipeline.fleet.tasks import RoleTimeout, WorkerLost
from pipeline.roles.saved_state import Recovery, recovery_path
from pipeline.roles.training import GroupInfo
from pipeline.weights import WeightHandle
from resources.cluster import RoleCluster
from resources.config import ResourceConfig

logger = logging.getLogger("dask_rl")


class RankKeeper:
    """Rank-loss handling of the Fleet (its base class)."""

    config: ResourceConfig
    cluster: RoleCluster
    groups: ProcessGroups
    snapshot_dir: str
    weights: WeightHandle | None
    timeout: float
    version: int

    def addresses(self, role: str) -> list[str]:
        raise NotImplementedError

    def rank_groups(self, role: str, workers: list[str]) -> list[GroupInfo]:
        """The process group of `role` over `workers`, one GroupInfo per rank. A lost actor
        rank with nothing exported restarts from the last published weights."""
        spec = self.config.role(role)
        backend = self.config.comm_backend
        if backend == "auto":
            backend = "nccl" if spec.device_type == "cuda" else "gloo"
        published = self.weights if role == "actor" and self.weights is not None else None
        recovery = Recovery(recovery_path(self.snapshot_dir, role), published.path if published else None,
                            self.version if published else 0)
        # A member that died as its group formed: a closed comm, or not listed.
        with self._losing(role, workers, (OSError, KeyError), "its process group formed"):
            return self.groups.ranks(role, workers, strategy=spec.strategy, backend=backend,
                                     timeout_seconds=self.timeout, recovery=recovery)

    @contextlib.contextmanager
    def _losing(self, role: str, workers: list[str], errors: tuple[type[BaseException], ...], doing: str):
        """An error of `errors` inside is WorkerLost for `role` when one of `workers` has left
        the cluster (as a lost rank: the update's redo waits for its replacement and starts
        again), else raised as it is."""
        try:
            yield
        except errors as error:
            gone = self._departed(role, workers)
            if not gone:
                raise
            raise WorkerLost(f"{role}: worker {', '.join(gone)} left the cluster while {doing}", role=role) from error

    def _departed(self, role: str, workers: list[str], grace: float = 30.0) -> list[str]:
        """Those of `workers` the scheduler no longer lists, waiting (bounded) for it to notice
        a worker that just died: until then the role still counts it, and a redo would not know
        that it lost one."""
        deadline = time.monotonic() + min(grace, self.timeout)
        while True:
            gone = sorted(set(workers) - set(self.addresses(role)))
            if gone or time.monotonic() > deadline:
                return gone
            time.sleep(0.2)

    def recovery_path(self, role: str) -> str:
        """Where the role's rank 0 saves its state after an update (see roles/saved_state.py)."""
        return recovery_path(self.snapshot_dir, role)

    def lost_member(self, role: str, live: list[str] | None = None) -> bool:
        """Whether a worker of the role's current process group is gone (from `live`, the
        role's live addresses, when the caller has read them)."""
        members = self.groups.members(role)
        return members is not None and not set(members) <= set(self.addresses(role) if live is None else live)

    def rank_workers(self, role: str) -> list[str]:
        """The workers the role's next update runs on. When a member of its group is gone (a
        killed worker's Nanny restarts it), the replacement is awaited first, so that the
        update runs on a full group. One read of the live workers decides: a loss seen by an
        earlier check but not by the read that forms the group would form it without the
        replacement."""
        workers = self.addresses(role)
        if self.lost_member(role, workers):
            self.await_replacements(role)
            workers = self.addresses(role)
        return workers

    def free_survivors(self, role: str) -> None:
        """After a rank was lost or failed mid-collective: the group's other ranks may sit in a
        collective waiting for it; a rank still busy after a short grace is restarted. The
        role's next update runs on a new group generation, every rank rebuilt from the saved
        state (see roles/saved_state.py)."""
        self.groups.renew(role)
        survivors = [a for a in self.groups.members(role) or () if a in self.addresses(role)]
        restarted = self.cluster.unblock(survivors, grace=min(5.0, self.timeout), timeout=self.timeout)
        if restarted:
            logger.warning("dask-rl: %s ranks %s were stuck in a collective the failed rank left; restarted them",
                           role, restarted)

    def await_replacements(self, role: str) -> None:
        """After a lost rank: wait (bounded by the timeout) until the role has as many workers
        as its placement says (a killed worker process is restarted by its Nanny and reloads
        its model), so that the redo runs on a full group; with fewer, it runs on those."""
        wanted = self.config.role(role).workers
        deadline = time.monotonic() + self.timeout
        while len(self.addresses(role)) < wanted and time.monotonic() < deadline:
            time.sleep(0.5)
        have = len(self.addresses(role))
        if have == 0:
            nannies = "; ".join(f"{name}: {state}" for name, state in self.cluster.nanny_states(role).items())
            raise RoleTimeout(f"{role}: no worker came back within timeout_seconds ({self.timeout:.0f}s) after "
                              f"losing one{f' ({nannies})' if nannies else ''}. Fix: add one with update_resource "
                              f"or `dask-rl worker ... --role {role}`, or raise timeout_seconds if it is still "
                              f"loading.")
        if have < wanted:
            logger.warning("dask-rl: %s continues on %d of %d workers", role, have, wanted)

