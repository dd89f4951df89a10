"""NVML probing: which NVIDIA GPUs this machine has and how busy they are.

Everything here is lazy and never raises for a missing driver: `import resources` must
work on a laptop and in CPU-only CI, where the CPU path is a first-class path. `pynvml`
(from the nvidia-ml-py package) is pure Python, so importing it succeeds even without a
driver; it is `nvmlInit()` that fails, and we turn that failure into a reason string.

Indexes are NVML indexes, i.e. physical GPU order (PCI bus order). NVML ignores
CUDA_VISIBLE_DEVICES, and so do we: the resource file names physical GPUs.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

__all__ = [
    "GpuInfo",
    "GpuProcess",
    "busy_gpus",
    "free_memory_bytes",
    "get_gpu_usage",
    "gpu_count",
    "nvml_status",
    "pin_to_device",
]


@dataclass(frozen=True)
class GpuProcess:
    """A compute process NVML lists on a GPU."""

    pid: int
    name: str            # the executable's name, "?" where neither NVML nor /proc can tell
    used_bytes: int | None  # its GPU memory; None where NVML does not report it (some containers)

    def describe(self) -> str:
        memory = "memory not reported" if self.used_bytes is None else f"uses {self.used_bytes / 2**30:.1f} GiB"
        return f"pid {self.pid} ({self.name}) {memory}"


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML saw it at probe time (a snapshot, not a live view)."""

    index: int  # NVML (physical) index
    name: str
    total_bytes: int
    free_bytes: int
    used_bytes: int
    utilization_pct: int | None  # None where NVML does not report it (some SoCs, MIG)
    process_count: int  # compute processes on the GPU; 0 if NVML cannot list them
    processes: tuple[GpuProcess, ...] = ()  # those of them NVML could describe

    @property
    def used_fraction(self) -> float:
        # total_bytes can be 0 where memory info is not supported; treat as unused.
        return self.used_bytes / self.total_bytes if self.total_bytes else 0.0


# Errors that mean "there is no usable NVIDIA driver here", as opposed to a broken one.
_NO_DRIVER_ERRORS = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded")


@functools.lru_cache(maxsize=1)
def _nvml_init() -> tuple[bool, str]:
    """Initialise NVML once per process and remember the outcome.

    NVML is reference counted and cheap to keep open, so we never shut it down; caching
    also means a machine without a driver pays for the failed dlopen only once.
    """
    try:
        import pynvml
    except ImportError:
        return False, "pynvml not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError subclasses, or OSError from a broken library
        kind = type(exc).__name__
        hint = ": no NVIDIA driver" if kind in _NO_DRIVER_ERRORS else ""
        return False, f"NVML could not initialise: {kind}: {exc}{hint}"
    return True, "ok"


def nvml_status() -> tuple[bool, str]:
    """(True, "ok") when NVML works, else (False, a reason a user can act on)."""
    return _nvml_init()


def _pynvml():
    """The initialised pynvml module, or None when NVML is unavailable."""
    ok, _ = _nvml_init()
    if not ok:
        return None
    import pynvml

    return pynvml


def gpu_count() -> int:
    """Number of GPUs NVML sees (all of them, whatever CUDA_VISIBLE_DEVICES says)."""
    nvml = _pynvml()
    if nvml is None:
        return 0
    try:
        return int(nvml.nvmlDeviceGetCount())
    except Exception:
        return 0


def _text(value: object) -> str:
    # Old pynvml versions return bytes for names; new ones return str.
    return value.decode() if isinstance(value, bytes) else str(value)


def _memory(nvml, handle) -> tuple[int, int, int]:
    """(total, free, used) bytes; zeros where NVML does not support memory info."""
    try:
        mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        return int(mem.total), int(mem.free), int(mem.used)
    except Exception:
        return 0, 0, 0


def _utilization(nvml, handle) -> int | None:
    try:
        return int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:
        return None


def _processes(nvml, handle) -> tuple[int, tuple[GpuProcess, ...]]:
    """(how many compute processes run on the GPU, those NVML describes); (0, ()) if it cannot list them."""
    try:
        running = list(nvml.nvmlDeviceGetComputeRunningProcesses(handle))
    except Exception:
        return 0, ()
    described = tuple(GpuProcess(int(p.pid), _process_name(nvml, int(p.pid)), _process_memory(p))
                      for p in running if isinstance(getattr(p, "pid", None), int))
    return len(running), described


