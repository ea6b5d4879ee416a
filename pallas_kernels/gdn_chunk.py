"""Chunked gated delta rule as a Pallas kernel, differentiable.

Same arguments and results as `clover_jax.nn.gated_delta.chunked_gated_delta_rule`; the math of
one chunk is in `gdn_chunk_step.py`. The columns of the state `S [key_dim, value_dim]` evolve
independently, so the grid is (batch, value head, value-dim tile) and each program carries a
float32 `[key_dim, value_block]` slice of one head's state through the chunks in order:

* GPU driver (Triton): a `fori_loop` over chunks inside the program, the state in registers.
* TPU driver (Mosaic): the chunks are a fourth grid axis marked "arbitrary"; the state lives in
  the final-state output block, which stays in VMEM while the chunk index advances.

With block states (`gdn_chunk_with_block_states`, the training pass's clean stream) each program
also writes its slice of the state before every block (a block is one chunk or several) and
multiplies the state by a keep flag per chunk, 0 where a packed example starts.

Reverse mode: a `jax.custom_vjp` whose forward is this kernel and whose backward is the plain-JAX
chunked rule's derivative (`gdn_chunk_xla`), its forward recomputed from the saved inputs.

Inputs are only reshaped, never transposed: `[batch, tokens, heads, dim]` is viewed as
`[batch, tokens, heads * dim]`, so a head's `[chunk, dim]` tile is a block of that view (a
multiple of 128 lanes wide when dim is 128, as TPU blocks require). The per-token decay and beta
are rearranged to `[batch, value_heads, chunks, chunk]` (small) and kept whole per head.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu, triton as pltriton

from pallas_kernels.gdn_chunk_size import CHUNK_SIZE
from pallas_kernels.gdn_chunk_step import gdn_chunk_step
from pallas_kernels.gdn_chunk_xla import block_chunk, gdn_chunk_xla
from pallas_kernels.platforms import Variant, per_platform

_F32 = jnp.float32


def _gpu_kernel(*refs, chunk_size, per_block, precision):
    """query_ref, key_ref: [tokens, key_dim]; value_ref, out_ref: [tokens, value_block];
    decay_ref, beta_ref: [chunks, chunk]; initial_ref, state_ref: [key_dim, value_block]; with
    block states (per_block set) also keep_ref [chunks, chunk] (0 where the state restarts at the
    chunk) and states_ref [blocks, key_dim, value_block], the state before each block."""
    if per_block is None:
        query_ref, key_ref, value_ref, decay_ref, beta_ref, initial_ref, out_ref, state_ref = refs
        keep_ref = states_ref = None
    else:
        query_ref, key_ref, value_ref, decay_ref, beta_ref, keep_ref, initial_ref, out_ref, state_ref, states_ref = refs

    def one_chunk(index, state):
        rows = pl.ds(pl.multiple_of(index * chunk_size, chunk_size), chunk_size)
        load = lambda ref: ref[rows, :].astype(_F32)
        this = pl.ds(index, 1)
        state, out = gdn_chunk_step(state, load(query_ref), load(key_ref), load(value_ref),
                                    decay_ref[this, :], beta_ref[this, :], precision=precision)
        out_ref[rows, :] = out
        return state

    num_chunks = decay_ref.shape[0]
    initial = initial_ref[...].astype(_F32)
    if per_block is None:
        state_ref[...] = jax.lax.fori_loop(0, num_chunks, one_chunk, initial)
        return

    def one_block(block, state):
        first = block * per_block
        state = state * _keep(keep_ref, first)  # an example starts here: the state restarts from zeros
        states_ref[block] = state
        return jax.lax.fori_loop(first, first + per_block, one_chunk, state)

    state_ref[...] = jax.lax.fori_loop(0, num_chunks // per_block, one_block, initial)


def _keep(keep_ref, index):
    """[1, 1]: 0 where the state restarts before chunk `index`, else 1 (a row of one value)."""
    return jnp.min(keep_ref[pl.ds(index, 1), :], axis=1, keepdims=True)


def _tpu_kernel(*refs, per_block, precision):
    """query_ref, key_ref: [chunk, key_dim]; value_ref, out_ref: [chunk, value_block];
    decay_ref, beta_ref: [chunks, chunk]; initial_ref, state_ref: [key_dim, value_block].
    state_ref is the resident output block that carries the state across the chunk axis. With
    block states (per_block set) also keep_ref [chunks, chunk] and states_ref [key_dim,
    value_block], the block of the state before the current chunk's block."""
    if per_block is None:
        query_ref, key_ref, value_ref, decay_ref, beta_ref, initial_ref, out_ref, state_ref = refs
    else:
        query_ref, key_ref, value_ref, decay_ref, beta_ref, keep_ref, initial_ref, out_ref, state_ref, states_ref = refs
    index = pl.program_id(3)

    @pl.when(index == 0)
    def _start():
        state_ref[...] = initial_ref[...]

    state = state_ref[...]
    if per_block is not None:
        state = state * _keep(keep_ref, index)

        # The block's output stays resident while its chunks run; it is written at its first.
        @pl.when(jax.lax.rem(index, per_block) == 0)
        def _block_start():
            states_ref[...] = state

    this = pl.ds(index, 1)
    state, out = gdn_chunk_step(state, query_ref[...].astype(_F32), key_ref[...].astype(_F32),
                                value_ref[...].astype(_F32), decay_ref[this, :], beta_ref[this, :],
                                precision=precision)
    out_ref[...] = out
    state_ref[...] = state


