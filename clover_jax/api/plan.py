"""`clover_jax.plan`: will a model's decoding (or a fine-tuning run) fit a target — by arithmetic, and
on request by the target's own compiler (docs/compiling.md).

    plan = clover_jax.plan("Diffuspace/Clover-35B-A3B-Preview", "v6e-1", context_length=32768, compile=True)
    plan.recommendation            # the first Option that fits (by the compiler when it ran), or None
    option.compiled["diffusion"]   # ProgramMemory: argument / temp / output / alias bytes per device

`plan` reads the model's config and hands the rest to the task's planner: `plan_decoding` (below)
or, with `task="train"`, `clover_jax.api.train_plan.plan_training`; each takes its own options.

With `compile=True`, each format whose weights alone fit the device is compiled for the target —
the block-diffusion, autoregressive and self-speculative loops at the plan's context and batch,
with abstract parameters (`clover_jax.api.compile`, in a subprocess) — and `fits` is the compiler's
verdict: every loop compiled, and each within `HEADROOM` of the device (`ProgramMemory.fits`). A
format the compiler refuses keeps its error and is never recommended. Formats whose weights alone
exceed the device are not compiled.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from typing import Any, Sequence

from clover_jax.api.compile.decode_loops import CompileJob
from clover_jax.api.compile.program_memory import ProgramMemory
from clover_jax.api.compile.worker import compile_in_subprocess
from clover_jax.api.train_plan import plan_training
from clover_jax.core.config import CloverConfig
from clover_jax.core.hub import resolve_checkpoint
from clover_jax.parallel.planner import GIB, Option, Plan, decide, estimate, resolve_target
from clover_jax.parallel.targets import Target
from decoding.modes import MODES

logger = logging.getLogger(__name__)

TASKS = ("decode", "train")


def plan(path_or_config: "str | os.PathLike | CloverConfig", target: "str | Target | Sequence | None" = None, *,
         task: str = "decode", compile: bool = False, revision: str | None = None, **options: Any) -> Plan:
    """Bytes per device of a model's decoding (`task="decode"`: every weight format on the mesh
    `target` allows) or of one fine-tuning run (`task="train"`), and the best that fits.

    path_or_config: a checkpoint directory, a Hub id (only its config.json is read) or a
        `CloverConfig`;
    target: a name ("v5e-1", "v5e-4", "v5e-8", "v6e-1", "v6e-4", "v6e-8", "v5p-8", "v5p-64", "H100", "H200",
        "H200x8"), a list of jax devices or of device-kind names ("TPU v6e"), or None (this
        process's devices);
    compile: let the target's compiler decide what fits (needs a named target and the compilers:
        `python -m clover_jax.parallel.compilers install`; minutes per program at full size);
    options: the task's — `plan_decoding`'s (context_length, batch, block_size, chunk_size, modes,
        formats) or `plan_training`'s (config, block_size, seq_lens, remat_choices).
    """
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not one of {TASKS}")
    planner = plan_training if task == "train" else plan_decoding
    accepted = [name for name, parameter in inspect.signature(planner).parameters.items()
                if parameter.kind == parameter.KEYWORD_ONLY and name != "compile"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(f"plan(task={task!r}) takes no {', '.join(unknown)}: its options are {', '.join(accepted)}")
    model_config = (path_or_config if isinstance(path_or_config, CloverConfig) else
                    CloverConfig.from_pretrained(resolve_checkpoint(path_or_config, revision,
                                                                    require=("config.json",))))
    return planner(model_config, target, compile=compile, **options)


def plan_decoding(config: CloverConfig, target: "str | Target | Sequence | None" = None, *, compile: bool = False,
                  context_length: int = 32768, batch: int = 1, block_size: int = 32, chunk_size: int = 2048,
                  modes: Sequence[str] = MODES, formats: Sequence[str] | None = None) -> Plan:
    """The decoding plan of `config` on `target`: every weight format by arithmetic, and with
    `compile` the decoding loops (`modes`) of each format whose weights fit, compiled at
    `context_length` and `batch`. formats: compile only these (as `Option.weights` names them, e.g.
    ["bfloat16", "int4 experts (g128)"]); the others keep the arithmetic's verdict and `compiled` None."""
    arithmetic = estimate(config, target, context_length, batch, block_size, chunk_size)
    if not compile:
        return arithmetic
    named, _, _, _ = resolve_target(target)
    if named is None:
        raise ValueError("compile=True needs a named target (e.g. 'v6e-1', 'H200'); a device list has no compiler")
    names = [option.weights for option in arithmetic.options]
    unknown = sorted(set(formats or ()) - set(names))
    if unknown:
        raise ValueError(f"formats {unknown} are not among this plan's formats {names}")
    asked = [option for option in arithmetic.options if formats is None or option.weights in formats]
    to_compile = [option for option in asked if option.weight_bytes <= option.device_bytes]
    jobs = [CompileJob(dataclasses.asdict(config), named.name,
                       None if option.quantize is None else option.quantize.name, option.mesh,
                       dataclasses.asdict(option.rules), context_length, batch, block_size, chunk_size,
                       tuple(modes)) for option in to_compile]
    logger.info("compiling %d loops × %d formats for %s", len(modes), len(jobs), named.name)
    results = dict(zip(map(id, to_compile), compile_in_subprocess(jobs), strict=True)) if jobs else {}
    options = [compiled_option(option, results.get(id(option)), modes) if option in asked else option
               for option in arithmetic.options]
    return decide(options, arithmetic.target, context_length, batch)


def compiled_option(option: Option, compiled: dict | None, modes: Sequence[str]) -> Option:
    """The option with the compiler's figures, and `fits` as the compiler says (None: not compiled,
    its weights alone exceed the device)."""
    if compiled is None:
        too_big = ProgramMemory(error=f"not compiled: the weights alone, {option.weight_bytes / GIB:.1f} GiB per "
                                      f"device, exceed the device's {option.device_bytes / GIB:.1f} GiB")
        return dataclasses.replace(option, fits=False, compiled={mode: too_big for mode in modes})
    fits = all(memory.fits(option.device_bytes) for memory in compiled.values())
    return dataclasses.replace(option, fits=fits, compiled=compiled)
