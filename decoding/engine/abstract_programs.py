"""The engine's served set as abstract programs: what a target's compiler compiles from any host.

`abstract_programs` lays out every program of `precompile.served_set` for an engine of the given
shapes — the ragged forward per token padding, the decisions, the slot writes, the GDN state copies
— with arguments that allocate nothing: `jax.ShapeDtypeStruct`s placed as the engine places them
(the paged state split over the heads' axis, the slot structures and a pass's layout whole on
every device). `clover_jax.api` hands each to the target's compiler (deviceless compilation,
docs/compiling.md), which says what it needs per device and how long it took.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.core.ragged import TRASH_PAGE, layout
from decoding.engine import decisions, prefix_cache, slot_states
from decoding.engine.precompile import Program, served_set
from decoding.engine.requests import EngineRequest, prepare
from decoding.engine.shapes import EngineShapes
from decoding.generation_config import GenerationConfig
from decoding.layouts import token_ids_of
from decoding.modes import Mode
from decoding.serving_defaults import DEFAULT_GRID


@dataclasses.dataclass(frozen=True)
class AbstractProgram:
    """One program of the served set: `function.lower(*args, **static)` compiles it — the engine's
    own jitted function (its donations included: the state a pass consumes is its output's buffer),
    `args` its arguments in order (the pass interface, static, among them), `static` its keyword ones."""

    program: Program
    function: Callable
    args: tuple
    static: dict


def abstract_programs(passes, params, *, config, dtype, mesh_sharding, modes: Sequence[str],
                      block_sizes: Sequence[int], max_running: int, max_context: int, prefill_budget: int,
                      prefix_cache_bytes: int = 0, prefix_cache_grid: int = DEFAULT_GRID,
                      kv_cache_bytes: int | None = None, sample: bool = True) -> tuple[EngineShapes, list]:
    """(the engine's shapes, an `AbstractProgram` for every program of its served set). params: the
    parameters as placed `jax.ShapeDtypeStruct`s; passes: the model's pass interface for the
    target (its kernels and mesh); kv_cache_bytes None: the pool every slot at `max_context` needs
    and the prefix cache's budget (the default on a device that does not say its free memory)."""
    model = types.SimpleNamespace(config=config, dtype=jnp.dtype(dtype), path=None)
    shapes = EngineShapes.make(model, max_running=max_running, max_context=max_context,
                               block_sizes=tuple(sorted(set(block_sizes))), prefill_budget=prefill_budget,
                               kv_cache_bytes=kv_cache_bytes, page_size=None,
                               grid=prefix_cache_grid if prefix_cache_bytes else None,
                               prefix_cache_bytes=prefix_cache_bytes)
    defaults = GenerationConfig.for_model_type(config.model_type).with_token_ids(config)
    template = lambda mode: prepare(model, EngineRequest([0], mode, generation_config=defaults,
                                                         overrides={"max_new_tokens": 1}), max_context)
    ids = token_ids_of(defaults)
    whole = (lambda leaf: leaf) if mesh_sharding is None else functools.partial(
        _placed, sharding=mesh_sharding.replicated())
    state = jax.eval_shape(lambda: passes.new_paged_state(shapes.slots, shapes.num_pages, shapes.page_size))
    if mesh_sharding is not None:
        state = jax.tree_util.tree_map(lambda leaf, sharding: _placed(leaf, sharding=sharding), state,
                                       mesh_sharding.paged_state_shardings(state))
    diffusion_template = template(Mode.DIFFUSION)  # outside the trace: its key is made on the host
    slots = jax.tree_util.tree_map(whole, jax.eval_shape(lambda: slot_states.empty_slot_states(
        slots=shapes.slots, max_block=shapes.max_block, vocab=config.vocab_size, ids=ids,
        template=diffusion_template)))
    hidden = whole(jax.ShapeDtypeStruct((shapes.slots, shapes.logit_width, config.hidden_size), jnp.dtype(dtype)))
    none = whole(jax.ShapeDtypeStruct((shapes.slots,), jnp.bool_))
    slot = whole(jax.ShapeDtypeStruct((), jnp.int32))
    indices = whole(jax.ShapeDtypeStruct((shapes.slots,), jnp.int32))  # the slots admitted at a step boundary
    ids_placed = jax.tree_util.tree_map(lambda leaf: whole(_abstract(leaf)), ids)
    gdn = jax.eval_shape(prefix_cache.slot_gdn, state, slot)
    if mesh_sharding is not None:
        gdn = jax.tree_util.tree_map(lambda leaf: _placed(leaf, sharding=mesh_sharding.replicated()), gdn)
    page_table = np.full((shapes.slots, shapes.pages_per_slot), TRASH_PAGE, np.int32)
    top_p = whole(jax.ShapeDtypeStruct((), jnp.float32))
    coreset = config.moe_block_coreset_enabled
    fields = {Mode.DIFFUSION: "diffusion", Mode.AUTOREGRESSIVE: "autoregressive", Mode.SELF_SPECULATIVE: "speculative"}
    programs = []
    for program in served_set(modes=modes, block_sizes=block_sizes, paddings=shapes.paddings, sample=sample,
                              prefix_cache=bool(prefix_cache_bytes)):
        if program.function == "forward":
            token_ids, batch = layout([], num_tokens=program.tokens, page_table=page_table,
                                      max_block=shapes.max_block, logit_width=shapes.logit_width, chunk=shapes.chunk)
            place = lambda tree: jax.tree_util.tree_map(lambda leaf: whole(_abstract(leaf)), tree)
            function = decisions.forward
            args, static = (passes, params, state, place(token_ids), place(batch), top_p), {"coreset": coreset}
        elif program.function == "decide_diffusion":
            function = decisions.decide_diffusion
            args = (passes, params, slots.diffusion, hidden, none, none, ids_placed)
            static = {"block_size": program.block_size, "sample": program.sample, "scores": program.scores}
        elif program.function == "decide_autoregressive":
            function = decisions.decide_autoregressive
            args = (passes, params, slots.autoregressive, hidden, none, ids_placed)
            static = {"sample": program.sample}
        elif program.function in ("decide_drafts", "decide_verified"):
            function = getattr(decisions, program.function)
            args = (passes, params, slots.speculative, hidden, none, ids_placed)
            static = {"block_size": program.block_size}
        elif program.function == "put_slots":
            field = fields[program.mode]
            entry = _entry(template(program.mode), field, shapes, ids, config.vocab_size)
            function = slot_states.put_slots
            _, rows = slot_states.stacked_rows([entry], [0], slots=shapes.slots)
            rows = jax.tree_util.tree_map(lambda leaf: whole(_abstract(leaf)), rows)
            args, static = (getattr(slots, field), indices, rows), {}
        elif program.function == "slot_gdn":
            function, args, static = prefix_cache.slot_gdn, (state, slot), {}
        elif program.function == "put_slot_gdn":
            function, args, static = prefix_cache.put_slot_gdn, (state, slot, gdn), {}
        else:
            function, args, static = prefix_cache.clear_slots_gdn, (state, indices), {}
        programs.append(AbstractProgram(program, function, args, static))
    return shapes, programs


def _entry(prepared, field: str, shapes: EngineShapes, ids, vocab: int) -> Any:
    if field == "diffusion":
        return slot_states.diffusion_entry(prepared, max_block=shapes.max_block, ids=ids, vocab=vocab)
    if field == "autoregressive":
        return slot_states.autoregressive_entry(prepared, vocab=vocab)
    return slot_states.speculative_entry(prepared, max_block=shapes.max_block, vocab=vocab)


def _abstract(leaf: Any) -> jax.ShapeDtypeStruct:
    return leaf if isinstance(leaf, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype)


def _placed(leaf: Any, *, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
