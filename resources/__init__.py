"""What runs where: the resource file, GPU probing, worker plans and the Dask cluster.

    from resources import load_resource_config
    from resources import get_gpu_usage, pin_to_device

`get_gpu_usage()` is a snapshot of every GPU NVML sees (memory, utilisation, the processes
on it with their pid, name and memory; [] without a driver). `pin_to_device(i)` is the
environment that makes a worker process see exactly GPU `i` (None: no GPU at all).
"""

from resources.config import ResourceConfig, ResourceConfigError, RoleSpec
from resources.devices import GpuInfo, GpuProcess, get_gpu_usage, pin_to_device
from resources.validate import load_resource_config, parse_resource_config, with_role

__all__ = ["GpuInfo", "GpuProcess", "ResourceConfig", "ResourceConfigError", "RoleSpec", "get_gpu_usage",
           "load_resource_config", "parse_resource_config", "pin_to_device", "with_role"]
