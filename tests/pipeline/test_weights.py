"""Weight sync paths (shm file, Dask bytes, broadcast channel, CUDA IPC) keep bf16 bit for bit."""

from __future__ import annotations

import functools
import hashlib
import logging
import pickle
import subprocess
import sys

import cloudpickle
import pytest
import torch
from distributed import Client, Nanny, Scheduler, SpecCluster

from pipeline import weights
from pipeline.fleet.groups import free_port
from pipeline.roles import sync
from pipeline.roles.host import RoleHost, plugin_name

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the helpers below run on the workers


def _state(seed: int) -> dict[str, torch.Tensor]:
    """float32, bfloat16 and float16 tensors, a tied pair, an overlapping view, a scalar, an empty one."""
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(33, 8, generator=g).to(torch.bfloat16)
    base = torch.randn(6, 4, generator=g)
    return {
        "embed.weight": embed, "lm_head.weight": embed,                  # tied
        "norm.weight": torch.randn(8, generator=g).to(torch.bfloat16),
        "mlp.weight": base, "mlp.row": base[2],                          # a view, not a tie
        "half.weight": torch.randn(5, 3, generator=g).to(torch.float16),
        "step": torch.tensor(7.5), "empty": torch.empty(0, 3, dtype=torch.bfloat16),
        # bf16 values whose low bits a float round trip would lose: NaN payloads, -0, subnormals
        "odd": torch.tensor([0x7FC1, -0x8000, 0x0001, 0x7F80, -0x0081], dtype=torch.int16).view(torch.bfloat16),
    }


def _digests(state: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """Dtype, shape and a hash of the raw bytes of every entry."""
    def raw(t):
        return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

    return {name: (str(t.dtype), tuple(t.shape), hashlib.sha1(raw(t)).hexdigest()) for name, t in state.items()}


def _assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        got_bytes, want_bytes = (t.contiguous().reshape(-1).view(torch.uint8) for t in (got[name], want[name]))
        assert torch.equal(got_bytes, want_bytes), name


def test_shm_round_trip_is_bit_exact_and_keeps_ties(tmp_path):
    state = _state(0)
    handles = [weights.publish(state, version, tmp_path, keep=2) for version in (1, 2, 3)]
    assert handles[-1].transport == "shm" and weights.is_local(handles[-1])
    assert not weights.is_local(handles[0])          # older than `keep`: deleted
    got = weights.receive(handles[-1])
    _assert_bit_exact(got, state)
    assert got["lm_head.weight"] is got["embed.weight"]   # tied on arrival, stored once


def test_dask_fallback_bytes_are_bit_exact(tmp_path):
    state = _state(1)
    handle = weights.publish(state, 4, tmp_path, transport="dask")
    data = weights.fetch_snapshot(handle)
    _assert_bit_exact(weights.load_snapshot_bytes(data), state)
    _assert_bit_exact(weights.receive(handle, snapshot=data), state)


def test_layout_buckets_split_by_dtype_and_size():
    state = _state(2)
    layout = weights.tensor_layout(state)
    assert ("lm_head.weight", (33, 8), "tied:embed.weight") in layout
    buckets = weights._buckets(layout, limit=200)
    assert all(len({layout[i][2] for i in indices}) == 1 for _, indices in buckets)
    assert sorted(i for _, indices in buckets for i in indices) == [i for i, e in enumerate(layout)
                                                                    if not e[2].startswith("tied:")]


# -- two worker processes --------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair():
    """One actor and one rollout worker process, one thread each."""
    workers = {name: {"cls": Nanny, "options": {"nthreads": 1, "resources": {role: 1}, "memory_limit": 0,
                                                "silence_logs": logging.WARNING}}
               for name, role in (("actor-0", "actor"), ("rollout-0", "rollout"))}
    cluster = SpecCluster(workers=workers, scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}},
                          silence_logs=logging.WARNING)
    client = Client(cluster)
    client.wait_for_workers(2, timeout=120)
    info = client.scheduler_info(n_workers=-1)["workers"]
    address = {w["name"]: addr for addr, w in info.items()}
    yield client, address["actor-0"], address["rollout-0"]
    client.close()
    cluster.close()


def _init_method(client, address) -> str:
    return f"tcp://127.0.0.1:{client.run(free_port, workers=[address])[address]}"


