"""`dask-rl worker`: join a running scheduler as role-tagged workers, from any host.

    dask-rl worker tcp://host-a:8786 --role reward --device-ids 4 5

starts one worker process per GPU (a Nanny with CUDA_VISIBLE_DEVICES=<id>, one thread,
no memory limit, the resource {role: 1}) named "reward-<hostname>-gpu4", the same worker
the trainer starts for a local GPU (launcher.dask_worker_spec). Without --device-ids it
starts `workers` CPU workers, "reward-<hostname>-<k>", which never see a GPU. The role's
model comes from the trainer's plugin once the trainer has registered it, so a worker can
join before or while the training runs. Ctrl-C (or SIGTERM) closes the workers cleanly;
when the scheduler retires them, or the scheduler closes, the command exits.
"""

from __future__ import annotations

import asyncio
import socket

from distributed._signals import wait_for_signals
from distributed.core import rpc

from resources.config import ROLES
from resources.devices import busy_gpus, get_gpu_usage, gpu_count, nvml_status, pin_to_device
from resources.plan import WorkerSpec

__all__ = ["SchedulerUnreachable", "WorkerStartError", "check_scheduler", "role_worker_specs", "start_role_worker",
           "validate_device_ids"]

# Seconds to open a TCP connection to a scheduler: a refused one fails at once, a host that
# does not answer within this is reported as unreachable instead of retried for half a minute.
CONNECT_SECONDS = 5.0


class WorkerStartError(ValueError):
    """A worker request that cannot start; the message names the value and the fix."""


class SchedulerUnreachable(ConnectionError):
    """Nothing answers at a scheduler address; the message names it and the fix."""


def check_scheduler(address: str, timeout: float = CONNECT_SECONDS) -> None:
    """Raise SchedulerUnreachable unless something accepts TCP connections at `address`.

    Dask's own connect retries until its timeout (30 s by default) whatever the cause; a
    plain socket tells "connection refused" apart at once. Non-TCP addresses (ucx://,
    inproc://) are left to Dask.
    """
    from distributed.comm import get_address_host_port, parse_address

    fix = ("Fix: start one with `dask-rl scheduler` (or use the address the trainer printed) and check the host "
           "and port")
    try:
        scheme, _ = parse_address(address)
        host, port = get_address_host_port(address)
    except ValueError as error:
        raise SchedulerUnreachable(f"{address!r} is not a scheduler address ({error}). Fix: write it as "
                                   f"tcp://HOST:PORT, e.g. tcp://127.0.0.1:8786") from None
    if scheme not in ("tcp", "tls"):
        return
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as error:
        reason = (f"no answer within {timeout:.0f}s" if isinstance(error, TimeoutError)
                  else (error.strerror or type(error).__name__).lower())
        raise SchedulerUnreachable(f"no Dask scheduler at {address} ({reason}). {fix}") from None


def validate_role(role: str) -> None:
    if role not in ROLES:
        raise WorkerStartError(f"unknown role {role!r}; roles: {', '.join(ROLES)}")


def validate_device_ids(device_ids: list[int], allow_busy: bool = False) -> None:
    """Raise WorkerStartError unless every id is a GPU of this machine (NVML index) and free."""
    if len(set(device_ids)) != len(device_ids):
        raise WorkerStartError(f"--device-ids {device_ids}: a GPU is listed twice; one worker per GPU")
    ok, reason = nvml_status()
    if not ok:
        raise WorkerStartError(f"--device-ids {device_ids}: this machine has no usable NVIDIA GPU ({reason}). "
                               f"Fix: leave out --device-ids to start a CPU worker")
    count = gpu_count()
    missing = [i for i in device_ids if not 0 <= i < count]
    if missing:
        raise WorkerStartError(f"--device-ids: GPU {missing[0]} does not exist on {socket.gethostname()}; "
                               f"its GPUs are {list(range(count))} (NVML order, as nvidia-smi lists them)")
    busy = busy_gpus(get_gpu_usage())
    taken = {i: busy[i] for i in device_ids if i in busy}
    if taken and not allow_busy:
        gpu, why = next(iter(taken.items()))
        raise WorkerStartError(f"--device-ids: GPU {gpu} is busy ({why}). Fix: pick a free GPU, or pass "
                               f"--allow-busy to share it")


def role_worker_specs(role: str, device_ids: list[int] | None = None, *, workers: int = 1,
                      name: str | None = None, hostname: str | None = None, nthreads: int = 1,
                      taken: set[str] = frozenset()) -> list[WorkerSpec]:
    """The workers one `dask-rl worker` command starts (pure: no Dask, no NVML).

    GPU workers are named "{role}-{host}-gpu{id}", CPU workers "{role}-{host}-{k}" with k
    the first indexes not in `taken` (names already on the scheduler), so a second CPU
    worker command on one host does not collide with the first. `name` replaces the
    prefix; a single worker is then called exactly `name`.
    """
    validate_role(role)
    host = hostname or socket.gethostname().split(".")[0]
    prefix = name or f"{role}-{host}"
    if device_ids:
        names = [prefix if name and len(device_ids) == 1 else f"{prefix}-gpu{i}" for i in device_ids]
        devices: list[int | None] = list(device_ids)
    else:
        if workers < 1:
            raise WorkerStartError(f"--workers {workers}: start at least one worker")
        if name and workers == 1:
            names = [name]
        else:
            free = (k for k in range(len(taken) + workers + 1) if f"{prefix}-{k}" not in taken)
            names = [f"{prefix}-{next(free)}" for _ in range(workers)]
        devices = [None] * len(names)
    return [WorkerSpec(name=n, role=role, device_type="cpu" if d is None else "cuda", device_id=d,
                       env=tuple(pin_to_device(d).items()), nthreads=nthreads)
            for n, d in zip(names, devices)]


