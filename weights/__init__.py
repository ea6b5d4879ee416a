"""Checkpoint loading: safetensors files -> the parameter pytree of `clover_jax`."""

from weights.checkpoint_files import CheckpointError
from weights.loader import LoadReport, load_params

# Imported on first use: orbax-checkpoint adds most of a second to `import weights`.
_ORBAX_EXPORTS = ("convert_to_orbax", "is_orbax_checkpoint", "load_orbax_params")

__all__ = ["CheckpointError", "LoadReport", "load_params", *_ORBAX_EXPORTS]


def __getattr__(name: str):
    if name in _ORBAX_EXPORTS:
        from weights import orbax_checkpoint

        return getattr(orbax_checkpoint, name)
    raise AttributeError(f"module 'weights' has no attribute {name!r}")
