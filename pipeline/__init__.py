"""dask-rl: RL post-training as a pipeline of Dask futures on role-tagged workers."""

__version__ = "0.1.0"
