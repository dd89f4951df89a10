"""What a run keeps: the trained models in Hugging Face format, metrics.jsonl, samples.jsonl
and TensorBoard events, on the shared CPU cluster."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline import weights
from pipeline.models import ValueModel, load_tokenizer
from pipeline.rewards import digit_fraction
from pipeline.trainer import HybridTrainer

SMALL = dict(prompts_per_step=8, max_new_tokens=8, actor_lr=1e-3, critic_lr=1e-3, micro_batch_size=8,
             show_progress=False)


def test_the_trained_models_are_saved_in_hugging_face_format_and_generate(shared_cluster, shared_config,
                                                                          tiny_model, prompts, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = HybridTrainer(tiny_model, digit_fraction, shared_config, algorithm="ppo", prompts=prompts,
                            cluster=shared_cluster, output_dir=str(tmp_path / "run"), steps=2, log_samples=3, **SMALL)
    history = trainer.train()
    published = weights.load_snapshot(trainer.weights)
    on_demand = trainer.save(str(tmp_path / "on-demand"))
    assert set(on_demand) == {"actor", "critic"}
    trainer.close()  # saves <output_dir>/actor and /critic

    for directory in (tmp_path / "on-demand" / "actor", tmp_path / "run" / "actor"):
        model = AutoModelForCausalLM.from_pretrained(directory)
        # The tiny model ties lm_head to the embedding: the saved one is still tied...
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        # ...and holds exactly the last published policy, not the initial weights.
        state = model.state_dict()
        for name, tensor in published.items():
            assert torch.equal(state[name], tensor), name
        tokenizer = load_tokenizer(directory)
        ids = tokenizer(prompts[0], return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        assert out.shape[1] > ids["input_ids"].shape[1]
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert not torch.equal(initial["model.embed_tokens.weight"], published["model.embed_tokens.weight"])
    # The critic comes back with its trained value head (zero-initialised, so nonzero = trained).
    critic = ValueModel(tmp_path / "run" / "critic")
    assert critic.head.weight.abs().sum() > 0

    # metrics.jsonl: a line per step, the figures of the records; samples.jsonl: 3 rows a step
    # whose rewards are what the reward function gives for their text.
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1]
    assert [line["reward"] for line in lines] == [r.reward_mean for r in history]
    assert lines[1]["policy_loss"] == history[1].losses["policy_loss"]
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 0, 0, 1, 1, 1]
    for sample in samples:
        assert sample["prompt"] in prompts
        assert sample["reward"] == pytest.approx(digit_fraction(sample["prompt"], sample["response"]), abs=1e-6)


def test_tensorboard_events_hold_every_step(shared_cluster, shared_config, tiny_model, prompts, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with HybridTrainer(tiny_model, digit_fraction, shared_config, algorithm="grpo", prompts=prompts,
                       cluster=shared_cluster, output_dir=str(tmp_path), steps=2, samples_per_prompt=2,
                       kl_coef=0.0, log_samples=0, **SMALL) as trainer:
        history = trainer.train()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    rewards = events.Scalars("reward")
    assert [e.step for e in rewards] == [0, 1]
    assert [e.value for e in rewards] == pytest.approx([r.reward_mean for r in history])
    assert not (tmp_path / "samples.jsonl").exists()  # log_samples: 0
    assert (tmp_path / "actor" / "config.json").is_file() and not (tmp_path / "critic").exists()  # GRPO: no critic
