"""`clover_jax.plan(..., task="train")` (`plan_training`): will a fine-tuning run fit a target — by arithmetic, and on
request by the target's own compiler compiling the real train step (docs/compiling.md, docs/training.md).

    plan = clover_jax.plan(model, "v6e-1", task="train", compile=True,
                           config=FinetuneConfig(method="lora", quantize="int4", batch_size=1, seq_len=2048))
    option = plan.recommendation
    option.compiled["train_step"]   # ProgramMemory per chip: arguments, temporaries, outputs, aliased
    option.mesh, option.remat       # the planner's choices
    option.max_seq_len              # the longest sequence (of `seq_lens`) whose step still fits

The mesh: the config's own when `FinetuneConfig.mesh` is set; else the planner tries, in order,
the meshes of `train_meshes` — the batch's sequences split over as many chips as divide them
(data x expert), all of those on the data axis first, then the experts over up to 8 of them — with
the rest of the chips on the tensor axis. Remat: the first of `remat_choices` whose step fits (the
config's own when `FinetuneConfig.remat` is not "none"). The first (mesh, remat) that fits is the
plan. When none fits a LoRA run, the planner tries its base's layers in host memory
(`FinetuneConfig.offload_base`, remat "layer") on the same meshes; `option.offload_base` says
which it chose, and `compiled["train_step"].host_bytes` the host memory per chip. When none fits
at all, the one with the fewest bytes is reported. Without `compile`, the arithmetic
counts what is exact — parameters, gradients and AdamW's moments per chip, on the first mesh —
and no activations: only the compiler's figure decides a train step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh

from clover_jax.adapters import lora
from clover_jax.api.compile.program_memory import ProgramMemory
from clover_jax.api.compile.train_step import TRAIN_PROGRAM, TrainCompileJob
from clover_jax.api.compile.worker import compile_in_subprocess
from clover_jax.core.config import CloverConfig
from clover_jax.core.param_layout import flat_layout
from clover_jax.core.quantization import QuantSpec
from clover_jax.parallel.planner import (
    GIB,
    HEADROOM,
    Option,
    Plan,
    inference_rules,
    resolve_target,
    weight_bytes_per_device,
)
from clover_jax.parallel.sharding import MESH_AXES, MeshSharding
from clover_jax.training.config import OFFLOAD_REMAT, FinetuneConfig

logger = logging.getLogger(__name__)

# Tried in this order: keep activations when they fit, else recompute each layer group, else each
# layer (the same recomputation, a smaller backward: the v6e-1 QLoRA step at 2,048 tokens holds
# 10.98 GB of temporaries with "full", 6.49 GB with "layer").
REMAT_CHOICES = ("none", "full", "layer")
# With the base's layers in host memory: "layer" (the first of OFFLOAD_REMAT: each layer copies its
# weights in again for its own backward), then "layer_offload" (each layer's input in host memory
# too: LoRA r16 with expert adapters, v5e-8 (4, 2, 1), 8 x 4,096 tokens, 15.17 -> 13.08 GiB of
# temporaries a chip)
OFFLOADED_REMAT_CHOICES = (OFFLOAD_REMAT[0], "layer_offload")
SEQ_LENS = (4096, 8192, 16384, 32768)
MAX_EXPERT_AXIS = 8  # the psum dispatch moves [rows, hidden] over the expert axis per MoE layer: keep it short


def train_meshes(config: CloverConfig, chips: int, finetune: FinetuneConfig) -> list[dict]:
    """The meshes the planner tries, in order: `FinetuneConfig.mesh` alone when it is set; else
    data x expert = the chips that divide each micro-batch's sequences, tensor = the rest, first
    with all of them on the data axis, then with the experts over 2 of them, then over the largest
    of them (up to 8) that divides the experts. (The LoRA run of v5e-8, 8 x 4,096 tokens, base in
    host memory, remat "layer_offload": 16.67 GiB a chip on (8, 1, 1), 14.09 on (4, 2, 1), where
    each chip gathers half the experts of a layer rather than all of them; since the routed
    experts' B runs as [rank, out], 12.87 and 11.91.)

    Data first because of memory: inside an MoE layer the rows are replicated over the expert axis
    (its dispatch is one psum, `clover_jax.nn.moe`), so each chip of that axis routes the pairs of
    every sequence the axis holds. LoRA r16 with expert adapters, H200x8, 8 x 4,096 tokens: 116.4 GB
    per GPU on (1, 8, 1), 44.1 GB on (8, 1, 1) (the compiler's figures, docs/training.md). The
    expert-parallel mesh moves fewer bytes (its experts stay split rather than gathered per
    layer): where both fit, pin it with `FinetuneConfig.mesh`."""
    if finetune.mesh is not None:
        return [dict(zip(MESH_AXES, finetune.mesh, strict=True))]
    split = math.gcd(finetune.micro_batch, chips)
    expert = max(d for d in range(1, min(split, MAX_EXPERT_AXIS) + 1)
                 if split % d == 0 and config.num_experts % d == 0)
    experts = dict.fromkeys(e for e in (1, 2, expert) if e <= expert and split % e == 0 and config.num_experts % e == 0)
    return [{"data": split // e, "expert": e, "tensor": chips // split} for e in experts]


def describe_run(finetune: FinetuneConfig) -> str:
    if finetune.method == "full":
        return f"full {finetune.param_dtype or 'bfloat16'} + f32 AdamW"
    base = f"{finetune.quantize} base" if finetune.quantize else f"{finetune.param_dtype or 'bfloat16'} base"
    experts = "+experts" if "routed_experts" in finetune.lora_targets else ""
    where = ", layers in host memory" if finetune.offload_base else ""
    return f"{'q' if finetune.quantize else ''}lora r{finetune.lora_rank}{experts} {base}{where}"


@dataclasses.dataclass(frozen=True)
class TrainOption(Option):
    """A fine-tuning run on one mesh: an `Option` with the plan's choices for the step — its remat
    (`FinetuneConfig.remat`), whether its base's layers are in host memory, and the longest
    sequence the compiler fitted (of those tried)."""

    remat: str = "none"
    max_seq_len: int | None = None
    offload_base: bool = False

    def notes(self) -> str:
        return f"  remat {self.remat}" + ("" if self.max_seq_len is None else
                                          f", fits up to {self.max_seq_len} tokens")


def plan_training(model_config: CloverConfig, target=None, *, config: FinetuneConfig | None = None,
                  compile: bool = False, block_size: int = 32, seq_lens: Sequence[int] = SEQ_LENS,
                  remat_choices: Sequence[str] | None = None) -> Plan:
    """The plan of one fine-tuning run, `config` (`FinetuneConfig()` when None), of `model_config`
    on `target`: one option (the run on the planner's mesh), with the compiler's verdict when
    `compile` (see the module docstring); block_size: the run's."""
    finetune = config or FinetuneConfig()
    named, chips, device_bytes, where = resolve_target(target)
    meshes = train_meshes(model_config, chips, finetune)
    if math.prod(meshes[0].values()) != chips:
        raise ValueError(f"mesh {finetune.mesh} has {math.prod(meshes[0].values())} devices, but {where} has {chips}")
    options = [_option(model_config, finetune, mesh, device_bytes) for mesh in meshes]
    if not compile:
        return _decide(options[0], where, finetune)
    if named is None:
        raise ValueError("compile=True needs a named target (e.g. 'v6e-1', 'H200'); a device list has no compiler")
    tried = []
    for option in options:
        tried.append(_compiled(option, model_config, named.name, finetune, block_size, seq_lens, remat_choices))
        if tried[-1].fits:
            break
    if not tried[-1].fits and finetune.method == "lora" and not finetune.offload_base:
        # The base on the chips does not fit: its layers in host memory, each copied in where it runs.
        offloaded = dataclasses.replace(finetune, offload_base=True, remat=OFFLOADED_REMAT_CHOICES[0])
        logger.info("no mesh fits the base on the chips: trying its layers in host memory")
        for option in meshes:
            tried.append(_compiled(_option(model_config, offloaded, option, device_bytes), model_config, named.name,
                                   offloaded, block_size, seq_lens, OFFLOADED_REMAT_CHOICES))
            if tried[-1].fits:
                break
    return _decide(min(tried, key=_compiled_bytes), where, finetune)


def _option(config: CloverConfig, finetune: FinetuneConfig, mesh: dict, device_bytes: int) -> TrainOption:
    """The run on `mesh`, by arithmetic (parameters, gradients and optimizer state per chip)."""
    rules = inference_rules(mesh)
    mesh_sharding = MeshSharding(AbstractMesh(tuple(mesh[a] for a in MESH_AXES), MESH_AXES), config, rules)
    weights, state = _arithmetic(config, finetune, mesh_sharding, mesh)
    quantize = None if finetune.quantize is None else QuantSpec.parse(finetune.quantize).fitted(flat_layout(config))
    return TrainOption(describe_run(finetune), dict(mesh), weights, state, device_bytes,
                       weights + state <= HEADROOM * device_bytes, quantize, rules, remat=finetune.remat,
                       offload_base=finetune.offload_base)


def _compiled_bytes(option: Option) -> tuple[bool, float]:
    """Order of compiled options: a fitting one first, then by the compiler's total (refusals last)."""
    memory = option.compiled[TRAIN_PROGRAM]
    return (not option.fits, math.inf if memory.error else memory.total_bytes)


def _arithmetic(config: CloverConfig, finetune: FinetuneConfig, mesh_sharding: MeshSharding,
                mesh: dict) -> tuple[int, int]:
    """(weights the step reads per chip, trained state per chip): the base in the compute dtype
    (LoRA) or the float32 master (full); gradients + AdamW's two moments of what is trained."""
    data = mesh["data"]
    dtype = finetune.param_dtype or "bfloat16"
    if finetune.method == "full":
        master = weight_bytes_per_device(config, "float32", None, mesh_sharding) // data
        return master, 3 * master
    quantize = None if finetune.quantize is None else QuantSpec.parse(finetune.quantize).fitted(flat_layout(config))
    base = weight_bytes_per_device(config, dtype, quantize, mesh_sharding) // data
    if finetune.offload_base:  # on the chips: the embedding and LM head tables (the layers are in host memory)
        tables = 1 if config.tie_word_embeddings else 2
        base = tables * config.vocab_size * config.hidden_size * jnp.dtype(dtype).itemsize // data
    trained = _lora_parameters(config, finetune) * 4 // (data * mesh["expert"])
    return base, 4 * trained


def _lora_parameters(config: CloverConfig, finetune: FinetuneConfig) -> int:
    """Adapter parameters of the run (the block-mode tensors and mask rows are a rounding error)."""
    layout = flat_layout(config)
    total = 0
    for path in lora.adapted_paths(config, finetune.lora_targets):
        *lead, out, inputs = layout[path]
        total += int(np.prod(lead, dtype=np.int64)) * finetune.lora_rank * (out + inputs)
    return total


def _compiled(option: Option, config: CloverConfig, target_name: str, finetune: FinetuneConfig, block_size: int,
              seq_lens: Sequence[int], remat_choices: Sequence[str] | None) -> Option:
    """The option with the compiler's verdict: the step at `finetune.seq_len` with the first remat
    that fits, then longer sequences (`seq_lens` above it, shortest first, until one does not fit)."""
    if remat_choices is None:
        remat_choices = (finetune.remat,) if finetune.remat != "none" else REMAT_CHOICES

    def compile_at(remat: str, seq_len: int) -> ProgramMemory:
        run = dataclasses.replace(finetune, remat=remat, seq_len=seq_len, mesh=None, block_size=block_size)
        fields = {field.name: getattr(run, field.name) for field in dataclasses.fields(run)}
        job = TrainCompileJob(dataclasses.asdict(config), target_name, fields, option.mesh,
                              dataclasses.asdict(option.rules), block_size)
        logger.info("compiling the train step (%s, remat %s, %d tokens) for %s", option.weights, remat, seq_len,
                    target_name)
        return compile_in_subprocess([job])[0][TRAIN_PROGRAM]

    fits = lambda memory: memory.fits(option.device_bytes)
    memory, remat = None, remat_choices[0]
    for remat in remat_choices:
        memory = compile_at(remat, finetune.seq_len)
        if fits(memory):
            break
    longest = finetune.seq_len if fits(memory) else None
    if longest is not None:
        for seq_len in sorted(length for length in seq_lens if length > finetune.seq_len):
            if not fits(compile_at(remat_choices[-1], seq_len)):
                break
            longest = seq_len
    return dataclasses.replace(option, fits=fits(memory), compiled={TRAIN_PROGRAM: memory}, remat=remat,
                               max_seq_len=longest)


def _decide(option: Option, where: str, finetune: FinetuneConfig) -> Plan:
    run = f"{finetune.batch_size} x {finetune.seq_len} tokens"
    mesh = ",".join(str(option.mesh[axis]) for axis in MESH_AXES)
    if option.compiled is None:
        verdict = (f"{(option.weight_bytes + option.state_bytes) / GIB:.1f} GiB of parameters and optimizer state "
                   f"per chip estimated (activations not counted: compile=True asks the compiler)")
    else:
        memory = option.compiled[TRAIN_PROGRAM]
        verdict = (f"the compiler refused it: {memory.error}" if memory.error else
                   f"{memory.total_bytes / GIB:.1f} GiB of {option.device_bytes / GIB:.1f} GiB per chip by the "
                   f"compiler (remat {option.remat})")
        if memory.host_bytes and not memory.error:
            verdict += f", and {memory.host_bytes / GIB:.1f} GiB of host memory per chip"
    reason = f"{option.weights}, {run}, on {where}, mesh (d,e,t) {mesh}: {verdict}"
    return Plan([option], option if option.fits else None, reason + ("" if option.fits else "; it does not fit"),
                where)
