"""dask-rl: RL post-training as a pipeline of Dask futures on role-tagged workers.

    from pipeline import HybridTrainer
"""

__version__ = "0.1.0"
__all__ = ["HybridTrainer", "TrainConfig", "__version__"]


def __getattr__(name: str):
    # Lazy: `import pipeline` (and pipeline.__version__) must not pay for torch and Dask.
    if name == "HybridTrainer":
        from pipeline.trainer import HybridTrainer

        return HybridTrainer
    if name == "TrainConfig":
        from pipeline.config import TrainConfig

        return TrainConfig
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
