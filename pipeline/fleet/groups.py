"""Driver-side bookkeeping of the trainable roles' torch.distributed groups.

Each role (actor, critic) has one group across its workers. When the membership changes (a
resize, a lost worker) the group gets a new generation and a new rendezvous port, and its
ranks rebuild from a saved state (see GroupInfo.restore_path).
"""

from __future__ import annotations

from distributed import Client

from pipeline.roles.saved_state import Recovery
from pipeline.roles.training import GroupInfo
from resources.cluster import live_workers


def free_port() -> int:
    """Runs on rank 0's worker: a port free there for a rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


class ProcessGroups:
    def __init__(self, client: Client):
        self.client = client
        # role -> (members, strategy, generation, init_method)
        self._groups: dict[str, tuple[tuple[str, ...], str, int, str]] = {}
        self.restore_paths: dict[str, str] = {}   # role -> state the next generation starts from
        self._broken: set[str] = set()              # roles whose group a rank left mid-collective

    def renew(self, role: str) -> None:
        """The role's group is broken (a rank left it mid-collective): the next ranks() call
        starts a new generation, from the role's saved state, even with the same members."""
        self._broken.add(role)

    def members(self, role: str) -> tuple[str, ...] | None:
        """The workers of the role's current group, in rank order."""
        known = self._groups.get(role)
        return known[0] if known else None

    def strategy(self, role: str) -> str | None:
        known = self._groups.get(role)
        return known[1] if known else None

    def ranks(self, role: str, workers: list[str], *, strategy: str, backend: str, timeout_seconds: float,
              recovery: Recovery | None = None) -> list[GroupInfo]:
        """GroupInfo per rank of `workers`; a new generation when the membership or the
        data-parallel strategy changed, or the group broke (renew).

        A new generation starts from the state exported for it (a resize), or, without one
        (a rank was lost, or the group broke), from what `recovery` points at.
        """
        members = tuple(workers)
        known = self._groups.get(role)
        restore, lost = None, None
        if known is None or known[:2] != (members, strategy) or role in self._broken:
            generation = 0 if known is None else known[2] + 1
            host = live_workers(self.client)[members[0]]["host"]
            port = self.client.run(free_port, workers=[members[0]])[members[0]]
            self._broken.discard(role)  # only once the new generation exists: a failed start keeps it broken
            self._groups[role] = known = (members, strategy, generation, f"tcp://{host}:{port}")
            restore = self.restore_paths.pop(role, None)
            lost = recovery if restore is None and generation > 0 else None
        return [GroupInfo(rank=rank, world_size=len(members), init_method=known[3], backend=backend,
                          generation=known[2], timeout_seconds=timeout_seconds, strategy=strategy,
                          restore_path=restore, recovery=lost)
                for rank in range(len(members))]
