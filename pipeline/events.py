"""What the training tells the scheduler, through Dask's event log.

The driver publishes one message per step (the step record and a few decoded samples);
the driver and the workers publish scaling, OOM-backoff and fault events as they happen.
The scheduler keeps them (pipeline.monitor) for the RL dashboard page and `/metrics`.
Everything here works on a worker (inside a task) and on the driver, and never raises into
the training: a lost message costs a point on a plot, an exception would cost the run.
Imports only Dask (and the role names), so both the worker side and the driver side may use it.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from resources.config import ROLES

logger = logging.getLogger("dask_rl")

STEPS = "dask-rl-step"        # one message per training step, from the driver
EVENTS = "dask-rl-event"      # scaling, OOM backoff, faults: {"kind", "reason", ...}
WORKERS = "dask-rl-worker"    # a role worker loaded its model: where it runs, which devices
TEXT_LIMIT = 400              # characters kept of a prompt, a response or a reason


def emit(kind: str, reason: str, *, client: Any = None, **fields: Any) -> None:
    """Publish one event ("scale", "adaptive", "oom-backoff", "fault", ...) with its reason.

    Inside a task it goes out through the worker, and names its role (the scheduler adds
    the worker's address as "worker"); elsewhere through `client`, or the default client.
    Fields must be plain values.
    """
    msg = {"kind": kind, "reason": shorten(str(reason)), "time": time.time(), **plain(fields)}
    worker = _current_worker()
    if worker is not None:
        msg.setdefault("role", role_of(worker.state.total_resources))
    publish(EVENTS, msg, client=client, worker=worker)


def publish(topic: str, msg: dict, *, client: Any = None, worker: Any = None) -> bool:
    """Log `msg` under `topic` on the scheduler; False (and a debug line) if it could not be sent."""
    try:
        if worker is None:
            worker = _current_worker()
        if worker is not None:
            worker.log_event(topic, msg)  # thread-safe: queued on the worker's batched stream
        else:
            if client is None:
                from distributed import default_client

                client = default_client()
            client.log_event(topic, msg)
        return True
    except Exception as error:  # no scheduler, closing client, unserialisable field: skip it
        logger.debug("dask-rl: could not publish a %s message: %r", topic, error)
        return False


def publish_step(client: Any, run: str, record: dict, samples: list[dict]) -> None:
    """From the driver after each step: the step record (StepRecord.as_dict) and a few samples."""
    samples = [{**s, "prompt": shorten(s.get("prompt", "")), "response": shorten(s.get("response", ""))}
               for s in samples]
    publish(STEPS, plain({"run": run, **record, "samples": samples}), client=client)


def decode_samples(tokenizer, rollout, scores, n: int = 4, components: dict | None = None,
                   row_of: Any = None) -> list[dict[str, Any]]:
    """`n` decoded samples of a batch, spread evenly over its rows: prompt, response, reward,
    each reward's own value (`components`: name -> (B,) tensor, None for NaN) and the fields
    of the sample's row (`row_of`: group id -> a row with `.fields`, or None).

    Rows are taken at even strides rather than the best or worst ones, so what is shown is
    what the batch looks like. Padding is dropped; special tokens (EOS) are not shown.
    """
    rows = len(rollout)
    if rows == 0 or n <= 0:
        return []
    count = min(n, rows)
    picked = sorted({round(k * (rows - 1) / max(count - 1, 1)) for k in range(count)})
    prompt_length = rollout.prompt_length
    samples = []
    for row in picked:
        prompt = rollout.input_ids[row, :prompt_length][rollout.attention_mask[row, :prompt_length].bool()]
        response = rollout.responses[row][rollout.response_mask[row].bool()]
        samples.append({"row": row, "prompt": tokenizer.decode(prompt.tolist(), skip_special_tokens=True),
                        "response": tokenizer.decode(response.tolist(), skip_special_tokens=True),
                        "reward": float(scores[row])})
        if components:
            samples[-1]["rewards"] = {name: _number(values[row]) for name, values in components.items()}
        source = row_of(int(rollout.group_ids[row])) if row_of is not None else None
        if source is not None and source.fields:
            samples[-1]["fields"] = plain(source.fields)
    return samples


def _number(value) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def announce_worker(worker: Any, role: str) -> None:
    """From a role worker once its model is loaded: its role and its devices (physical ids)."""
    import os

    publish(WORKERS, {"address": worker.address, "name": str(worker.name), "role": role,
                      "devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "pid": os.getpid()}, worker=worker)


def role_of(resources: dict) -> str:
    """The role a worker carries: its role resource above 0 ("" if none); an actor worker
    that hosts the rollout (rollout.hosted_by) carries both: "actor+rollout"."""
    return "+".join(str(name) for name, amount in resources.items() if amount and name in ROLES)


def roles_in(label: str) -> list[str]:
    """The roles a role_of label names, first the worker's own: "actor+rollout" -> ["actor",
    "rollout"] ("" -> [""])."""
    return label.split("+")


def shorten(text: str, limit: int = TEXT_LIMIT) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def plain(value: Any) -> Any:
    """`value` as msgpack-safe plain data: str keys, finite floats (NaN/inf -> None), no tensors."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float) or hasattr(value, "item"):
        number = float(value.item() if hasattr(value, "item") else value)
        return number if math.isfinite(number) else None
    return shorten(str(value))


def _current_worker():
    from distributed import get_worker

    try:
        return get_worker()
    except ValueError:  # not inside a task: the driver, or a thread of its own
        return None
