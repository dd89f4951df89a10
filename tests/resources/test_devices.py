"""NVML probing: the no-driver path (this machine, CI) and a fake NVML for the GPU path."""

import ast
import os
import sys
import types
from pathlib import Path

import pytest

from resources import devices
from resources.devices import GpuInfo, GpuProcess, busy_gpus, pin_to_device

GiB = 1 << 30
NO_PID = (1 << 22) + 1  # above Linux's largest pid_max: no such process


def gpu(index: int, used_gib: float = 0.0, processes: int = 0, total_gib: int = 100) -> GpuInfo:
    used = int(used_gib * GiB)
    total = total_gib * GiB
    return GpuInfo(index, "H200", total, total - used, used, 0, processes)


@pytest.fixture
def fake_pynvml(monkeypatch):
    """Install a stand-in `pynvml` module; the init cache is cleared around the test."""
    devices._nvml_init.cache_clear()

    def install(module) -> None:
        monkeypatch.setitem(sys.modules, "pynvml", module)

    yield install
    devices._nvml_init.cache_clear()


class NVMLError(Exception):
    pass


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801 - the name pynvml uses
    pass


def nvml_with(gpus: list[dict]) -> types.SimpleNamespace:
    """A fake pynvml over `gpus`: dicts with total/used bytes, util (or None), procs (or None)."""

    def unsupported(*_):
        raise NVMLError("Not Supported")

    def util(h):
        return unsupported() if h["util"] is None else types.SimpleNamespace(gpu=h["util"])

    def procs(h):
        if h["procs"] is None:
            return unsupported()
        if isinstance(h["procs"], int):  # processes NVML counts but does not describe
            return [object()] * h["procs"]
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in h["procs"]]

    def process_name(pid):
        if pid != 4242:
            raise NVMLError("Not Found")  # e.g. another container's process
        return b"/usr/bin/python3"

    return types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=lambda i: gpus[i],
        nvmlDeviceGetName=lambda h: b"NVIDIA H200",  # old pynvml returned bytes
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(
            total=h["total"], used=h["used"], free=h["total"] - h["used"]),
        nvmlDeviceGetUtilizationRates=util,
        nvmlDeviceGetComputeRunningProcesses=procs,
        nvmlSystemGetProcessName=process_name,
    )


def test_this_machine_never_raises():
    ok, reason = devices.nvml_status()
    infos = devices.get_gpu_usage()
    assert isinstance(reason, str) and reason
    if ok:
        pytest.skip("NVML works on this machine; the fake-NVML tests cover the rest")
    assert infos == []
    assert devices.gpu_count() == 0
    assert devices.free_memory_bytes(0) is None
    assert reason.startswith("NVML could not initialise") or "not installed" in reason


def test_no_driver_gives_a_reason(fake_pynvml):
    def no_library():
        raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")

    fake_pynvml(types.SimpleNamespace(nvmlInit=no_library))
    ok, reason = devices.nvml_status()
    assert not ok
    assert reason == ("NVML could not initialise: NVMLError_LibraryNotFound: "
                      "NVML Shared Library Not Found: no NVIDIA driver")
    assert devices.get_gpu_usage() == []
    assert devices.gpu_count() == 0
    assert devices.free_memory_bytes(0) is None


def test_pynvml_missing(fake_pynvml):
    fake_pynvml(None)  # a None entry in sys.modules makes `import pynvml` raise ImportError
    assert devices.nvml_status() == (False, "pynvml not installed (pip install nvidia-ml-py)")
    assert devices.get_gpu_usage() == []


def test_init_runs_once_per_process(fake_pynvml):
    calls = []
    module = nvml_with([])
    module.nvmlInit = lambda: calls.append(1)
    fake_pynvml(module)
    for _ in range(3):
        devices.nvml_status()
        devices.get_gpu_usage()
    assert calls == [1]


