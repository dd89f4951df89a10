"""The rollout role: generates responses with the newest policy weights it was handed."""

from __future__ import annotations

import uuid

import torch

from pipeline import weights
from pipeline.records import GenerationRequest, Rollout
from pipeline.roles.host import resolve_device, role_state, settle_heap

FETCH_CHECK_SECONDS = 5.0   # how often a snapshot fetch checks that its publisher is still there


class RolloutRole:
    """Lives on a rollout worker: an engine plus the policy version it currently holds.

    With `hosted_by` ("actor": `rollout: {hosted_by: actor}`) it lives in that role's worker
    process instead, and its engine runs on a twin of the actor's module that shares its
    tensors (models.sharing_twin): one copy of the weights on the device, updated in place by
    each optimizer step, so a sync only notes the version. The engine is built by the first
    task, once the actor's model is loaded (built again if the actor replaced its model:
    after a resize or a recovery).
    """

    def __init__(self, model_dir: str, *, device: str = "auto", engine: str = "hf", dtype: str = "float32",
                 engine_args: dict | None = None, hosted_by: str | None = None):
        from pipeline.models import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
        # decode: the engines read response text to honour a request's stop strings.
        self._ids = {"pad_id": tokenizer.pad_token_id, "eos_id": tokenizer.eos_token_id, "decode": tokenizer.decode}
        self._kind, self._engine_args, self.hosted_by = engine, dict(engine_args or {}), hosted_by
        self._engine = self._host_model = self._worker = None
        if hosted_by is None:
            device = resolve_device(device)
            if engine == "vllm":
                from pipeline.engines.vllm import VLLMEngine

                self._engine = VLLMEngine(model_dir, dtype=dtype, **self._ids, **self._engine_args)
            else:
                from pipeline.models import load_causal_lm

                self._engine = self._build_engine(load_causal_lm(model_dir, device=device, dtype=getattr(torch, dtype)),
                                                  device)
        self.version = 0  # the weights in model_dir are version 0
        self._slot_counts: set[int] = set()   # decode shapes the engine has compiled

    def _build_engine(self, model, device: str, **fixed):
        if self._kind == "cuda_graph":
            from pipeline.engines.cuda_graph import CudaGraphEngine

            return CudaGraphEngine(model, device=device, **self._ids, **{**self._engine_args, **fixed})
        from pipeline.engines.hf import HFEngine

        return HFEngine(model, device=device, **self._ids, **fixed)

    def bind_worker(self, worker) -> None:
        """RoleHost hands over the worker this role lives on (where a hosted rollout finds
        its host, from tasks and from `client.run` alike)."""
        self._worker = worker

    @property
    def engine(self):
        if self.hosted_by is not None:
            trainer = role_state(self.hosted_by, self._worker).trainer
            if trainer.model is not self._host_model:   # first use, or the host rebuilt its model
                from pipeline.models import sharing_twin

                if self._engine is not None:   # the old engine, its graphs and caches go first:
                    self._engine = self._host_model = None   # generate froze them with the heap,
                    settle_heap()                            # so only a thawing collection frees them
                # Fusing would copy the projections into tensors the updates never reach; the
                # slots are planned in what the host's next update leaves.
                fixed = {"fuse_projections": False} if self._kind == "cuda_graph" else {}
                self._engine = self._build_engine(sharing_twin(trainer.model), trainer.device,
                                                  reserve=trainer.update_reserve_bytes, **fixed)
                self._host_model, self._slot_counts = trainer.model, set()
        return self._engine

    def generate(self, request: GenerationRequest) -> Rollout:
        rollout = self.engine.generate(request, self.version)
        # A request that met a slot count for the first time compiled its decode graph: the
        # objects that keeps alive leave later full garbage collections (host.settle_heap;
        # nothing was replaced, so the heap frozen before stays frozen).
        met = set(getattr(self.engine, "last_stats", {}).get("step_ms", {}))
        if not met <= self._slot_counts:
            self._slot_counts |= met
            settle_heap(thaw=False)
        return rollout

    def sync(self, handle: weights.WeightHandle | None, snapshot: bytes | None = None) -> None:
        """Load `handle`'s weights unless this worker already holds that version."""
        if self.hosted_by is not None:
            # The engine reads the host's parameters, which hold at least `handle`'s version
            # (this task was submitted after the update that published it): the newest
            # update this process applied is the version the rollout samples from.
            self.version = max(self.version, 0 if handle is None else handle.version,
                               role_state(self.hosted_by, self._worker).trainer.version)
            return
        if handle is None or handle.version == self.version:
            return
        if snapshot is None and handle.transport != "cuda_ipc" and (
                handle.transport == "dask" or not weights.is_local(handle)):
            snapshot = _fetch_through_dask(handle)
        self.engine.load_state_dict(weights.receive(handle, snapshot))
        self.version = handle.version
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # What receiving took (a host snapshot's staging copy, IPC mappings) goes back to
            # the GPU, not into this process's cache: co-located roles need that memory.
            torch.cuda.empty_cache()


def _fetch_through_dask(handle: weights.WeightHandle) -> bytes:
    """The fallback for a reader on another host: the snapshot's bytes, worker to worker
    from the publishing actor worker (never through the scheduler)."""
    from distributed import worker_client

    with worker_client() as client:  # secedes: this thread waits without holding a slot
        future = client.submit(weights.fetch_snapshot, handle, resources={"actor": 1}, workers=[handle.address],
                               key=f"actor-fetch-snapshot-v{handle.version}-{uuid.uuid4().hex[:8]}", pure=False)
        # Only that worker holds the snapshot: once it is gone the task can never run, and a
        # plain wait would hold this task (and its worker's engine) forever.
        while True:
            try:
                return future.result(timeout=FETCH_CHECK_SECONDS)
            except TimeoutError:
                if handle.address not in client.scheduler_info(n_workers=-1)["workers"]:
                    future.cancel()
                    raise RuntimeError(f"weights v{handle.version} were published by actor worker {handle.address}, "
                                       f"which has left the cluster; a newer version replaces them") from None


def generate(request: GenerationRequest, handle: weights.WeightHandle | None,
             snapshot: bytes | None = None) -> Rollout:
    """Task: sample `request` with the policy of version `handle.version`."""
    role = role_state("rollout")
    role.sync(handle, snapshot)
    return role.generate(request)


def sync_weights(handle: weights.WeightHandle | None) -> int:
    """Task: load `handle`'s weights now (a joining worker warms up before its first batch).

    While the worker started, training went on: when `handle`'s version has been replaced
    by newer ones and deleted, the worker keeps what it has, and its first generate task
    brings the version it needs."""
    role = role_state("rollout")
    try:
        role.sync(handle)
    except FileNotFoundError:
        pass
    return role.version


def policy_version() -> int:
    """Task: the version this rollout worker holds (for tests and reports)."""
    return role_state("rollout").version
