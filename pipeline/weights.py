"""Versioned policy weights, published by the actor and loaded by rollout workers.

Weights never go through the scheduler; only a small `WeightHandle` travels as a Dask
future. Four paths, bf16 bit-exact on each (bytes are moved, never converted):

- "shm": the actor writes a safetensors snapshot under /dev/shm (RAM) on its host and
  rollout workers of that host read it.
- "cuda_ipc": the actor copies the weights into one flat CUDA buffer per dtype, keeps the
  last `keep` versions alive, and the handle carries their CUDA IPC handles; a reader opens
  and clones them. The reader must see the actor's GPU (e.g. a rollout worker sharing it):
  where CUDA_VISIBLE_DEVICES hides it, `receive` says so.
- "dask": the slow fallback for readers on another host: the snapshot file's bytes, from a
  `fetch_snapshot` task on the actor's worker (Dask TCP, ~1 s per GB).
- "in_process": nothing moves. The readers are the actor's own processes (a rollout hosted
  by the actor), whose engine reads the actor's parameters in place; the handle only names
  the version.
- `BroadcastChannel`: a broadcast from actor rank 0 to rollout workers on any host over
  its own process group (gloo on CPU, NCCL on GPU), apart from torch.distributed's default
  group, which the actor ranks use for data parallelism. See pipeline/roles/sync.py.

Tied tensors (an lm_head sharing the embedding) are sent once and arrive tied.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import socket
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from safetensors import safe_open
from safetensors.torch import load, load_file, save_file

TRANSPORTS = ("shm", "cuda_ipc", "dask", "in_process")
ON_DEVICE = ("cuda_ipc", "in_process")   # transports that take the actor's tensors where they are
TIED_KEY = "dask_rl.tied"           # safetensors metadata: {alias: name} as JSON
TIED = "tied:"                      # layout entry of an alias: (name, shape, "tied:<name>")
BUCKET_BYTES = 256 * 2**20

Layout = list[tuple[str, tuple[int, ...], str]]


@dataclass(frozen=True)
class WeightHandle:
    """Where version `version` of the policy lies, and how to get it."""

    version: int
    path: str       # a safetensors file on `host` ("shm", "dask"); "" for "cuda_ipc"
    host: str       # hostname of the worker that published it
    nbytes: int
    transport: str = "shm"
    ipc: tuple | None = None   # "cuda_ipc": (layout, ((rebuild_fn, args), ...) one per dtype buffer)
    pid: int = 0               # the publishing process ("cuda_ipc": a reader in it clones directly)
    device_uuid: str = ""      # "cuda_ipc": the GPU the buffers live on
    address: str = ""          # Dask address of the publishing worker (the fallback fetches from it)


def default_snapshot_dir(run_id: str) -> Path:
    """RAM-backed when the OS has /dev/shm, else the temp directory."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"dask-rl-{run_id}"


def publish(state: dict[str, torch.Tensor], version: int, directory: str | os.PathLike,
            keep: int = 3, transport: str = "shm") -> WeightHandle:
    """Publish `state` as version `version`; keep the last `keep` versions readable (this
    one included): a rollout worker may still be loading one of them. An older version is
    gone, its memory reused."""
    if transport == "cuda_ipc":
        return _publish_cuda_ipc(state, version, keep)
    if transport == "in_process":
        return WeightHandle(version=version, path="", host=socket.gethostname(), nbytes=0, transport=transport,
                            pid=os.getpid())
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown weight transport {transport!r}; expected one of {TRANSPORTS}")
    # The write goes to a temporary name first so no reader ever sees half a file.
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"policy-v{version:06d}.safetensors"
    partial = final.with_suffix(".partial")
    tensors, ties = _unshare(state)
    save_file(tensors, str(partial), metadata={TIED_KEY: json.dumps(ties)})
    os.replace(partial, final)
    for old in sorted(directory.glob("policy-v*.safetensors"))[:-keep]:
        old.unlink(missing_ok=True)
    return WeightHandle(version=version, path=str(final), host=socket.gethostname(),
                        nbytes=final.stat().st_size, transport=transport, pid=os.getpid())


