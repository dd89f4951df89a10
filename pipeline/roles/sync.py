"""Broadcast the actor's weights to rollout workers on any host, outside the scheduler.

Rank 0 of a `BroadcastChannel` is actor rank 0, ranks 1.. are rollout workers. Every rank
must run its task at the same time (each blocks in the broadcast), so the driver submits
them together, pinned to their workers (`broadcast_weights`). A channel stays open on its
worker across versions, keyed by its init_method: only the first sync pays the rendezvous.
A change of members (a rollout worker added or lost) needs a new init_method (a new port).

Only an actor of one rank, or ddp, is supported: `full_state_dict` is a collective under
FSDP, so every actor rank would have to run a task at the same time as the broadcast.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

import torch

from pipeline.roles.host import role_state
from pipeline.weights import BroadcastChannel, Layout, tensor_layout, to_device
from resources.cluster import submit

_CHANNELS: dict[str, BroadcastChannel] = {}   # init_method -> the channel open in this process
_LOCK = threading.Lock()


@dataclass(frozen=True)
class ChannelInfo:
    """One rank's view of a weight broadcast channel (plain values: travels in the task)."""

    init_method: str         # tcp://host:port of actor rank 0's worker (it hosts the TCPStore)
    world_size: int          # 1 sender + the rollout receivers
    backend: str             # "gloo" (CPU tensors) or "nccl" (CUDA tensors)
    timeout_seconds: float   # the resource file's timeout_seconds
    rank: int = 0


def channel_infos(init_method: str, receivers: int, backend: str, timeout_seconds: float) -> list[ChannelInfo]:
    """Rank 0 (the actor) first, then one per receiver."""
    base = ChannelInfo(init_method, receivers + 1, backend, timeout_seconds)
    return [replace(base, rank=rank) for rank in range(receivers + 1)]


def open_channel(info: ChannelInfo) -> tuple[BroadcastChannel, bool]:
    """This process's channel for `info` and whether it was opened just now."""
    with _LOCK:
        channel = _CHANNELS.get(info.init_method)
        if channel is not None and (channel.rank, channel.world_size, channel.backend) == \
                (info.rank, info.world_size, info.backend):
            return channel, False
        if channel is not None:
            channel.close()
        channel = BroadcastChannel(info.init_method, info.rank, info.world_size, info.backend, info.timeout_seconds)
        _CHANNELS[info.init_method] = channel
        return channel, True


def close_channels() -> int:
    """Close every channel of this process (run with client.run on the workers); returns how many."""
    with _LOCK:
        channels = list(_CHANNELS.values())
        _CHANNELS.clear()
    for channel in channels:
        channel.close()
    return len(channels)


def _actor_state() -> dict[str, torch.Tensor]:
    trainer = role_state("actor").trainer
    if trainer.sharded:
        raise NotImplementedError("weight broadcast from an FSDP actor is not supported (full_state_dict is a "
                                  "collective of all actor ranks); publish through weights.publish instead")
    state = trainer.full_state_dict()
    if state is None:
        raise RuntimeError("send_weights must run on actor rank 0: the other ranks hold no full state dict")
    return state


def weight_layout() -> Layout:
    """Task (actor rank 0): the layout receivers need; fixed for a model, ask once."""
    return tensor_layout(_actor_state())


def send_weights(channel: ChannelInfo, version: int) -> dict:
    """Task (actor rank 0): broadcast the current weights as `version`."""
    state = _actor_state()
    start = time.perf_counter()
    sender, opened = open_channel(channel)
    rendezvous = time.perf_counter() - start
    if sender.device.type == "cuda":
        state = to_device(state, sender.device)
    nbytes = sender.send(state, version)
    return {"version": version, "bytes": nbytes, "seconds": time.perf_counter() - start,
            "rendezvous_seconds": rendezvous, "opened": opened}


def receive_weights(channel: ChannelInfo, version: int, layout: Layout) -> dict:
    """Task (a rollout worker): take part in the broadcast and load the weights as `version`.

    Runs even when this worker already holds `version`: the sender waits for every rank.
    """
    role = role_state("rollout")
    start = time.perf_counter()
    receiver, opened = open_channel(channel)
    rendezvous = time.perf_counter() - start
    state = receiver.receive(layout, receiver.device, version)
    role.engine.load_state_dict(state)
    role.version = version
    return {"version": version, "seconds": time.perf_counter() - start, "rendezvous_seconds": rendezvous,
            "opened": opened}


def broadcast_weights(client, version: int, layout: Layout, actor_address: str, rollout_addresses: list[str],
                      init_method: str, backend: str, timeout_seconds: float) -> list:
    """Driver side: submit the sender and every receiver together; futures, sender first."""
    infos = channel_infos(init_method, len(rollout_addresses), backend, timeout_seconds)
    futures = [submit(client, "actor", send_weights, infos[0], version, tag=f"v{version}", workers=[actor_address])]
    futures += [submit(client, "rollout", receive_weights, info, version, layout, tag=f"v{version}-r{info.rank}",
                       workers=[address])
                for info, address in zip(infos[1:], rollout_addresses)]
    return futures
