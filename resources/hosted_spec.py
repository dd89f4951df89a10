"""A role that runs inside another role's worker processes: parsing its section of the
resource file.

    rollout: {hosted_by: actor, strategy: cuda_graph, cuda_graph_args: {max_batch_size: 128}}

becomes a RoleSpec with `hosted_by` set, on the host's devices and with its worker count:
each of the host's workers carries the role's resource too (resources.plan), and the role's
engine reads the host's parameters in place (pipeline/roles/rollout.py). Pure: no Dask here.
resources.validate calls `parse_hosted_role` for a role section that has a `hosted_by` key,
after the host's section, with its own parser for the errors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from resources.config import HOSTED_ROLE_KEYS, HOSTED_STRATEGIES, HOSTS, RoleSpec

__all__ = ["parse_hosted_role"]

_PLACEMENT_KEYS = ("device_type", "device_ids", "workers", "job_queue", "jobs")


def parse_hosted_role(parser: Any, role: str, raw: Mapping, parsed: Mapping[str, RoleSpec],
                      strategy: Callable[[int, str], str]) -> RoleSpec:
    """The RoleSpec of a hosted role section; `parser` is resources.validate's _Parser (its
    .error makes the one ResourceConfigError naming the key, the value and the fix),
    `parsed` the roles parsed so far (the host among them), `strategy(workers, device_type)`
    parses the role's strategy as for any role."""
    host, path = raw["hosted_by"], f"{role}.hosted_by"
    if host != HOSTS.get(role):
        raise parser.error(path, host, "only the rollout can be hosted, and only by the actor",
                           "write rollout: {hosted_by: actor}, or give the role devices of its own")
    for key in _PLACEMENT_KEYS:
        if key in raw:
            raise parser.error(f"{role}.{key}", raw[key], f"a {role} hosted by the {host} runs on the {host}'s "
                               f"workers and devices", f"remove {key}, or remove hosted_by to give the {role} "
                               f"workers of its own")
    if "max_gpu_memory_gib" in raw:
        raise parser.error(f"{role}.max_gpu_memory_gib", raw["max_gpu_memory_gib"], f"a hosted {role} allocates "
                           f"in the {host}'s processes, under the {host}'s cap", f"remove it, and set "
                           f"{host}.max_gpu_memory_gib for both")
    parser.check_keys(raw, HOSTED_ROLE_KEYS, prefix=f"{role}.")
    spec = parsed[host]   # never on a job queue: the actor's group is rebuilt from local workers
    if spec.strategy == "fsdp":
        raise parser.error(path, host, f"the {host}'s strategy fsdp shards the weights a hosted {role} reads whole",
                           f"set {host}.strategy: ddp (or none on one device), or give the {role} devices of "
                           f"its own")
    chosen = strategy(spec.workers, spec.device_type)
    if chosen not in HOSTED_STRATEGIES:
        raise parser.error(f"{role}.strategy", chosen, f"a hosted {role} reads the {host}'s parameters "
                           f"in place, which only {' and '.join(HOSTED_STRATEGIES)} can",
                           f"use strategy: {' or '.join(HOSTED_STRATEGIES)}, or remove hosted_by to run "
                           f"{chosen} on devices of its own")
    engine_args = parser.cuda_graph_args(role, raw["cuda_graph_args"], chosen) if "cuda_graph_args" in raw else ()
    if dict(engine_args).get("fuse_projections") is True:
        raise parser.error(f"{role}.cuda_graph_args.fuse_projections", True, "fusing copies each layer's "
                           f"projections into new tensors, which the {host}'s updates would never reach",
                           "remove it: a hosted rollout leaves the projections as they are")
    return RoleSpec(role, spec.device_type, spec.device_ids, spec.workers, chosen,
                    cuda_graph_args=engine_args, hosted_by=host)