async def _names_on(scheduler_address: str, timeout: float, security=None) -> set[str]:
    """Worker names already registered with the scheduler (also checks it is reachable)."""
    connection_args = security.get_connection_args("worker") if security is not None else None
    async with rpc(scheduler_address, timeout=timeout, connection_args=connection_args) as scheduler:
        identity = await asyncio.wait_for(scheduler.identity(), timeout)
    return {str(w.get("name")) for w in identity.get("workers", {}).values()}


async def _serve(scheduler_address: str, specs: list[WorkerSpec], name: str | None, workers: int,
                 role: str, hostname: str | None, timeout: float, host: str | None, security,
                 imports: tuple[str, ...] = ()) -> None:
    from resources.launcher import close_nannies, start_nannies

    try:
        taken = await _names_on(scheduler_address, timeout, security)
    except (OSError, asyncio.TimeoutError) as error:
        reason = str(error) or f"no answer within {timeout:.0f}s"
        raise WorkerStartError(f"could not reach a Dask scheduler at {scheduler_address} ({reason}). Fix: start one "
                               f"with `dask-rl scheduler` (or give the trainer's own scheduler address) and "
                               f"check the host and port") from error
    if specs[0].device_id is None:  # CPU names count up from what the scheduler already has
        specs = role_worker_specs(role, None, workers=workers, name=name, hostname=hostname,
                                  nthreads=specs[0].nthreads, taken=taken)
    clash = [s.name for s in specs if s.name in taken]
    if clash:
        raise WorkerStartError(f"worker name {clash[0]!r} is already taken on {scheduler_address}. Fix: pass "
                               f"--name with another name (is this GPU's worker already running?)")
    try:
        nannies = await start_nannies(scheduler_address, specs, host=host, security=security, imports=imports)
    except Exception as error:  # e.g. a name another host took meanwhile; the worker log says more
        raise WorkerStartError(f"workers {[s.name for s in specs]} failed to join {scheduler_address}: "
                               f"{error!r}") from error
    for spec in specs:
        where = f"GPU {spec.device_id}" if spec.device_id is not None else "CPU"
        print(f"dask-rl: {spec.role} worker {spec.name} ({where}) joined {scheduler_address} as "
              f"{nannies[spec.name].worker_address}", flush=True)

    async def all_finished() -> None:
        await asyncio.gather(*(n.finished() for n in nannies.values()))

    finished = asyncio.ensure_future(all_finished())
    signalled = asyncio.ensure_future(wait_for_signals())
    await asyncio.wait([finished, signalled], return_when=asyncio.FIRST_COMPLETED)
    if signalled.done():
        print(f"dask-rl: closing workers {sorted(nannies)}", flush=True)
        await close_nannies(nannies.values())
    else:
        signalled.cancel()
        print("dask-rl: all workers were retired or the scheduler closed; exiting", flush=True)


def start_role_worker(scheduler_address: str, role: str, device_ids: list[int] | None = None,
                      name: str | None = None, nthreads: int = 1, *, workers: int = 1,
                      allow_busy: bool = False, hostname: str | None = None, timeout: float = 30.0,
                      host: str | None = None, security=None, imports: tuple[str, ...] = ()) -> None:
    """Join `scheduler_address` as `role` workers and block until interrupted or retired.

    `imports`: modules each worker starts importing as its process comes up, as the
    trainer's own workers do (launcher.BackgroundImports; `dask-rl worker` passes the role
    plugins' imports: torch and transformers), so that they load while the worker joins.

    `host`: the interface the workers listen on (None: every interface, so that the
    scheduler and the workers on other hosts reach them); `security`: TLS settings
    (cluster.tls_security) for a `tls://` scheduler.

    Raises WorkerStartError (before anything starts) for an unknown role, a GPU id this
    machine lacks, a busy GPU, a machine without NVML when device ids are given, or a
    scheduler that cannot be reached.
    """
    from resources.cluster import configure_dask

    device_ids = list(device_ids or [])
    specs = role_worker_specs(role, device_ids, workers=workers, name=name, hostname=hostname, nthreads=nthreads)
    if device_ids:
        validate_device_ids(device_ids, allow_busy)
    check_scheduler(scheduler_address)  # after the local checks: a wrong role is named whatever the network
    configure_dask()  # the Nannies hand this config to their workers
    asyncio.run(_serve(scheduler_address, specs, name, workers, role, hostname, timeout, host, security,
                       tuple(imports)))