def test_fake_gpus_are_read_by_physical_index(fake_pynvml):
    fake_pynvml(nvml_with([
        {"total": 100 * GiB, "used": 1 * GiB, "util": 7, "procs": 0},
        {"total": 100 * GiB, "used": 41 * GiB, "util": None, "procs": None},
    ]))
    assert devices.nvml_status() == (True, "ok")
    assert devices.gpu_count() == 2
    first, second = devices.get_gpu_usage()
    assert first == GpuInfo(0, "NVIDIA H200", 100 * GiB, 99 * GiB, 1 * GiB, 7, 0)
    # Unsupported queries degrade to None / 0 instead of failing the whole probe.
    assert (second.index, second.utilization_pct, second.process_count) == (1, None, 0)
    assert devices.free_memory_bytes(1) == 59 * GiB
    assert devices.free_memory_bytes(2) is None


@pytest.mark.parametrize("infos, expected", [
    ([], {}),
    ([gpu(0), gpu(1, used_gib=0.5)], {}),  # the driver's own few hundred MiB is not "busy"
    ([gpu(0, processes=3)], {0: "3 processes running"}),
    ([gpu(0, processes=1)], {0: "1 process running"}),
    ([gpu(0), gpu(2, used_gib=41)], {2: "41% of memory used"}),
    ([gpu(5, used_gib=50, processes=2)], {5: "2 processes running, 50% of memory used"}),
    ([GpuInfo(0, "SoC", 0, 0, 0, None, 0)], {}),  # memory info unsupported: no division by 0
])
def test_busy_gpus(infos, expected):
    assert busy_gpus(infos) == expected


def test_busy_gpus_threshold():
    assert busy_gpus([gpu(0, used_gib=3)], min_used_fraction=0.01) == {0: "3% of memory used"}
    assert busy_gpus([gpu(0, used_gib=3)], min_used_fraction=0.05) == {}


def test_processes_are_named_with_their_memory(fake_pynvml):
    fake_pynvml(nvml_with([{"total": 100 * GiB, "used": 31 * GiB, "util": 90,
                            "procs": [(4242, 30 * GiB), (os.getpid(), 2**64 - 1), (NO_PID, 0)]}]))
    [info] = devices.get_gpu_usage()
    # Where NVML cannot name a process, /proc does (this test's own process), else "?"; NVML's
    # "not available" memory value is None.
    own = Path(f"/proc/{os.getpid()}/comm").read_text().strip()
    assert info.processes == (GpuProcess(4242, "python3", 30 * GiB), GpuProcess(os.getpid(), own, None),
                              GpuProcess(NO_PID, "?", 0))
    assert info.process_count == 3
    assert busy_gpus([info]) == {0: f"pid 4242 (python3) uses 30.0 GiB, pid {os.getpid()} ({own}) memory not "
                                    "reported, 31% of memory used"}


def test_a_small_process_alone_does_not_make_a_gpu_busy():
    monitor = GpuInfo(0, "H200", 100 * GiB, 99 * GiB, 1 * GiB, 0, 1, (GpuProcess(9, "dcgm", 1 * GiB),))
    assert busy_gpus([monitor]) == {}
    assert busy_gpus([monitor], min_used_fraction=0.005) == {0: "pid 9 (dcgm) uses 1.0 GiB, 1% of memory used"}


def test_exported_from_resources():
    import resources

    assert resources.get_gpu_usage is devices.get_gpu_usage and resources.pin_to_device is pin_to_device
    assert {"get_gpu_usage", "pin_to_device", "GpuInfo", "GpuProcess"} <= set(resources.__all__)


def test_pin_to_device():
    assert pin_to_device(None) == {"CUDA_VISIBLE_DEVICES": ""}
    assert pin_to_device(3) == {"CUDA_VISIBLE_DEVICES": "3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    for bad in (-1, True, "3"):
        with pytest.raises(ValueError):
            pin_to_device(bad)


def test_pynvml_is_imported_only_inside_functions():
    tree = ast.parse(Path(devices.__file__).read_text())
    top_level = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = {alias.name for node in top_level for alias in node.names}
    assert "pynvml" not in names