def receive(handle: WeightHandle, snapshot: bytes | None = None) -> dict[str, torch.Tensor]:
    """The state of `handle`, by its transport; `snapshot`: bytes already fetched through Dask.

    With "cuda_ipc" the tensors are views of the publisher's buffers (no second copy of the
    weights on the GPU): copy them into the model right away, before the publisher drops
    that version (it keeps the last `keep`).
    """
    if snapshot is not None:
        return load_snapshot_bytes(snapshot)
    if handle.transport == "cuda_ipc":
        return _receive_cuda_ipc(handle)
    if not is_local(handle):
        raise RuntimeError(
            f"weights v{handle.version} lie in {handle.path} on host {handle.host}, not readable on "
            f"{socket.gethostname()}: fetch them with a fetch_snapshot task on the publishing worker "
            f"and pass the bytes as `snapshot`, or use a BroadcastChannel")
    return load_snapshot(handle)


# -- shm / dask: safetensors files ---------------------------------------------------------------

def to_device(state: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """`state` on `device`, each tensor moved once: tied entries (one tensor under two names,
    e.g. embeddings and lm_head) stay one tensor."""
    moved = {id(t): t.to(device) for t in state.values()}
    return {name: moved[id(t)] for name, t in state.items()}


def _ties(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """{alias: first name} for entries that are the very same view of the same memory."""
    first: dict[tuple, str] = {}
    ties = {}
    for name, t in state.items():
        if t.numel() == 0:
            continue
        key = (("meta", id(t)) if t.is_meta else   # meta tensors have no memory: ties are the same object
               (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride()))
        if key in first:
            ties[name] = first[key]
        else:
            first[key] = name
    return ties


def _unshare(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses tensors that share memory: drop exact aliases (returned as ties,
    restored on load) and copy any other overlap."""
    ties = _ties(state)
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        if name in ties:
            continue
        tensor = tensor.detach().to("cpu").contiguous()
        key = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if key in seen else tensor
        seen.add(key)
    return out, ties


def _retie(state: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> dict[str, torch.Tensor]:
    for alias, name in json.loads((metadata or {}).get(TIED_KEY, "{}")).items():
        state[alias] = state[name]
    return state


def is_local(handle: WeightHandle) -> bool:
    return handle.host == socket.gethostname() and Path(handle.path).exists()


def load_snapshot(handle: WeightHandle) -> dict[str, torch.Tensor]:
    """Read a snapshot written on this host."""
    return load_tied_file(handle.path)


def load_tied_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A published safetensors file as a state dict whose tied entries are one tensor again."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    return _retie(load_file(str(path)), metadata)


def fetch_snapshot(handle: WeightHandle) -> bytes:
    """The raw file bytes; runs as a task on the publishing host for remote readers."""
    return Path(handle.path).read_bytes()


def load_snapshot_bytes(data: bytes) -> dict[str, torch.Tensor]:
    (size,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8:8 + size]).get("__metadata__")
    return _retie(load(data), metadata)


# -- flat buffers, shared by cuda_ipc and the broadcast ------------------------------------------

def tensor_layout(state: dict[str, torch.Tensor]) -> Layout:
    """[(name, shape, dtype)] in state order; an alias of an earlier entry reads (name, shape, "tied:<name>")."""
    ties = _ties(state)
    return [(name, tuple(t.shape), TIED + ties[name] if name in ties else str(t.dtype).removeprefix("torch."))
            for name, t in state.items()]


def _buckets(layout: Layout, limit: float = BUCKET_BYTES) -> list[tuple[torch.dtype, list[int]]]:
    """Entries grouped by dtype (first-seen order), each group cut into runs of about `limit` bytes."""
    groups: dict[str, list[int]] = {}
    for i, (_, _, dtype) in enumerate(layout):
        if not dtype.startswith(TIED):
            groups.setdefault(dtype, []).append(i)
    buckets = []
    for name, indices in groups.items():
        dtype = getattr(torch, name)
        size = torch.empty((), dtype=dtype).element_size()
        current, used = [], 0
        for i in indices:
            nbytes = math.prod(layout[i][1]) * size
            if current and used + nbytes > limit:
                buckets.append((dtype, current))
                current, used = [], 0
            current.append(i)
            used += nbytes
        buckets.append((dtype, current))
    return buckets


def _pack(state, layout: Layout, indices: list[int], device, into: torch.Tensor | None = None) -> torch.Tensor:
    """One flat tensor holding the entries `indices` (a copy: later updates don't show),
    written into `into` where that has the right dtype and size, else new."""
    parts = [state[layout[i][0]].detach().reshape(-1).to(device) for i in indices]
    numel = sum(p.numel() for p in parts)
    if into is not None and into.numel() == numel and into.dtype == parts[0].dtype and into.device == parts[0].device:
        return torch.cat(parts, out=into)
    return torch.cat(parts)


def _unpack(flat: torch.Tensor, layout: Layout, indices: list[int], out: dict[str, torch.Tensor]) -> None:
    offset = 0
    for i in indices:
        name, shape, _ = layout[i]
        n = math.prod(shape)
        out[name] = flat[offset:offset + n].view(shape)
        offset += n


def _finish(out: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """State in layout order, aliases pointing at their tensor."""
    return {name: out[dtype[len(TIED):]] if dtype.startswith(TIED) else out[name] for name, _, dtype in layout}


def _wire(flat: torch.Tensor) -> torch.Tensor:
    """The same bytes as uint8, which every backend broadcasts whatever the dtype (gloo refuses
    int16, fp8 has no collective support; gloo does take bf16, but bytes need no such check)."""
    return flat.view(torch.uint8)


# -- cuda_ipc ------------------------------------------------------------------------------------

_PUBLISHED: dict[int, list[torch.Tensor]] = {}   # version -> buffers shared with readers


def _publish_cuda_ipc(state, version: int, keep: int) -> WeightHandle:
    from torch.multiprocessing.reductions import reduce_tensor

    devices = {t.device for t in state.values() if t.is_cuda}
    device = devices.pop() if len(devices) == 1 else torch.device("cuda", torch.cuda.current_device())
    layout = tensor_layout(state)
    # The oldest versions leave before the new one is written, and the last of them lends
    # it its buffers: the actor's GPU holds `keep` copies of the weights, never keep + 1,
    # and the same memory serves every version (no fresh 1 GB block each step to fragment
    # the memory the training step uses). Nobody reads the oldest any more (see `keep`).
    recycled: list[torch.Tensor] = []
    while _PUBLISHED and len(_PUBLISHED) >= keep:
        recycled = _PUBLISHED.pop(min(_PUBLISHED))
    buckets = _buckets(layout, math.inf)
    buffers = [_pack(state, layout, indices, device, recycled[k] if k < len(recycled) else None)
               for k, (_, indices) in enumerate(buckets)]
    del recycled
    torch.cuda.synchronize(device)   # readers on other streams see complete buffers
    _PUBLISHED[version] = buffers
    ipc = (tuple(layout), tuple(reduce_tensor(b) for b in buffers))
    return WeightHandle(version=version, path="", host=socket.gethostname(),
                        nbytes=sum(b.numel() * b.element_size() for b in buffers), transport="cuda_ipc",
                        ipc=ipc, pid=os.getpid(), device_uuid=_uuid(device.index))


def _uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _receive_cuda_ipc(handle: WeightHandle) -> dict[str, torch.Tensor]:
    layout, reductions = list(handle.ipc[0]), handle.ipc[1]
    if handle.pid == os.getpid() and handle.version in _PUBLISHED:
        buffers = list(_PUBLISHED[handle.version])
    else:
        if handle.host != socket.gethostname():
            raise RuntimeError(f"cuda_ipc weights v{handle.version} were published on {handle.host}; CUDA IPC "
                               f"works on one host only: use a BroadcastChannel for {socket.gethostname()}")
        visible = {_uuid(i): i for i in range(torch.cuda.device_count())} if torch.cuda.is_available() else {}
        if handle.device_uuid not in visible:
            raise RuntimeError(
                f"cuda_ipc weights v{handle.version} live on GPU {handle.device_uuid}, which this process does "
                f"not see (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}): CUDA IPC needs the "
                f"reader on the publisher's GPU; use transport 'shm' or a BroadcastChannel")
        index = visible[handle.device_uuid]
        buffers = []
        for rebuild, args in reductions:
            args = (*args[:6], index, *args[7:])   # the device index as this process numbers it
            with torch.cuda.device(index):
                buffers.append(rebuild(*args))
    out: dict[str, torch.Tensor] = {}
    for flat, (_, indices) in zip(buffers, _buckets(layout, math.inf)):
        _unpack(flat, layout, indices, out)
    return _finish(out, layout)


# -- broadcast over a separate process group -----------------------------------------------------

class BroadcastChannel:
    """Rank 0 broadcasts state dicts to ranks 1..world_size-1 over its own process group.

    The group is built directly from a TCPStore (rank 0 hosts it at `init_method`,
    "tcp://host:port"), so torch.distributed's default group is neither needed nor touched.
    Tensors travel in flat buckets of about 256 MB, one dtype each, as integer views.
    """

    def __init__(self, init_method: str, rank: int, world_size: int, backend: str, timeout_seconds: float):
        url = urlparse(init_method)
        if url.scheme != "tcp" or not url.hostname or not url.port:
            raise ValueError(f"init_method must read tcp://host:port, not {init_method!r}")
        timeout = datetime.timedelta(seconds=timeout_seconds)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.init_method, self.timeout_seconds = init_method, timeout_seconds
        store = torch.distributed.TCPStore(url.hostname, url.port, world_size, rank == 0, timeout)
        self.store = torch.distributed.PrefixStore("dask-rl-weights/", store)
        if backend == "gloo":
            self.pg = torch.distributed.ProcessGroupGloo(self.store, rank, world_size, timeout)
            self.device = torch.device("cpu")
        elif backend == "nccl":
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            self.pg = ProcessGroupNCCL(self.store, rank, world_size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            raise ValueError(f"BroadcastChannel backend must be 'gloo' or 'nccl', not {backend!r}")

    def _broadcast(self, tensor: torch.Tensor):
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        return self.pg.broadcast([tensor], options)

    def _header(self, layout: Layout, version: int) -> torch.Tensor:
        digest = int.from_bytes(hashlib.sha1(repr(layout).encode()).digest()[:7], "little")
        return torch.tensor([digest, version], dtype=torch.int64, device=self.device)

    def send(self, state: dict[str, torch.Tensor], version: int = -1) -> int:
        """Rank 0: broadcast `state`; returns the bytes sent. Every other rank must be in `receive`."""
        if self.rank != 0:
            raise RuntimeError("BroadcastChannel.send runs on rank 0 only")
        layout = tensor_layout(state)
        self._broadcast(self._header(layout, version)).wait()
        pending, sent = [], 0
        for _, indices in _buckets(layout):
            flat = _pack(state, layout, indices, self.device)
            pending.append((flat, self._broadcast(_wire(flat))))
            sent += flat.numel() * flat.element_size()
            if len(pending) > 1:   # pack the next bucket while this one travels
                pending.pop(0)[1].wait()
        for _, work in pending:
            work.wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return sent

    def receive(self, layout: Layout, device: str | torch.device | None = None,
                version: int = -1) -> dict[str, torch.Tensor]:
        """Ranks > 0: the state rank 0 sends, laid out as `layout` (tensor_layout of the sender's state)."""
        layout = [(name, tuple(shape), dtype) for name, shape, dtype in layout]
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._broadcast(header).wait()
        expected = self._header(layout, version)
        if int(header[0]) != int(expected[0]):
            raise RuntimeError(f"BroadcastChannel {self.init_method}: the sender's tensor layout differs from "
                               "the one this rank was given (different model or dtype?)")
        if version >= 0 and int(header[1]) != version:
            raise RuntimeError(f"BroadcastChannel {self.init_method}: expected version {version}, "
                               f"the sender sent {int(header[1])}")
        out: dict[str, torch.Tensor] = {}
        works = []
        for dtype, indices in _buckets(layout):
            flat = torch.empty(sum(math.prod(layout[i][1]) for i in indices), dtype=dtype, device=self.device)
            works.append(self._broadcast(_wire(flat)))
            _unpack(flat, layout, indices, out)
        for work in works:
            work.wait()
        state = _finish(out, layout)
        device = torch.device(device) if device is not None else self.device
        return to_device(state, device) if device != self.device else state

    def close(self) -> None:
        try:
            self.pg.shutdown()
        except Exception:  # a peer already gone, or nothing to release
            pass
        self.pg = self.store = None