def test_dask_fallback_between_workers(pair, tmp_path):
    client, actor_addr, rollout_addr = pair
    handle = weights.publish(_state(3), 1, tmp_path, transport="dask")
    data = client.submit(weights.fetch_snapshot, handle, workers=[actor_addr], pure=False)
    remote = client.submit(lambda b: _digests(weights.load_snapshot_bytes(b)), data, workers=[rollout_addr])
    assert remote.result(timeout=60) == _digests(_state(3))


def _send(info: sync.ChannelInfo, seed: int, version: int) -> tuple[int, bool]:
    channel, opened = sync.open_channel(info)
    return channel.send(_state(seed), version), opened


def _receive(info: sync.ChannelInfo, layout, version: int) -> tuple[dict, bool, bool]:
    channel, opened = sync.open_channel(info)
    state = channel.receive(layout, "cpu", version)
    return _digests(state), opened, state["lm_head.weight"] is state["embed.weight"]


def test_broadcast_channel_between_two_processes(pair):
    client, actor_addr, rollout_addr = pair
    sender, receiver = sync.channel_infos(_init_method(client, actor_addr), 1, "gloo", timeout_seconds=60)
    layout = weights.tensor_layout(_state(0))
    for version, seed in ((1, 10), (2, 11)):   # two versions over the one channel
        sent = client.submit(_send, sender, seed, version, workers=[actor_addr], pure=False)
        got = client.submit(_receive, receiver, layout, version, workers=[rollout_addr], pure=False)
        (nbytes, sender_opened), (digests, receiver_opened, tied) = sent.result(60), got.result(60)
        assert digests == _digests(_state(seed))
        assert tied
        assert sender_opened == receiver_opened == (version == 1)   # only the first sync meets
        assert nbytes == sum(t.numel() * t.element_size() for n, t in _state(seed).items() if n != "lm_head.weight")
    assert sorted(client.run(sync.close_channels, workers=[actor_addr, rollout_addr]).values()) == [1, 1]


def _perturb(seed: int) -> dict:
    from pipeline.roles.host import role_state

    model = role_state("actor").trainer.model
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator).to(p.dtype) * 0.01)
    return _digests(model.state_dict())


def _rollout_digests() -> dict:
    from pipeline.roles.host import role_state

    return _digests(role_state("rollout").engine.model.state_dict())


def test_sync_tasks_load_actor_weights_into_rollout(pair, tiny_model):
    from pipeline.roles.actor import ActorRole
    from pipeline.roles.rollout import RolloutRole, policy_version

    client, actor_addr, rollout_addr = pair
    for role, recipe in (("actor", functools.partial(ActorRole, tiny_model, device="cpu", lr=1e-3, strategy="ddp",
                                                     dtype="bfloat16")),
                         ("rollout", functools.partial(RolloutRole, tiny_model, device="cpu", dtype="bfloat16"))):
        client.register_plugin(RoleHost(role, recipe, torch_threads=1), name=plugin_name(role))
    layout = client.submit(sync.weight_layout, resources={"actor": 1}, pure=False).result(120)
    assert {dtype for _, _, dtype in layout} >= {"bfloat16"}
    init_method = _init_method(client, actor_addr)
    for version in (1, 2):
        want = client.submit(_perturb, version, resources={"actor": 1}, pure=False).result(60)
        futures = sync.broadcast_weights(client, version, layout, actor_addr, [rollout_addr], init_method, "gloo",
                                         timeout_seconds=60)
        sent, received = client.gather(futures)
        assert sent["opened"] == received["opened"] == (version == 1)
        assert client.submit(_rollout_digests, resources={"rollout": 1}, pure=False).result(60) == want
        assert client.submit(policy_version, resources={"rollout": 1}, pure=False).result(60) == version
    client.run(sync.close_channels, workers=[actor_addr, rollout_addr])
    for role in ("actor", "rollout"):
        client.unregister_worker_plugin(plugin_name(role))


# -- GPU -------------------------------------------------------------------------------------

def _child(body: str) -> str:
    """A program for a child process: the helpers above, then `body`."""
    import inspect

    head = "import hashlib, json, pickle, sys\nimport torch\nfrom pipeline import weights\n"
    return head + inspect.getsource(_state) + inspect.getsource(_digests) + body


