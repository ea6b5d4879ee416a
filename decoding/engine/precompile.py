"""Compiling the serving engine's programs before any request waits on them.

The engine's device state has one shape for its life (`decoding.engine.shapes`), so the programs
requests can meet are a short list, the same for a context of 4K or 128K:

* the ragged forward, one per token padding (`EngineShapes.paddings`): the only programs that
  hold a forward pass;
* the decisions (`decoding.engine.decisions`): per served block size a denoising step (greedy and
  sampled, with and without log-probabilities) and a self-speculative round's drafts and
  acceptance; the autoregressive choice (greedy and sampled);
* writing a request into a slot (one per mode's structure), and the prefix cache's copies of a
  slot's GDN states (reading them; writing them, zeros or kept ones).

`precompile` compiles exactly `planned_programs` by running each program once on inputs that
change nothing (a pass of padding rows only, decisions for no slot); afterwards `on_demand` logs
every program compiled for a request with its shape (expected: none).

On a CPU, XLA keeps every compiled program's machine code in memory mappings of the process, and
Linux stops a process at `vm.max_map_count` mappings (65,530 by default): precompiling stops with a
`RuntimeError` naming what to narrow before the process comes near that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.core.ragged import layout
from decoding.engine import decisions, prefix_cache, slot_states
from decoding.engine.shapes import max_pass_tokens, token_paddings
from decoding.modes import Mode, as_mode, strategy

logger = logging.getLogger(__name__)

PROGRAMS = (decisions.forward, decisions.decide_diffusion, decisions.decide_autoregressive, decisions.decide_drafts,
            decisions.decide_verified, slot_states.put_slot, prefix_cache.slot_gdn, prefix_cache.put_slot_gdn)


def compiled_programs() -> int:
    """Programs the engine's functions hold in this process (each jitted function's executable cache)."""
    return sum(_programs_by_function().values())


@dataclasses.dataclass
class Precompiled:
    """What `precompile` did: programs compiled (by kind), seconds, and what the set is."""

    programs: int
    seconds: float
    what: str
    by_kind: dict = dataclasses.field(default_factory=dict)


MAPPING_HEADROOM = 0.8  # of vm.max_map_count: the rest is left for the programs of one more phase and the requests'


def mapping_use() -> tuple[int, int] | None:
    """(memory mappings this process holds, the most Linux allows it), or None where unknown."""
    try:
        with open("/proc/sys/vm/max_map_count") as handle:
            limit = int(handle.read())
        with open(f"/proc/{os.getpid()}/maps") as handle:
            used = sum(1 for _ in handle)
    except (OSError, ValueError):
        return None
    return used, limit


def check_mapping_headroom() -> None:
    """RuntimeError when the CPU programs compiled so far hold more than `MAPPING_HEADROOM` of the
    process's memory-mapping limit (only on the CPU backend: elsewhere a program's code lives on the
    accelerator)."""
    if jax.default_backend() != "cpu":
        return
    use = mapping_use()
    if use is None or use[0] <= MAPPING_HEADROOM * use[1]:
        return
    raise RuntimeError(
        f"precompiling stopped: the programs compiled so far hold {use[0]:,} memory mappings of this process's "
        f"limit of {use[1]:,} (vm.max_map_count), and XLA on a CPU crashes past it; precompile a narrower set "
        f"(fewer --block-sizes, a smaller --max-running), or raise vm.max_map_count")


def planned_programs(*, modes: Sequence[str], block_sizes: Sequence[int], max_running: int, chunk_size: int,
                     served_block_sizes: Sequence[int] | None = None, sample: bool = True,
                     prefix_cache: bool = True, max_context: int | None = None) -> dict[str, int]:
    """How many programs `precompile` compiles in a fresh process, by kind, without compiling them
    (the count depends on the engine's shapes only, never on the model's size or the context):
    forward passes (one per token padding), decisions (per block size of `block_sizes` that a mode
    decodes with: a denoising step greedy and sampled, with and without log-probabilities; a
    self-speculative round's drafts and acceptance; the autoregressive choice greedy and sampled),
    slot writes (one per mode), and a slot's GDN states zeroed (and with a prefix cache read and
    restored).
    served_block_sizes: the engine's block sizes (its widest fixes the passes; default
    `block_sizes`); chunk_size: the prefill budget per pass (the model's prefill chunk by default).
    max_context does not change the count (accepted for the callers that state it)."""
    served = served_block_sizes or block_sizes
    paddings = token_paddings(max_pass_tokens(slots=max_running, max_block=max(served), prefill_budget=chunk_size))
    variants = 2 if sample else 1
    # a slot's GDN states: zeroed at every admission; read and restored for the prefix cache
    counts = {"forward": len(paddings), "decisions": 0, "slots": 0, "gdn_states": 3 if prefix_cache else 1}
    for mode in dict.fromkeys(as_mode(mode) for mode in modes):
        sizes = len(set(block_sizes))
        if mode == Mode.DIFFUSION:
            counts["decisions"] += sizes * variants * 2
        elif mode == Mode.SELF_SPECULATIVE:
            counts["decisions"] += sizes * 2
        else:
            counts["decisions"] += variants
        counts["slots"] += 1
    counts["total"] = sum(counts.values())
    return counts


def precompile(engine, *, modes: Sequence[str], block_sizes: Sequence[int], sample: bool = True) -> Precompiled:
    """Compile every program of `planned_programs` for `engine` (idle) by running each once on inputs
    that change nothing; logs their count and time."""
    started = time.perf_counter()
    before = _programs_by_function()
    modes = list(dict.fromkeys(as_mode(mode) for mode in modes))
    shapes, context = engine.shapes, engine.context
    for padding in shapes.paddings:  # a pass of padding rows: it writes the trash page only
        check_mapping_headroom()
        ids, batch = layout([], num_tokens=padding, page_table=engine.page_table, max_block=shapes.max_block,
                            logit_width=shapes.logit_width, chunk=shapes.chunk)
        logits, engine.state = decisions.forward(context.passes, context.params, engine.state, ids, batch,
                                                 context.coreset_top_p, coreset=context.coreset)
    none = np.zeros(shapes.slots, bool)
    variants = (False, True) if sample else (False,)
    slots = engine.slots
    for mode in modes:
        check_mapping_headroom()
        if mode == Mode.DIFFUSION:
            for size in sorted(set(block_sizes)):
                for sampled in variants:
                    for scores in (False, True):
                        structure, _ = decisions.decide_diffusion(slots.diffusion, logits, none, none, context.ids,
                                                                  block_size=size, sample=sampled, scores=scores)
                        slots = slots._replace(diffusion=structure)
        elif mode == Mode.AUTOREGRESSIVE:
            for sampled in variants:
                structure, _ = decisions.decide_autoregressive(slots.autoregressive, logits, none, context.ids,
                                                               sample=sampled)
                slots = slots._replace(autoregressive=structure)
        else:
            for size in sorted(set(block_sizes)):
                for program in (decisions.decide_drafts, decisions.decide_verified):
                    structure, _ = program(slots.speculative, logits, none, context.ids, block_size=size)
                    slots = slots._replace(speculative=structure)
        # the write of an admission, as it comes (NumPy leaves), into slot 0 (free: the engine is idle)
        field, entry = engine.entry_for(engine.template(mode))
        slots = slots._replace(**{field: slot_states.put_slot(getattr(slots, field), jnp.int32(0), entry)})
    engine.slots = slots
    if engine.prefix_cache is not None:
        kept = prefix_cache.slot_gdn(engine.state, jnp.int32(0))
        engine.state = prefix_cache.put_slot_gdn(engine.state, jnp.int32(0), kept)
    engine.state = prefix_cache.put_slot_gdn(engine.state, jnp.int32(0), None)
    jax.block_until_ready(engine.state)
    grown = {name: count - before[name] for name, count in _programs_by_function().items() if count > before[name]}
    programs = sum(grown.values())
    seconds = time.perf_counter() - started
    what = (f"{len(shapes.paddings)} forward passes ({shapes.paddings[0]}..{shapes.paddings[-1]} tokens) and the "
            f"decisions of {', '.join(mode.value for mode in modes)} at block sizes {sorted(set(block_sizes))}")
    logger.info("precompiled %d programs in %.1f s: %s", programs, seconds, what)
    return Precompiled(programs, seconds, what, grown)


@contextlib.contextmanager
def on_demand(engine, works=()):
    """Around an engine pass after `precompile`: log the programs it compiled (with the pass's
    shape) and count them in `engine.compiled_on_demand`."""
    if engine.precompiled is None:
        yield
        return
    before, started = _programs_by_function(), time.perf_counter()
    yield
    grown = {name: count - before[name] for name, count in _programs_by_function().items() if count > before[name]}
    new = sum(grown.values())
    if new:
        engine.compiled_on_demand += new
        kinds = sorted({(strategy(t.mode).mode.value, t.block_size) for t in engine._held.values()})
        rows = sum(len(work.causal) + len(work.block) for work in works)
        logger.warning("compiled %d program(s) on demand in %.1f s (%s), outside the precompiled set: a pass of %d "
                       "tokens (padded to %d) for requests of %s", new, time.perf_counter() - started,
                       ", ".join(f"{name} x{count}" for name, count in grown.items()), rows,
                       engine.shapes.padding_for(rows) if rows else 0, kinds)


def _programs_by_function() -> dict[str, int]:
    """{jitted function's name: programs it holds} for the engine's functions (`PROGRAMS`)."""
    return {program.__name__: program._cache_size() for program in PROGRAMS}
