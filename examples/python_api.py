"""The README's Python example: load the resource file, build the trainer, train (GRPO, CPU)."""

from pipeline import HybridTrainer
from pipeline.models import create_tiny_model
from pipeline.rewards import digit_fraction
from resources import load_resource_config


def main() -> None:
    config = load_resource_config("examples/cpu_resources.yaml")
    model_dir = create_tiny_model("/tmp/dask-rl-tiny")          # or a local path / hub id / model object
    trainer = HybridTrainer(actor_model=model_dir, reward_model=digit_fraction, config=config,
                            algorithm="grpo", prompts="examples/quickstart_prompts.jsonl",
                            samples_per_prompt=4, prompts_per_step=8, max_new_tokens=12,
                            actor_lr=1e-3, steps=10)
    history = trainer.train()                                    # prints the dashboard link and a progress bar
    for change in trainer.update_resource(component="rollout", workers=2):   # grow a role between runs
        print(change)
    trainer.train(steps=5)
    print(f"reward {history[0].reward_mean:.2f} -> {trainer.history[-1].reward_mean:.2f}")
    trainer.close()


if __name__ == "__main__":  # worker processes are spawned: keep the entry point guarded
    main()