_IPC_CHILD = """
handle = pickle.loads(sys.stdin.buffer.read())
state = weights.receive(handle)
print(json.dumps({"digests": _digests(state), "tied": state["lm_head.weight"] is state["embed.weight"],
                  "device": str(state["embed.weight"].device)}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_is_bit_exact_in_another_process():
    import json

    state = {name: t.cuda() for name, t in _state(5).items()}
    state["lm_head.weight"] = state["embed.weight"]
    handle = weights.publish(state, 1, "", transport="cuda_ipc")
    assert len(pickle.dumps(handle)) < 64_000   # travels as a Dask future
    for t in state.values():   # later optimizer steps must not show in what was published
        t.add_(1)
    local = weights.receive(handle)   # the publishing process clones its own buffers
    assert _digests(local) == _digests(_state(5))
    child = subprocess.run([sys.executable, "-c", _child(_IPC_CHILD)], input=pickle.dumps(handle),
                           capture_output=True, timeout=120)
    assert child.returncode == 0, child.stderr.decode()[-3000:]
    result = json.loads(child.stdout.decode().strip().splitlines()[-1])
    assert result["digests"] == json.loads(json.dumps(_digests(_state(5))))
    assert result["tied"] and result["device"].startswith("cuda")


_IPC_READER = """
# One long-lived reader, like a rollout worker: a pickled handle per line of stdin (hex),
# one line of digests back for each, its cloned tensors kept so the mappings stay open.
kept = []
for line in sys.stdin:
    state = {n: t.clone() for n, t in weights.receive(pickle.loads(bytes.fromhex(line.strip()))).items()}
    kept.append(state)
    print(json.dumps(_digests(state)), flush=True)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_keeps_keep_versions_in_reused_memory_and_each_reads_exactly():
    """Versions 1..5 with keep=2: the GPU holds two copies at any time, version 3 is written
    into version 1's memory (and so on), and a reader that opened the earlier ones reads each
    new version bit for bit: the mapping it already holds shows the new bytes."""
    import json

    weights._PUBLISHED.clear()   # what an earlier test published in this process
    reader = subprocess.Popen([sys.executable, "-c", _child(_IPC_READER)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pointers, allocated = {}, []
    try:
        for version in range(1, 6):
            state = {name: t.cuda() for name, t in _state(version).items()}
            state["lm_head.weight"] = state["embed.weight"]
            handle = weights.publish(state, version, "", keep=2, transport="cuda_ipc")
            del state
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())
            pointers[version] = [b.data_ptr() for b in weights._PUBLISHED[version]]
            assert sorted(weights._PUBLISHED) == [max(1, version - 1), version][-min(version, 2):]
            reader.stdin.write(pickle.dumps(handle).hex() + "\n")
            reader.stdin.flush()
            got = json.loads(reader.stdout.readline())
            assert got == json.loads(json.dumps(_digests(_state(version)))), f"version {version}"
        assert pointers[3] == pointers[1] and pointers[4] == pointers[2] and pointers[5] == pointers[1]
        assert allocated[1] == allocated[2] == allocated[3] == allocated[4]   # two copies, never three
    finally:
        reader.stdin.close()
        assert reader.wait(timeout=120) == 0, reader.stderr.read()[-3000:]
        weights._PUBLISHED.clear()


_NCCL_CHILD = """
rank = int(sys.argv[1])
channel = weights.BroadcastChannel(sys.argv[2], rank, 2, "nccl", 60)
layout = weights.tensor_layout(_state(0))
for version in (1, 2):
    if rank == 0:
        state = _state(version)
        moved = {id(t): t.cuda() for t in state.values()}   # keep the tie
        channel.send({n: moved[id(t)] for n, t in state.items()}, version)
    else:
        print(json.dumps(_digests(channel.receive(layout, "cuda", version))), flush=True)
channel.close()
"""


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL refuses two ranks on one GPU)")
def test_nccl_broadcast_channel_is_bit_exact():
    import json
    import os

    code, init_method = _child(_NCCL_CHILD), f"tcp://127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(rank), init_method], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={**os.environ, "CUDA_VISIBLE_DEVICES": str(rank)})
             for rank in (0, 1)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1].decode()[-2000:] for o in outs]
    lines = outs[1][0].decode().strip().splitlines()
    for version, line in zip((1, 2), lines[-2:]):
        assert json.loads(line) == json.loads(json.dumps(_digests(_state(version))))
