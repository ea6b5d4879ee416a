"""Checkpoint loading: safetensors files -> the parameter pytree of `clover_jax`."""

from weights.checkpoint_files import CheckpointError
from weights.loader import LoadReport, load_params

__all__ = ["CheckpointError", "LoadReport", "load_params"]
