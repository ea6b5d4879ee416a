"""Compiling the serving engine's programs before any request waits on them.

The engine's device state has one shape for its life (`decoding.engine.shapes`), so the programs
requests can meet are a short list, the same for a context of 4K or 128K:

* the ragged forward, one per token padding (`EngineShapes.paddings`): the only programs that
  hold a forward pass;
* the decisions (`decoding.engine.decisions`): per served block size a denoising step (greedy and
  sampled, with and without log-probabilities) and a self-speculative round's drafts and
  acceptance; the autoregressive choice (greedy and sampled);
* writing the requests admitted at a step boundary into their slots (one per mode's structure)
  and zeroing their GDN states; with a prefix cache, reading a slot's GDN states and restoring
  kept ones.

`served_set` lists them; `planned_programs` counts them; `precompile` compiles exactly them by
running each program on inputs that change nothing a request reads, through every branch a request
can take (passes of no slot's work, one slot's and every slot's; decisions for no slot and every
slot, sampled ones also under top-p); afterwards `on_demand` logs every program compiled for a
request with its shape (expected: none). The same list is what a target's compiler compiles from any host
(`decoding.engine.abstract_programs`).

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
import numpy as np

from clover_jax.core.ragged import SlotWork, layout
from decoding.engine import decisions, prefix_cache, slot_states
from decoding.engine.shapes import max_pass_tokens, token_paddings
from decoding.modes import Mode, as_mode, strategy

logger = logging.getLogger(__name__)

PROGRAMS = (decisions.forward, decisions.decide_diffusion, decisions.decide_autoregressive, decisions.decide_drafts,
            decisions.decide_verified, slot_states.put_slots, prefix_cache.slot_gdn, prefix_cache.put_slot_gdn,
            prefix_cache.clear_slots_gdn)


def compiled_programs() -> int:
    """Programs the engine's functions hold in this process (each jitted function's executable cache)."""
    return sum(_programs_by_function().values())


@dataclasses.dataclass
class Precompiled:
    """What `precompile` did: programs compiled (by function), seconds, and what the set covers."""

    programs: int
    seconds: float
    covers: str
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
        f"(fewer modes or --block-sizes), or raise vm.max_map_count")


@dataclasses.dataclass(frozen=True)
class Program:
    """One program of the served set: the engine's jitted function (`PROGRAMS`) it is a program of,
    its kind as `planned_programs` counts it, and what picks it among that function's programs (a
    pass's padded token count, a decision's block size and variants, a mode's slot structure)."""

    function: str
    kind: str
    tokens: int | None = None
    mode: Mode | None = None
    block_size: int | None = None
    sample: bool = False
    scores: bool = False

    @property
    def name(self) -> str:
        parts = [self.function] + [f"{key}={value}" for key, value in (
            ("tokens", self.tokens), ("mode", self.mode and self.mode.value), ("B", self.block_size))
            if value is not None]
        return "/".join(parts + ["sampled"] * self.sample + ["scores"] * self.scores)


def served_set(*, modes: Sequence[str], block_sizes: Sequence[int], paddings: Sequence[int], sample: bool = True,
               prefix_cache: bool = True) -> list[Program]:
    """Every program requests of `modes` at `block_sizes` can meet on an engine whose passes are
    padded to `paddings`, in the order `precompile` compiles them (forward passes first: the
    decisions read a pass's logits)."""
    variants = (False, True) if sample else (False,)
    programs = [Program("forward", "forward", tokens=padding) for padding in paddings]
    sizes = sorted(set(block_sizes))
    for mode in dict.fromkeys(as_mode(mode) for mode in modes):
        if mode == Mode.DIFFUSION:
            programs += [Program("decide_diffusion", "decisions", mode=mode, block_size=size, sample=sampled,
                                 scores=scores)
                         for size in sizes for sampled in variants for scores in (False, True)]
        elif mode == Mode.AUTOREGRESSIVE:
            programs += [Program("decide_autoregressive", "decisions", mode=mode, sample=sampled)
                         for sampled in variants]
        else:
            programs += [Program(function, "decisions", mode=mode, block_size=size)
                         for size in sizes for function in ("decide_drafts", "decide_verified")]
        programs.append(Program("put_slots", "slots", mode=mode))
    # the admitted slots' GDN states zeroed; with a prefix cache, a slot's read and restored
    if prefix_cache:
        programs += [Program("slot_gdn", "gdn_states"), Program("put_slot_gdn", "gdn_states")]
    programs.append(Program("clear_slots_gdn", "gdn_states"))
    return programs