def _build_call(variant, interpret, *, shapes, chunk_size, per_block, value_block, precision, num_warps,
                num_stages):
    """The pallas_call of one driver for fixed shapes; arguments in the order of `_gpu_kernel`.
    per_block: None, or chunks per block, to take the keep rows and emit the block states."""
    batch, tokens, key_heads, value_heads, key_dim, value_dim = shapes
    group = value_heads // key_heads
    # lax.div, not //: floor division of signed ints lowers through `sign`, which Mosaic can only
    # lower knowing the TPU generation (so export from a CPU host would fail).
    key_head = lambda h: jax.lax.div(h, group)
    value_blocks = value_dim // value_block
    num_chunks = tokens // chunk_size
    out_shape = [jax.ShapeDtypeStruct((batch, tokens, value_heads * value_dim), _F32),
                 jax.ShapeDtypeStruct((batch, value_heads, key_dim, value_dim), _F32)]
    state_spec = lambda index: pl.BlockSpec((None, None, key_dim, value_block), index)
    per_head = lambda index: pl.BlockSpec((None, None, num_chunks, chunk_size), index)

    if variant == "gpu":
        rows = tokens
        qk_index = lambda b, h, v: (b, 0, key_head(h))
        value_index = lambda b, h, v: (b, 0, h * value_blocks + v)
        head_index = lambda b, h, v: (b, h, 0, 0)
        state_index = lambda b, h, v: (b, h, 0, v)
        keep_index = lambda b, h, v: (b, 0, 0)
        states_spec = pl.BlockSpec((None, num_chunks // (per_block or 1), None, key_dim, value_block),
                                   lambda b, h, v: (b, 0, h, 0, v))
        grid = (batch, value_heads, value_blocks)
        kernel = functools.partial(_gpu_kernel, chunk_size=chunk_size, per_block=per_block, precision=precision)
        params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    else:
        rows = chunk_size
        qk_index = lambda b, h, v, c: (b, c, key_head(h))
        value_index = lambda b, h, v, c: (b, c, h * value_blocks + v)
        head_index = lambda b, h, v, c: (b, h, 0, 0)
        state_index = lambda b, h, v, c: (b, h, 0, v)
        keep_index = lambda b, h, v, c: (b, 0, 0)
        states_spec = pl.BlockSpec((None, None, None, key_dim, value_block),
                                   lambda b, h, v, c: (b, jax.lax.div(c, per_block or 1), h, 0, v))
        grid = (batch, value_heads, value_blocks, num_chunks)
        kernel = functools.partial(_tpu_kernel, per_block=per_block, precision=precision)
        params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))

    qk_spec = pl.BlockSpec((None, rows, key_dim), qk_index)
    value_spec = pl.BlockSpec((None, rows, value_block), value_index)
    in_specs = [qk_spec, qk_spec, value_spec, per_head(head_index), per_head(head_index)]
    out_specs = [value_spec, state_spec(state_index)]
    if per_block is not None:
        in_specs.append(pl.BlockSpec((None, num_chunks, chunk_size), keep_index))
        out_shape.append(jax.ShapeDtypeStruct((batch, num_chunks // per_block, value_heads, key_dim, value_dim), _F32))
        out_specs.append(states_spec)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        in_specs=in_specs + [state_spec(state_index)],
        out_specs=out_specs,
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


class _Options(NamedTuple):
    """The static choices of one call (hashable: the custom VJP's non-differentiable argument)."""

    chunk_size: int
    block_size: int | None
    value_block: int | None
    variant: Variant
    interpret: bool | None
    precision: Any
    num_warps: int
    num_stages: int


def _check_shapes(query, key, value, decay, beta, initial_state):
    """The float32 initial state (zeros when None), after a ValueError for any shape that does not fit."""
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
    return state


def _pallas_forward(query, key, value, decay, beta, state, resets, options: _Options):
    """The kernel's results (out, final state, block states or None); no derivative of its own."""
    batch, tokens, key_heads, key_dim = key.shape
    value_heads, value_dim = value.shape[2:]
    if tokens == 0:
        states = None if options.block_size is None else jnp.zeros((batch, 0, value_heads, key_dim, value_dim), _F32)
        return jnp.zeros((batch, 0, value_heads, value_dim), _F32), state, states
    chunk_size, per_block = options.chunk_size, None
    if options.block_size is not None:
        chunk_size = block_chunk(options.block_size, options.chunk_size, tokens)
        per_block = options.block_size // chunk_size

    padded = tokens + (-tokens) % chunk_size  # the block form's tokens are whole chunks already
    pad_tokens = lambda x: jnp.pad(x, [(0, 0), (0, padded - tokens)] + [(0, 0)] * (x.ndim - 2))
    flat_heads = lambda x: pad_tokens(x).reshape(batch, padded, -1)  # [b, t, heads * dim], no copy
    per_head_rows = lambda x: (pad_tokens(x.astype(_F32)).reshape(batch, -1, chunk_size, value_heads)
                               .transpose(0, 3, 1, 2))

    def build(chosen_variant, chosen_interpret):
        block = options.value_block or _default_value_block(value_dim, chosen_variant)
        if value_dim % block:
            raise ValueError(f"value_block={block} must divide value_dim={value_dim}")
        return _build_call(chosen_variant, chosen_interpret, shapes=(batch, padded, key_heads, value_heads, key_dim,
                           value_dim), chunk_size=chunk_size, per_block=per_block, value_block=block,
                           precision=options.precision, num_warps=options.num_warps, num_stages=options.num_stages)

    run = per_platform(build, options.variant, options.interpret)
    inputs = [flat_heads(query), flat_heads(key), flat_heads(value), per_head_rows(decay), per_head_rows(beta)]
    if per_block is not None:
        # keep rows [b, chunks, chunk]: 0 on the first chunk of a block where an example starts
        chunk_resets = jnp.zeros((batch, padded // chunk_size), bool).at[:, ::per_block].set(resets)
        keep = jnp.where(chunk_resets, 0.0, 1.0)[..., None]
        inputs.append(jnp.broadcast_to(keep, chunk_resets.shape + (chunk_size,)))
    out, final, *states = run(*inputs, state)
    out = out.reshape(batch, padded, value_heads, value_dim)[:, :tokens]
    return out, final, states[0] if states else None


def _xla_forward(query, key, value, decay, beta, state, resets, options: _Options):
    """The same results from the plain-JAX chunked rule (`gdn_chunk_xla`), which reverse mode differentiates."""
    return gdn_chunk_xla(query, key, value, decay, beta, state, chunk_size=options.chunk_size,
                         block_size=options.block_size, resets=resets)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _differentiable(query, key, value, decay, beta, state, resets, options):
    return _pallas_forward(query, key, value, decay, beta, state, resets, options)


def _differentiable_forward(query, key, value, decay, beta, state, resets, options):
    results = _pallas_forward(query, key, value, decay, beta, state, resets, options)
    return results, (query, key, value, decay, beta, state, resets)


def _differentiable_backward(options, saved, cotangents):
    """The XLA rule's derivative, its forward recomputed from the saved inputs (a first step: a
    Pallas backward that reads the saved block states is the faster form)."""
    *inputs, resets = saved
    _, pullback = jax.vjp(lambda *args: _xla_forward(*args, resets, options), *inputs)
    return (*pullback(cotangents), None)


_differentiable.defvjp(_differentiable_forward, _differentiable_backward)


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
    """Chunked gated delta rule, differentiable (forward: this kernel; backward: the XLA rule's).

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
    Reverse mode differentiates the plain-JAX chunked rule (`gdn_chunk_xla`) recomputed from the
    inputs: gradients for query, key, value, decay, beta and the initial state.
    """
    state = _check_shapes(query, key, value, decay, beta, initial_state)
    options = _Options(chunk_size, None, value_block, variant, interpret, precision, num_warps, num_stages)
    out, final, _ = _differentiable(query, key, value, decay, beta, state, None, options)
    return out, final


def gdn_chunk_with_block_states(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    decay: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    *,
    block_size: int,
    resets: jax.Array | None = None,
    chunk_size: int = CHUNK_SIZE,
    value_block: int | None = None,
    variant: Variant = "auto",
    interpret: bool | None = None,
    precision: jax.lax.Precision | jax.lax.DotAlgorithmPreset = jax.lax.Precision.HIGHEST,
    num_warps: int = 8,
    num_stages: int = 1,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`gdn_chunk` that also emits the state before every block of `block_size` tokens, and restarts
    the state from zeros before the blocks `resets` marks (packed examples): the clean stream of
    the training pass, whose noisy blocks read the state at their block's start.

    Arguments as `gdn_chunk`; tokens a whole number of blocks; resets: bool [batch, tokens //
    block_size] or None (no restart). Every block boundary is a chunk boundary: the chunk is the
    block when `block_size` divides `chunk_size` (4, 8, 16, 32, 64), `chunk_size` when the block
    is a multiple of it (128, 256, ...: the state is written at the block's first chunk); any
    other block size is refused with a ValueError (`chunk_for_blocks`).
    returns (float32 out [batch, tokens, value_heads, value_dim], float32 final state
             [batch, value_heads, key_dim, value_dim], float32 state before each block
             [batch, blocks, value_heads, key_dim, value_dim], after that block's restart)
    Differentiable as `gdn_chunk`, the block states included.
    """
    state = _check_shapes(query, key, value, decay, beta, initial_state)
    batch, tokens = key.shape[:2]
    block_chunk(block_size, chunk_size, tokens)  # refuse before anything is traced further
    blocks = tokens // block_size
    resets = jnp.zeros((batch, blocks), bool) if resets is None else jnp.asarray(resets, bool)
    if resets.shape != (batch, blocks):
        raise ValueError(f"resets {resets.shape} must be [batch, blocks] = {(batch, blocks)}")
    options = _Options(chunk_size, block_size, value_block, variant, interpret, precision, num_warps, num_stages)
    return _differentiable(query, key, value, decay, beta, state, resets, options)
