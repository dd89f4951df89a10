"""Train a tiny local model with GRPO on CPU workers, grow a role between runs, keep the model.
Run it from the repository root: python examples/python_api.py"""

import tempfile

from pipeline import HybridTrainer
from pipeline.models import create_tiny_model
from pipeline.rewards import digit_fraction
from resources import load_resource_config


def main() -> None:
    config = load_resource_config("examples/cpu_resources.yaml")  # or examples/resource_config.yaml on 4 GPUs
    output_dir = tempfile.mkdtemp(prefix="dask-rl-example-")
    model_dir = create_tiny_model(f"{output_dir}/tiny-model")   # or a local path, a hub id, a model object
    with HybridTrainer(actor_model=str(model_dir),
                       reward_model=digit_fraction,              # a function, or a reward model
                       config=config, algorithm="grpo",
                       prompts="examples/quickstart_prompts.jsonl",  # .jsonl/.parquet, a datasets.Dataset, a list
                       samples_per_prompt=4, prompts_per_step=8, max_new_tokens=12, actor_lr=1e-3, steps=10,
                       output_dir=output_dir) as trainer:      # closing saves the model and stops the cluster
        history = trainer.train()                               # prints the dashboard link and a progress bar
        for change in trainer.update_resource(component="rollout", workers=2):  # GPUs: device_ids=[2, 4]
            print(change)
        trainer.train(steps=5)
    print(f"reward {history[0].reward_mean:.2f} -> {trainer.history[-1].reward_mean:.2f}; "
          f"the model is in {output_dir}/actor")


if __name__ == "__main__":  # worker processes are spawned and re-import this file: keep the entry point guarded
    main()