def planned_programs(*, modes: Sequence[str], block_sizes: Sequence[int], max_running: int, chunk_size: int,
                     served_block_sizes: Sequence[int] | None = None, sample: bool = True,
                     prefix_cache: bool = True, max_context: int | None = None) -> dict[str, int]:
    """How many programs `precompile` compiles in a fresh process, by kind, without compiling them
    (`served_set`; the count depends on the engine's shapes only, never on the model's size, the
    context or the slots): forward passes (one per token padding, up to the prefill budget),
    decisions (per block size of `block_sizes` that a mode decodes with: a denoising step greedy and
    sampled, with and without log-probabilities; a self-speculative round's drafts and acceptance;
    the autoregressive choice greedy and sampled), slot writes (one per mode), and a slot's GDN
    states zeroed (and with a prefix cache read and restored). served_block_sizes: the engine's
    block sizes (its widest fixes the passes; default `block_sizes`); chunk_size: the prefill
    budget per pass (the model's prefill chunk by default). max_running and max_context do not
    change the count (accepted for the callers that state them)."""
    served = served_block_sizes or block_sizes
    paddings = token_paddings(max_pass_tokens(max_block=max(served), prefill_budget=chunk_size))
    counts = {"forward": 0, "decisions": 0, "slots": 0, "gdn_states": 0}
    for program in served_set(modes=modes, block_sizes=block_sizes, paddings=paddings, sample=sample,
                              prefix_cache=prefix_cache):
        counts[program.kind] += 1
    counts["total"] = sum(counts.values())
    return counts


