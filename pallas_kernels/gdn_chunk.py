"""Chunked gated delta rule (forward) as a Pallas kernel.

Same arguments and results as `clover_jax.nn.gated_delta.chunked_gated_delta_rule`; the math of
one chunk is in `gdn_chunk_step.py`. The columns of the state `S [key_dim, value_dim]` evolve
independently, so the grid is (batch, value head, value-dim tile) and each program carries a
float32 `[key_dim, value_block]` slice of one head's state through the chunks in order:

* GPU driver (Triton): a `fori_loop` over chunks inside the program, the state in registers.
* TPU driver (Mosaic): the chunks are a fourth grid axis marked "arbitrary"; the state lives in
  the final-state output block, which stays in VMEM while the chunk index advances.

Inputs are only reshaped, never transposed: `[batch, tokens, heads, dim]` is viewed as
`[batch, tokens, heads * dim]`, so a head's `[chunk, dim]` tile is a block of that view (a
multiple of 128 lanes wide when dim is 128, as TPU blocks require). The per-token decay and beta
are rearranged to `[batch, value_heads, chunks, chunk]` (small) and kept whole per head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu, triton as pltriton

from pallas_kernels.gdn_chunk_size import CHUNK_SIZE
from pallas_kernels.gdn_chunk_step import gdn_chunk_step
from pallas_kernels.platforms import Variant, per_platform

_F32 = jnp.float32


def _gpu_kernel(query_ref, key_ref, value_ref, decay_ref, beta_ref, initial_ref, out_ref, state_ref,
                *, chunk_size, precision):
    """query_ref, key_ref: [tokens, key_dim]; value_ref, out_ref: [tokens, value_block];
    decay_ref, beta_ref: [chunks, chunk]; initial_ref, state_ref: [key_dim, value_block]."""

    def one_chunk(index, state):
        rows = pl.ds(pl.multiple_of(index * chunk_size, chunk_size), chunk_size)
        load = lambda ref: ref[rows, :].astype(_F32)
        this = pl.ds(index, 1)
        state, out = gdn_chunk_step(state, load(query_ref), load(key_ref), load(value_ref),
                                    decay_ref[this, :], beta_ref[this, :], precision=precision)
        out_ref[rows, :] = out
        return state

    num_chunks = decay_ref.shape[0]
    state_ref[...] = jax.lax.fori_loop(0, num_chunks, one_chunk, initial_ref[...].astype(_F32))


def _tpu_kernel(query_ref, key_ref, value_ref, decay_ref, beta_ref, initial_ref, out_ref, state_ref,
                *, precision):
    """query_ref, key_ref: [chunk, key_dim]; value_ref, out_ref: [chunk, value_block];
    decay_ref, beta_ref: [chunks, chunk]; initial_ref, state_ref: [key_dim, value_block].
    state_ref is the resident output block that carries the state across the chunk axis."""
    index = pl.program_id(3)

    @pl.when(index == 0)
    def _start():
        state_ref[...] = initial_ref[...]

    this = pl.ds(index, 1)
    state, out = gdn_chunk_step(state_ref[...], query_ref[...].astype(_F32), key_ref[...].astype(_F32),
                                value_ref[...].astype(_F32), decay_ref[this, :], beta_ref[this, :],
                                precision=precision)
    out_ref[...] = out
    state_ref[...] = state


def _build_call(variant, interpret, *, shapes, chunk_size, value_block, precision, num_warps, num_stages):
    """The pallas_call of one driver for fixed shapes; arguments in the order of `_gpu_kernel`."""
    batch, tokens, key_heads, value_heads, key_dim, value_dim = shapes
    group = value_heads // key_heads
    # lax.div, not //: floor division of signed ints lowers through `sign`, which Mosaic can only
    # lower knowing the TPU generation (so export from a CPU host would fail).
    key_head = lambda h: jax.lax.div(h, group)
    value_blocks = value_dim // value_block
    num_chunks = tokens // chunk_size
    out_shape = (jax.ShapeDtypeStruct((batch, tokens, value_heads * value_dim), _F32),
                 jax.ShapeDtypeStruct((batch, value_heads, key_dim, value_dim), _F32))
    state_spec = lambda index: pl.BlockSpec((None, None, key_dim, value_block), index)
    per_head = lambda index: pl.BlockSpec((None, None, num_chunks, chunk_size), index)

    if variant == "gpu":
        rows = tokens
        qk_index = lambda b, h, v: (b, 0, key_head(h))
        value_index = lambda b, h, v: (b, 0, h * value_blocks + v)
        head_index = lambda b, h, v: (b, h, 0, 0)
        state_index = lambda b, h, v: (b, h, 0, v)
        grid = (batch, value_heads, value_blocks)
        kernel = functools.partial(_gpu_kernel, chunk_size=chunk_size, precision=precision)
        params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    else:
        rows = chunk_size
        qk_index = lambda b, h, v, c: (b, c, key_head(h))
        value_index = lambda b, h, v, c: (b, c, h * value_blocks + v)
        head_index = lambda b, h, v, c: (b, h, 0, 0)
        state_index = lambda b, h, v, c: (b, h, 0, v)
        grid = (batch, value_heads, value_blocks, num_chunks)
        kernel = functools.partial(_tpu_kernel, precision=precision)
        params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))

    qk_spec = pl.BlockSpec((None, rows, key_dim), qk_index)
    value_spec = pl.BlockSpec((None, rows, value_block), value_index)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=[qk_spec, qk_spec, value_spec, per_head(head_index), per_head(head_index), state_spec(state_index)],
        out_specs=[value_spec, state_spec(state_index)],
        compiler_params=None if interpret else params,
        interpret=interpret,
        name=f"gdn_chunk_{variant}",
    )


def _default_value_block(value_dim: int, variant: Variant) -> int:
    """The GPU driver splits 128-wide heads in two for more programs per head (more SMs busy);
    TPU blocks must be a multiple of 128 lanes or the whole head."""
    if variant == "gpu" and value_dim % 64 == 0:
        return 64
    if variant == "tpu" and value_dim % 128 == 0:
        return 128
    return value_dim


def gdn_chunk(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    decay: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    *,
    chunk_size: int = CHUNK_SIZE,
    value_block: int | None = None,
    variant: Variant = "auto",
    interpret: bool | None = None,
    precision: jax.lax.Precision | jax.lax.DotAlgorithmPreset = jax.lax.Precision.HIGHEST,
    num_warps: int = 8,
    num_stages: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """Chunked gated delta rule, forward only.

    query, key: [batch, tokens, key_heads, key_dim]  (query L2-normalised and scaled by
                key_dim ** -0.5, key L2-normalised; value head h reads key head
                h // (value_heads // key_heads))
    value:      [batch, tokens, value_heads, value_dim]
    decay:      [batch, tokens, value_heads]  (log-space g, <= 0)
    beta:       [batch, tokens, value_heads]
    initial_state: float32 [batch, value_heads, key_dim, value_dim] or None (zeros)
    returns (float32 out [batch, tokens, value_heads, value_dim],
             float32 final state [batch, value_heads, key_dim, value_dim])

    Any dtype in, float32 state and accumulation. Any length: tokens are zero-padded to a
    multiple of `chunk_size` (g = 0, beta = 0, k = 0 change nothing). `value_block` is the
    value-dim tile of one program (default: 64 on the GPU driver, 128 on TPU). `variant`
    and `interpret` choose the driver and interpret mode per platform (see `platforms.py`);
    `precision` applies to every in-kernel matmul (HIGHEST = true float32, as the XLA path;
    on GPU `DotAlgorithmPreset.TF32_TF32_F32_X3` is the faster near-float32 choice).
    """
    batch, tokens, key_heads, key_dim = key.shape
    value_heads, value_dim = value.shape[2:]
    if query.shape != key.shape:
        raise ValueError(f"query {query.shape} and key {key.shape} must have the same shape")
    if value.shape[:2] != (batch, tokens) or value_heads % key_heads:
        raise ValueError(f"value {value.shape} must be [batch, tokens, value_heads, value_dim] with value_heads a "
                         f"multiple of key_heads={key_heads} (key {key.shape})")
    if decay.shape != (batch, tokens, value_heads) or beta.shape != decay.shape:
        raise ValueError(f"decay {decay.shape} and beta {beta.shape} must be {(batch, tokens, value_heads)}")
    state = (jnp.zeros((batch, value_heads, key_dim, value_dim), _F32) if initial_state is None
             else initial_state.astype(_F32))
    if state.shape != (batch, value_heads, key_dim, value_dim):
        raise ValueError(f"initial_state {state.shape} must be {(batch, value_heads, key_dim, value_dim)}")
    if tokens == 0:
        return jnp.zeros((batch, 0, value_heads, value_dim), _F32), state

    padded = tokens + (-tokens) % chunk_size
    pad_tokens = lambda x: jnp.pad(x, [(0, 0), (0, padded - tokens)] + [(0, 0)] * (x.ndim - 2))
    flat_heads = lambda x: pad_tokens(x).reshape(batch, padded, -1)  # [b, t, heads * dim], no copy
    per_head_rows = lambda x: (pad_tokens(x.astype(_F32)).reshape(batch, -1, chunk_size, value_heads)
                               .transpose(0, 3, 1, 2))

    def build(chosen_variant, chosen_interpret):
        block = value_block or _default_value_block(value_dim, chosen_variant)
        if value_dim % block:
            raise ValueError(f"value_block={block} must divide value_dim={value_dim}")
        return _build_call(chosen_variant, chosen_interpret, shapes=(batch, padded, key_heads, value_heads, key_dim,
                           value_dim), chunk_size=chunk_size, value_block=block, precision=precision,
                           num_warps=num_warps, num_stages=num_stages)

    run = per_platform(build, variant, interpret)
    out, state = run(flat_heads(query), flat_heads(key), flat_heads(value), per_head_rows(decay),
                     per_head_rows(beta), state)
    return out.reshape(batch, padded, value_heads, value_dim)[:, :tokens], state
