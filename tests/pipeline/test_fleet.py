"""The Fleet's parts on a real cluster: process-group generations and weight routes."""

from __future__ import annotations

from pipeline.fleet.groups import ProcessGroups
from pipeline.fleet.routes import WeightRoutes
from pipeline.roles.saved_state import Recovery
from resources.cluster import live_workers


def test_a_group_gets_a_new_generation_only_when_membership_or_strategy_changes(shared_cluster):
    groups = ProcessGroups(shared_cluster.client)
    actors = [w["address"] for w in shared_cluster.workers_of("actor")]
    assert len(actors) == 2
    first = groups.ranks("actor", actors, strategy="ddp", backend="gloo", timeout_seconds=30)
    assert [g.rank for g in first] == [0, 1] and {g.world_size for g in first} == {2}
    assert {g.generation for g in first} == {0} and first[0].restore_path is None
    host = live_workers(shared_cluster.client)[actors[0]]["host"]
    assert first[0].init_method.startswith(f"tcp://{host}:") and len({g.init_method for g in first}) == 1

    again = groups.ranks("actor", actors, strategy="ddp", backend="gloo", timeout_seconds=30)
    assert again == first                                 # same members: the same group, no new rendezvous

    groups.restore_paths["actor"] = "/tmp/actor-state.pt"
    recovery = Recovery("/tmp/actor-recovery.pt", "/tmp/published.safetensors", 3)
    shrunk = groups.ranks("actor", actors[:1], strategy="ddp", backend="gloo", timeout_seconds=30,
                          recovery=recovery)
    assert [(g.generation, g.world_size, g.restore_path, g.recovery) for g in shrunk] == [
        (1, 1, "/tmp/actor-state.pt", None)]
    assert groups.members("actor") == (actors[0],) and "actor" not in groups.restore_paths

    # Members changed with nothing exported (a rank was lost): the ranks recover.
    regrown = groups.ranks("actor", actors, strategy="ddp", backend="gloo", timeout_seconds=30,
                           recovery=recovery)
    assert {(g.generation, g.restore_path, g.recovery) for g in regrown} == {(2, None, recovery)}
    assert regrown[0].init_method != first[0].init_method   # a new generation rendezvouses anew

    sharded = groups.ranks("actor", actors, strategy="fsdp", backend="gloo", timeout_seconds=30)
    assert {g.generation for g in sharded} == {3} and groups.strategy("actor") == "fsdp"


def test_weight_routes_pick_the_transport_and_send_nothing_to_local_readers(shared_cluster):
    # CPU workers on one host: "auto" publishes through shared memory (CUDA IPC needs readers
    # on the actor's GPU), a forced mode is taken as it is.
    assert WeightRoutes(shared_cluster, "auto").publish_transport() == "shm"
    for mode in ("shm", "cuda_ipc", "dask"):
        assert WeightRoutes(shared_cluster, mode).publish_transport() == mode
    # "broadcast" publishes to shared memory, then broadcasts to every reader.
    assert WeightRoutes(shared_cluster, "broadcast").publish_transport() == "shm"