def _process_memory(process) -> int | None:
    used = getattr(process, "usedGpuMemory", None)
    # NVML's "not available" is the largest unsigned 64-bit value; pynvml passes it on or maps it to None.
    return None if used is None or used >= 1 << 63 else int(used)


def _process_name(nvml, pid: int) -> str:
    try:
        return _text(nvml.nvmlSystemGetProcessName(pid)).rsplit("/", 1)[-1] or "?"
    except Exception:  # another container's process, or an old driver
        pass
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip() or "?"
    except OSError:
        return "?"


def _probe(nvml, index: int) -> GpuInfo | None:
    """One GPU's snapshot; None if NVML cannot even open it (e.g. fallen off the bus)."""
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = _text(nvml.nvmlDeviceGetName(handle))
    except Exception:
        return None
    total, free, used = _memory(nvml, handle)
    count, processes = _processes(nvml, handle)
    return GpuInfo(
        index=index,
        name=name,
        total_bytes=total,
        free_bytes=free,
        used_bytes=used,
        utilization_pct=_utilization(nvml, handle),
        process_count=count,
        processes=processes,
    )


def get_gpu_usage() -> list[GpuInfo]:
    """A snapshot of every GPU NVML sees, by physical index; [] without NVML."""
    nvml = _pynvml()
    if nvml is None:
        return []
    infos = (_probe(nvml, i) for i in range(gpu_count()))
    return [info for info in infos if info is not None]


def free_memory_bytes(index: int) -> int | None:
    """Free bytes on physical GPU `index`, or None if NVML cannot tell."""
    nvml = _pynvml()
    if nvml is None or not 0 <= index < gpu_count():
        return None
    info = _probe(nvml, index)
    if info is None or info.total_bytes == 0:
        return None
    return info.free_bytes


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}es"


# A GPU counts as busy above this share of its memory in use (the resource file's
# busy_memory_fraction). 5% leaves room for the driver's own few hundred MiB on an idle card.
BUSY_MEMORY_FRACTION = 0.05


def busy_gpus(infos: Iterable[GpuInfo], min_used_fraction: float = BUSY_MEMORY_FRACTION) -> dict[int, str]:
    """GPUs someone else is already using: index -> why we think so, naming the processes.

    A GPU is busy when a process on it holds more than `min_used_fraction` of its memory
    (or does not say how much), when NVML counts processes it cannot describe, or when more
    than `min_used_fraction` of its memory is in use (that catches processes NVML cannot
    list at all: other containers, MPS). A process with less, e.g. a monitoring tool's CUDA
    context, does not make a GPU busy by itself.
    """
    busy: dict[int, str] = {}
    for info in infos:
        limit = min_used_fraction * info.total_bytes
        heavy = [p for p in info.processes if p.used_bytes is None or p.used_bytes > limit]
        reasons = [p.describe() for p in heavy]
        unnamed = info.process_count - len(info.processes)
        if unnamed > 0:
            reasons.append(f"{_plural(unnamed, 'process')} running" if not info.processes
                           else f"{unnamed} more not described")
        if info.used_fraction > min_used_fraction:
            reasons.append(f"{info.used_fraction:.0%} of memory used")
        if reasons:
            busy[info.index] = ", ".join(reasons)
    return busy


# NVIDIA MPS: its control daemon and the CUDA processes of a host meet through named pipes in
# this directory (CUDA_MPS_PIPE_DIRECTORY overrides it, for a daemon of one's own).
MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"


def mps_control_pipe() -> Path:
    """The control pipe that CUDA processes started from this environment connect to, if an
    MPS control daemon listens (they inherit the variable; without one they run as usual)."""
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DIRECTORY) / "control"


def pin_to_device(device_id: int | None) -> dict[str, str]:
    """The environment a worker process needs to see exactly one GPU, or none.

    CPU workers get CUDA_VISIBLE_DEVICES="" so that a CPU role can never create a CUDA
    context on somebody's GPU by accident. GPU workers also get
    CUDA_DEVICE_ORDER=PCI_BUS_ID: CUDA numbers GPUs fastest-first by default, NVML (and
    our resource file) by PCI bus, and the two differ on machines with mixed GPUs.
    """
    if device_id is None:
        return {"CUDA_VISIBLE_DEVICES": ""}
    if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
        raise ValueError(f"device_id must be a GPU index >= 0 or None, got {device_id!r}")
    return {"CUDA_VISIBLE_DEVICES": str(device_id), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
