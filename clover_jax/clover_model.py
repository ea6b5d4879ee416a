"""`CloverModel`: the user-facing handle on a loaded checkpoint (spec §6)."""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.config import CloverConfig
from clover_jax.model import CloverTransformer, Params

logger = logging.getLogger(__name__)


class CloverModel:
    """A Clover / Qwen3.5-MoE text model: config, parameters and jitted entry points.

    Parameters are an explicit pytree (`model.params`); the methods are thin validated wrappers
    around pure jitted functions of `(params, inputs)`.
    """

    def __init__(self, config: CloverConfig, params: Params, dtype: Any):
        self.config = config
        self.params = params
        self.dtype = jnp.dtype(dtype)
        self.module = CloverTransformer(config, self.dtype)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        dtype: Any = None,
        mesh: jax.sharding.Mesh | None = None,
        name_map: dict[str, str] | None = None,
        progress: bool = True,
    ) -> "CloverModel":
        """Load a Hugging Face layout checkpoint directory.

        dtype: parameter and activation dtype; None keeps the checkpoint's (e.g. bfloat16).
        mesh: place every parameter replicated on this mesh (None: the default device).
        name_map: checkpoint tensor name -> expected name, for checkpoints whose names differ.
        """
        from weights.loader import load_params  # weights depends on clover_jax, not the reverse

        config = CloverConfig.from_pretrained(path)
        sharding_for = None
        if mesh is not None:
            replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            sharding_for = lambda path, shape: replicated
        params, report = load_params(path, config, dtype=dtype, name_map=name_map,
                                     sharding_for=sharding_for, progress=progress)
        return cls(config, params, report.dtype)

    def forward(self, input_ids) -> jax.Array:
        """Causal logits (spec §1). input_ids: int [batch, tokens] -> float32 [batch, tokens, vocab]."""
        input_ids = self._check_token_ids(input_ids, "input_ids")
        positions = jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)
        return _causal_logits(self.module, self.params, jnp.asarray(input_ids), positions)

    def _check_token_ids(self, ids, name: str) -> np.ndarray:
        array = np.asarray(ids)
        if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] < 1:
            raise ValueError(f"{name} must be a non-empty int array [batch, tokens], got shape {array.shape}")
        if not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"{name} must hold integer token ids, got dtype {array.dtype}")
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= self.config.vocab_size:
            raise ValueError(f"{name} holds ids in [{low}, {high}], outside the vocabulary "
                             f"[0, {self.config.vocab_size})")
        if array.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"{name} has {array.shape[1]} tokens, more than max_position_embeddings="
                             f"{self.config.max_position_embeddings}")
        return array.astype(np.int32)


@functools.partial(jax.jit, static_argnums=0)
def _causal_logits(module: CloverTransformer, params: Params, input_ids: jax.Array, positions: jax.Array):
    logits, _ = module.apply({"params": params}, input_ids, positions)
    return logits
