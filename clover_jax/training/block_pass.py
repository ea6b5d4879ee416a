"""The one training pass: every block of every example denoised in one forward, beside the clean stream.

`stream_pass` runs the model's training layout (`clover_jax.core.streams`): the clean stream
causally, and noisy blocks each in block mode against its example's clean prefix — what
`CloverModel.denoise_logits` computes for one block, for all of them at once (docs/training.md).
`block_diffusion_logits` is the inspection form: the noisy stream's logits for a whole row, the
function the exactness tests compare with `denoise_logits`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.core.errors import FieldError
from clover_jax.core.streams import Streams, make_streams
from clover_jax.nn.model import CloverTransformer, Params, StreamOutput
from clover_jax.training import train_sharding

__all__ = ["block_diffusion_logits", "differentiable", "stream_pass", "training_module"]


def differentiable(module: CloverTransformer) -> CloverTransformer:
    """`module` with its routed experts in a form reverse-mode differentiation goes through
    (`KernelChoice.for_training`): on GPU and TPU the grouped matmuls, whose backward pass is
    grouped matmuls too; on CPU the expert loop with its written-out backward
    (`clover_jax.nn.expert_dispatch`), or the grouped form, interpreted, when the module's choice
    asks for it (`moe="pallas"`). Both compute only the routed pairs; the "dense" form (every
    expert on every token) is differentiable too but costs experts/top_k times the FLOPs: measured
    7.7x slower for the tiny models' 8 experts, top-2, on 2,048 tokens, and 32x the routed FLOPs at
    Clover-35B's 256 experts, top-8."""
    return module.clone(kernels=module.kernels.for_training())


def training_module(module: CloverTransformer, remat: str | bool = "none", *,
                    offload_base: bool = False) -> CloverTransformer:
    """The module a training pass runs: differentiable experts, layer groups scanned over the
    canonical (stacked) parameters, so compile time does not grow with depth; `remat`
    (`clover_jax.nn.remat.REMAT`): what the backward pass recomputes instead of keeping;
    `offload_base`: the stacked layer parameters arrive in host memory and each layer copies its
    own to the chip (`FinetuneConfig.offload_base`; needs the module's mesh)."""
    to_device = None
    if offload_base:
        if module.mesh_sharding is None:
            raise ValueError("offload_base needs a mesh: the base's memory kind is part of its sharding")
        to_device = functools.partial(train_sharding.layer_to_device, module.mesh_sharding)
    return differentiable(module).clone(layer_loop="scan", remat=remat, params_from_host=to_device)


def stream_pass(module: CloverTransformer, params: Params, clean_ids: jax.Array, noisy_blocks: jax.Array,
                streams: Streams, *, block_size: int, coreset: bool, coreset_top_p: Any,
                router_stats: bool = False) -> StreamOutput:
    """One training forward. clean_ids: int [b, L]; noisy_blocks: int [b, N, block_size], block n
    the noisy copy of clean block `streams.block_index[:, n]`; params: canonical (stacked) layout.
    With `router_stats`, the output carries each MoE layer's `RouterStats`."""
    batch = clean_ids.shape[0]
    ids = jnp.concatenate([clean_ids, noisy_blocks.reshape(batch, -1)], axis=1)
    apply = functools.partial(module.apply, {"params": params}, ids, None, coreset=coreset,
                              coreset_top_p=coreset_top_p, streams=streams, block_size=block_size)
    if router_stats:
        return apply(mutable=["intermediates"])[0]
    return apply()


@functools.partial(jax.jit, static_argnames=("module", "block_size", "coreset"))
def _noisy_logits(module, params, clean_ids, noisy_blocks, segment, *, block_size, coreset, coreset_top_p):
    blocks = noisy_blocks.shape[1]
    streams = make_streams(segment, jnp.broadcast_to(jnp.arange(blocks), noisy_blocks.shape[:2]), block_size)
    out = stream_pass(module, params, clean_ids, noisy_blocks, streams, block_size=block_size, coreset=coreset,
                      coreset_top_p=coreset_top_p)
    noisy = out.hidden[:, clean_ids.shape[1]:]
    return jnp.einsum("bth,vh->btv", noisy, out.head, preferred_element_type=jnp.float32)


def block_diffusion_logits(model, clean_ids, noisy_ids, block_size: int, *, segment_ids=None,
                           coreset: bool | None = None, coreset_top_p: float | None = None,
                           params: Params | None = None) -> jax.Array:
    """The noisy stream's logits of the one training pass, for inspection and tests.

    model: a `CloverModel`; clean_ids, noisy_ids: int [b, L]; segment_ids: int [b, L], the example
    of each row in a packed row (0: padding, e.g. left padding), None: each row one example. Each
    example starts at a multiple of `block_size` from the row's first real row. coreset /
    coreset_top_p: the config's when None; params: the model's when None (canonical layout).
    returns float32 [b, L, V]: row i of example e equals `model.denoise_logits` on e alone, with
    e's clean tokens before i's block as the prefix and e's noisy block as the block.
    """
    clean, noisy = np.asarray(clean_ids), np.asarray(noisy_ids)
    if clean.ndim != 2 or clean.shape != noisy.shape:
        raise ValueError(f"clean_ids and noisy_ids must be int [batch, length] of one shape, got {clean.shape} "
                         f"and {noisy.shape}")
    for name, ids in (("clean_ids", clean), ("noisy_ids", noisy)):
        model.check_token_ids(ids, name)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise FieldError("block_size", f"block_size must be a positive int, got {block_size!r}")
    batch, length = clean.shape
    segment = np.ones_like(clean, np.int32) if segment_ids is None else np.asarray(segment_ids, np.int32)
    if segment.shape != clean.shape:
        raise ValueError(f"segment_ids must have the shape of clean_ids {clean.shape}, got {segment.shape}")
    # Each row is shifted so that its first example starts at a block boundary; padding wraps to the end.
    shift = np.asarray([int(np.argmax(row > 0)) % block_size if np.any(row > 0) else 0 for row in segment])
    padded = -(-length // block_size) * block_size
    lay_out = lambda array: np.stack([np.pad(np.roll(row, -s), (0, padded - length)) for row, s in zip(array, shift,
                                                                                                         strict=True)])
    clean, noisy, segment = lay_out(clean), lay_out(noisy), lay_out(segment)
    starts = (segment > 0) & (segment != np.pad(segment[:, :-1], ((0, 0), (1, 0)), constant_values=-1))
    misplaced = np.argwhere(starts & (np.arange(padded) % block_size != 0))
    if len(misplaced):
        row, column = misplaced[0]
        raise ValueError(f"row {row}: the example starting at row position {(column + shift[row]) % padded} does "
                         f"not start at a multiple of block_size={block_size} after the row's first example")
    enabled = model.config.moe_block_coreset_enabled if coreset is None else bool(coreset)
    top_p = model.config.moe_block_coreset_top_p if coreset_top_p is None else float(coreset_top_p)
    logits = _noisy_logits(training_module(model.module), model.params if params is None else params,
                           jnp.asarray(clean), jnp.asarray(noisy.reshape(batch, -1, block_size)), jnp.asarray(segment),
                           block_size=block_size, coreset=enabled, coreset_top_p=jnp.float32(top_p))
    # Undo the shift: row p of the input is row (p - shift) mod length of the laid-out row.
    return jnp.asarray(np.stack([np.roll(row[:length], s, axis=0) for row, s in zip(np.asarray(logits), shift,
                                                                                   strict=True)]))