def exercising_works(shapes, tokens: int, *, mask: int) -> list[list[SlotWork]]:
    """The passes of `tokens` rows that run every branch of the forward (`on_live`'s widths: no
    slot's work, one slot's, every slot's, over the blocks, the attention tiles and the expert
    rows) while writing nothing a request reads: the pages they write are the trash page (an idle
    engine's page table holds no other), the GDN states and slot structures they change are free
    slots', which an admission writes whole. Each slot's work: a block of one mask token, after a
    causal segment that fills its share of the pass."""
    share = min(max(1, tokens // shapes.slots), shapes.pages_per_slot * shapes.page_size)
    every = [SlotWork(slot, 0, causal=(mask,) * (share - 1), block=(mask,), logit_rows=(share - 1,))
             for slot in range(min(shapes.slots, tokens))]
    return [[], [SlotWork(0, 0, block=(mask,), logit_rows=(0,))], every]


def deciding_sets(engine, program: Program):
    """The active-slot masks a decision program runs under in `precompile` (a generator): no slot
    and every slot (`on_live`'s widths); for a sampled program, each width again with every slot
    sampling at full width and then under top-p (the branch that sorts the vocabulary), the slots'
    entries written before each (free slots: an admission writes its own whole)."""
    slots = engine.shapes.slots
    none, one, every = np.zeros(slots, bool), np.arange(slots) == 0, np.ones(slots, bool)
    yield none
    yield every
    if not program.sample:
        return
    for controls in ({"top_k": 0, "top_p": 1.0}, {"top_k": 0, "top_p": 0.5}):
        field, entry = engine.entry_for(engine.template(program.mode, do_sample=True, **controls))
        indices, rows = slot_states.stacked_rows([entry] * slots, list(range(slots)), slots=slots)
        engine.slots = engine.slots._replace(**{field: slot_states.put_slots(getattr(engine.slots, field), indices,
                                                                             rows)})
        yield one
        yield every


def precompile(engine, *, modes: Sequence[str], block_sizes: Sequence[int], sample: bool = True) -> Precompiled:
    """Compile every program of `served_set` for `engine` (idle) by running it on inputs that change
    nothing a request reads, and through every branch a request can take (`exercising_works`,
    `deciding_sets`; an admission's write into slot 0): on a CPU, XLA
    makes a branch's machine code ready the first time it runs, ~50 ms a program on the bundled
    model, which a request would otherwise wait for. Logs their count and time."""
    started = time.perf_counter()
    before = _programs_by_function()
    modes = list(dict.fromkeys(as_mode(mode) for mode in modes))
    shapes, context = engine.shapes, engine.context
    none = np.zeros(shapes.slots, bool)
    hidden = None
    model = (context.passes, context.params)
    for program in served_set(modes=modes, block_sizes=block_sizes, paddings=shapes.paddings, sample=sample,
                              prefix_cache=engine.prefix_cache is not None):
        check_mapping_headroom()
        slots = engine.slots
        if program.function == "forward":
            for works in exercising_works(shapes, program.tokens, mask=int(context.ids.mask)):
                ids, batch = layout(works, num_tokens=program.tokens, page_table=engine.page_table,
                                    max_block=shapes.max_block, logit_width=shapes.logit_width, chunk=shapes.chunk)
                hidden, engine.state = decisions.forward(context.passes, context.params, engine.state, ids, batch,
                                                         context.coreset_top_p, coreset=context.coreset)
        elif program.function == "decide_diffusion":
            for active in deciding_sets(engine, program):
                structure, _ = decisions.decide_diffusion(*model, engine.slots.diffusion, hidden, active, none,
                                                          context.ids, block_size=program.block_size,
                                                          sample=program.sample, scores=program.scores)
                engine.slots = engine.slots._replace(diffusion=structure)
        elif program.function == "decide_autoregressive":
            for active in deciding_sets(engine, program):
                structure, _ = decisions.decide_autoregressive(*model, engine.slots.autoregressive, hidden, active,
                                                               context.ids, sample=program.sample)
                engine.slots = engine.slots._replace(autoregressive=structure)
        elif program.function in ("decide_drafts", "decide_verified"):
            for active in deciding_sets(engine, program):
                structure, _ = getattr(decisions, program.function)(*model, engine.slots.speculative, hidden, active,
                                                                    context.ids, block_size=program.block_size)
                engine.slots = engine.slots._replace(speculative=structure)
        elif program.function == "put_slots":
            # an admission's write, as the engine makes it (NumPy leaves), into slot 0 (free: the engine is idle)
            field, entry = engine.entry_for(engine.template(program.mode))
            indices, rows = slot_states.stacked_rows([entry], [0], slots=shapes.slots)
            engine.slots = slots._replace(**{field: slot_states.put_slots(getattr(slots, field), indices, rows)})
        elif program.function == "slot_gdn":
            kept = prefix_cache.slot_gdn(engine.state, np.int32(0))
        elif program.function == "put_slot_gdn":
            engine.state = prefix_cache.put_slot_gdn(engine.state, np.int32(0), kept)
        else:
            engine.state = prefix_cache.clear_slots_gdn(engine.state, np.full((shapes.slots,), shapes.slots, np.int32))
    jax.block_until_ready(engine.state)
    grown = {name: count - before[name] for name, count in _programs_by_function().items() if count > before[name]}
    programs = sum(grown.values())
    seconds = time.perf_counter() - started
    covers = (f"{len(shapes.paddings)} forward passes ({shapes.paddings[0]}..{shapes.paddings[-1]} tokens) and the "
              f"decisions of {', '.join(mode.value for mode in modes)} at block sizes {sorted(set(block_sizes))}")
    logger.info("precompiled %d programs in %.1f s: %s", programs, seconds, covers)
    return Precompiled(programs, seconds, covers, grown)


@contextlib.contextmanager
def on_demand(engine, what):
    """Around engine work after `precompile`: log the programs it compiled (with `what()`, the work's
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
        logger.warning("compiled %d program(s) on demand in %.1f s (%s), outside the precompiled set: %s, for requests "
                       "of %s", new, time.perf_counter() - started,
                       ", ".join(f"{name} x{count}" for name, count in grown.items()), what(), kinds)


def pass_shape(engine, works) -> str:
    """A pass's shape as the on-demand log gives it."""
    rows = sum(len(work.causal) + len(work.block) for work in works)
    return f"a pass of {rows} tokens (padded to {engine.shapes.padding_for(rows)})" if rows else "admitting requests"


def _programs_by_function() -> dict[str, int]:
    """{jitted function's name: programs it holds} for the engine's functions (`PROGRAMS`)."""
    return {program.__name__: program._cache_size() for program in PROGRAMS}
