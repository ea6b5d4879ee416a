"""`FinetuneConfig`: every setting of a fine-tuning run, checked once when it is made.

Defaults in brackets in docs/training.md; the loss switches follow the papers named there. A
bad value raises `clover_jax.core.errors.FieldError` naming the field, before any data is read
or anything compiled.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from clover_jax.adapters.targets import LORA_TARGETS
from clover_jax.core.errors import INVALID_TYPE, UNSUPPORTED, FieldError
from clover_jax.nn.remat import REMAT

LOSS_WEIGHTINGS = ("uniform", "inverse_t")
EDIT_SUBSTITUTES = ("uniform", "data")  # where token editing's substitutes come from (training/masking.py)

METHODS = ("full", "lora")
QUANTIZE = ("int8", "int4")
PARAM_DTYPES = ("float32", "bfloat16")
OFFLOAD_REMAT = ("layer", "full", "layer_offload")  # the remats that copy an offloaded layer again in the backward


def _setting(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A field with its command-line help and, for a closed set of values, its choices: `clover-jax
    train` and `clover-jax plan --task train` make one flag of each field from these."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    """A fine-tuning (or conversion) run. Every field is a keyword; see docs/training.md."""

    # what is trained, and how long
    method: str = _setting("full", "full fine-tuning, or LoRA adapters over a frozen base", METHODS)
    steps: int = _setting(1000, "optimizer steps")
    batch_size: int = _setting(8, "sequences (packed rows) per optimizer step")
    grad_accum_steps: int = _setting(1, "micro-batches per optimizer step (batch_size divides by it)")
    seq_len: int = _setting(2048, "clean tokens per row")
    block_size: int | tuple[int, ...] | None = _setting(
        None, "block size(s) trained on; none: the checkpoint's generation config, else 32")
    block_size_weights: tuple[float, ...] | None = _setting(
        None, "with several block sizes: how often each is drawn")
    max_noisy_blocks: int | None = _setting(None, "noisy blocks per example; none: every block with loss tokens")
    # the objective (docs/training.md, "The loss")
    complementary: bool = _setting(True, "a second noisy copy masks what the first left clean")
    loss_weighting: str | None = _setting(
        None, "the masked tokens' weights; none: uniform with the complement, inverse_t without", LOSS_WEIGHTINGS)
    min_mask_ratio: float | None = _setting(None, "the least masking ratio; none: 0.02 with inverse_t, else 1e-3")
    next_token_weight: float = _setting(1.0, "weight of the clean stream's next-token loss")
    # token editing (LLaDA2.1; docs/training.md, "Token editing"): off at edit_fraction 0
    edit_fraction: float = _setting(0.0, "token editing: the share of corrupted positions given a substituted "
                                         "token instead of the mask")
    edit_substitutes: str = _setting("uniform", "token editing: substitutes drawn uniformly from the non-special "
                                                "vocabulary, or from the batch's own loss tokens", EDIT_SUBSTITUTES)
    edit_keep_weight: float = _setting(0.0, "token editing: weight of the cross-entropy at a noisy block's kept "
                                            "clean positions")
    load_balance_weight: float = _setting(1e-3, "weight of the MoE load-balance loss")
    router_z_weight: float = _setting(0.0, "weight of the router z-loss")
    freeze_router: bool = _setting(False, "the router takes no update")
    # the optimizer: AdamW, linear warm-up then cosine decay to 10% of the peak, global-norm clipping
    learning_rate: float = _setting(2e-5, "AdamW's peak learning rate")
    warmup_steps: int = _setting(100, "steps of linear warm-up before the cosine decay")
    weight_decay: float = _setting(0.01, "AdamW's weight decay (matrices only)")
    grad_clip: float = _setting(1.0, "the gradients' global-norm limit")
    param_dtype: str | None = _setting(
        None, "the compute dtype (a float32 master copy is updated); none: the checkpoint's", PARAM_DTYPES)
    remat: str = _setting("none", "what the backward pass recomputes instead of keeping (docs/training.md, "
                                  "\"Remat\")", REMAT)
    offload_base: bool = _setting(False, "LoRA: the frozen base's layers in host memory, copied in per layer")
    # LoRA (method="lora"; docs/training.md, "LoRA and QLoRA") and scale
    lora_rank: int = _setting(16, "LoRA: the adapters' rank")
    lora_alpha: float = _setting(32.0, "LoRA: the scale alpha (an adapter adds alpha / rank · B A)")
    lora_targets: tuple[str, ...] = _setting(("attention", "gdn", "shared_expert", "routed_experts"),
                                             "LoRA: the weights that get adapters", LORA_TARGETS)
    quantize: str | None = _setting(None, "LoRA: the frozen base quantised (QLoRA)", QUANTIZE)
    mesh: Any = _setting(None, "(data, expert, tensor) device counts, or \"D,E,T\"; none: one device")
    # data
    truncate: bool = _setting(False, "cut examples longer than seq_len at a block boundary (else refused)")
    split_turns: bool = _setting(False, "one example per assistant turn of a chat")
    # output and bookkeeping
    generation_config: dict[str, Any] | None = _setting(
        None, "overrides for the written generation_config.json")
    seed: int = _setting(0, "the seed of the packing, the batch order and the noise")
    checkpoint_dir: str | None = _setting(None, "where Orbax checkpoints are kept (and a rerun resumes from)")
    checkpoint_every: int = _setting(500, "steps between checkpoints")
    eval_every: int | None = _setting(None, "steps between evaluations on eval data; none: once, at the end")
    log_every: int = _setting(10, "steps between metrics records")

    def __post_init__(self):
        sizes = self.block_size
        if isinstance(sizes, Sequence) and not isinstance(sizes, str):
            object.__setattr__(self, "block_size", tuple(sizes))
        if self.block_size_weights is not None:
            object.__setattr__(self, "block_size_weights", tuple(float(w) for w in self.block_size_weights))
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        object.__setattr__(self, "mesh", _mesh_sizes(self.mesh))
        _check(self)

    # ------------------------------------------------------------------ resolved settings
    def block_sizes(self, default: int) -> tuple[int, ...]:
        """The block sizes trained on (the config's, else `default`)."""
        if self.block_size is None:
            return (default,)
        return self.block_size if isinstance(self.block_size, tuple) else (self.block_size,)

    def block_weights(self, default: int) -> tuple[float, ...]:
        sizes = self.block_sizes(default)
        return self.block_size_weights or tuple(1.0 for _ in sizes)

    @property
    def weighting(self) -> str:
        return self.loss_weighting or ("uniform" if self.complementary else "inverse_t")

    @property
    def mask_ratio_floor(self) -> float:
        if self.min_mask_ratio is not None:
            return self.min_mask_ratio
        return 0.02 if self.weighting == "inverse_t" else 1e-3

    @property
    def micro_batch(self) -> int:
        return self.batch_size // self.grad_accum_steps


def _mesh_sizes(mesh: Any) -> tuple[int, int, int] | None:
    """A mesh as (data, expert, tensor) device counts: from a tuple, a "D,E,T" string, or a
    {"data", "expert", "tensor"} dict. Whether they match the devices is checked when training starts."""
    if mesh is None:
        return None
    raw = mesh
    if isinstance(mesh, str):
        try:
            mesh = tuple(int(part) for part in mesh.split(","))
        except ValueError:
            mesh = None
    elif isinstance(mesh, dict):
        mesh = tuple(mesh.get(axis, 1) for axis in ("data", "expert", "tensor")) if set(mesh) <= {
            "data", "expert", "tensor"} else None
    elif isinstance(mesh, Sequence):
        mesh = tuple(mesh)
    else:
        mesh = None
    if mesh is None or len(mesh) != 3 or not all(isinstance(size, int) and not isinstance(size, bool) and size >= 1
                                                for size in mesh):
        raise FieldError("mesh", f"FinetuneConfig.mesh: must be three positive device counts (data, expert, tensor), "
                         f"e.g. (2, 4, 1) or \"2,4,1\", got {raw!r}")
    return mesh


def _check(config: FinetuneConfig) -> None:
    def need(condition: bool, field: str, message: str, code: str = "invalid_value") -> None:
        if not condition:
            raise FieldError(field, f"FinetuneConfig.{field}: {message}", code=code)

    def integer(field: str, low: int, allow_none: bool = False) -> None:
        value = getattr(config, field)
        if value is None and allow_none:
            return
        need(isinstance(value, int) and not isinstance(value, bool), field, f"must be an int, got {value!r}",
             INVALID_TYPE)
        need(value >= low, field, f"must be >= {low}, got {value}")

    need(config.method in METHODS, "method", f"must be one of {METHODS}, got {config.method!r}", UNSUPPORTED)
    for field, low in (("steps", 1), ("batch_size", 1), ("grad_accum_steps", 1), ("seq_len", 1),
                       ("warmup_steps", 0), ("seed", 0), ("checkpoint_every", 1), ("log_every", 1)):
        integer(field, low)
    integer("max_noisy_blocks", 1, allow_none=True)
    integer("eval_every", 1, allow_none=True)
    need(config.batch_size % config.grad_accum_steps == 0, "grad_accum_steps",
         f"batch_size={config.batch_size} must be a multiple of grad_accum_steps={config.grad_accum_steps}")
    sizes = config.block_size
    if sizes is not None:
        listed = sizes if isinstance(sizes, tuple) else (sizes,)
        need(bool(listed) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in listed),
             "block_size", f"must be a positive int or a sequence of them, got {sizes!r}")
        need(len(set(listed)) == len(listed), "block_size", f"lists a size twice: {sizes!r}")
        for size in listed:
            need(config.seq_len % size == 0, "seq_len", f"{config.seq_len} must be a multiple of every block size "
                 f"(block_size={size})")
    if config.block_size_weights is not None:
        count = len(sizes) if isinstance(sizes, tuple) else 1
        need(len(config.block_size_weights) == count, "block_size_weights",
             f"needs one weight per block size ({count}), got {len(config.block_size_weights)}")
        need(all(w >= 0 for w in config.block_size_weights) and sum(config.block_size_weights) > 0,
             "block_size_weights", "must be non-negative with a positive sum")
    need(config.loss_weighting is None or config.loss_weighting in LOSS_WEIGHTINGS, "loss_weighting",
         f"must be one of {LOSS_WEIGHTINGS}, got {config.loss_weighting!r}")
    need(config.min_mask_ratio is None or 0.0 <= config.min_mask_ratio < 0.5, "min_mask_ratio",
         f"must be in [0, 0.5), got {config.min_mask_ratio}")
    need(isinstance(config.edit_fraction, (int, float)) and not isinstance(config.edit_fraction, bool)
         and 0.0 <= config.edit_fraction < 1.0, "edit_fraction", f"must be in [0, 1), got {config.edit_fraction!r}")
    need(config.edit_substitutes in EDIT_SUBSTITUTES, "edit_substitutes",
         f"must be one of {EDIT_SUBSTITUTES}, got {config.edit_substitutes!r}", UNSUPPORTED)
    need(config.edit_fraction > 0 or not config.edit_keep_weight, "edit_keep_weight",
         "the keep term belongs to token editing: set edit_fraction > 0 as well")
    for field in ("next_token_weight", "edit_keep_weight", "load_balance_weight", "router_z_weight", "weight_decay"):
        need(isinstance(getattr(config, field), (int, float)) and getattr(config, field) >= 0, field,
             f"must be a number >= 0, got {getattr(config, field)!r}")
    need(isinstance(config.learning_rate, (int, float)) and config.learning_rate > 0, "learning_rate",
         f"must be > 0, got {config.learning_rate!r}")
    need(isinstance(config.grad_clip, (int, float)) and config.grad_clip > 0, "grad_clip",
         f"must be > 0, got {config.grad_clip!r}")
    need(config.param_dtype is None or config.param_dtype in PARAM_DTYPES, "param_dtype",
         f"must be one of {PARAM_DTYPES} or None, got {config.param_dtype!r}")
    need(config.remat in REMAT, "remat", f"must be one of {REMAT}, got {config.remat!r}")
    need(isinstance(config.offload_base, bool), "offload_base", f"must be True or False, got {config.offload_base!r}",
         INVALID_TYPE)
    need(not config.offload_base or config.method == "lora", "offload_base", "only a LoRA run's frozen base is "
         "offloaded to host memory (a full fine-tuning's parameters are trained): set method='lora'", UNSUPPORTED)
    need(not config.offload_base or config.remat in OFFLOAD_REMAT, "offload_base",
         f"needs remat in {OFFLOAD_REMAT} (got {config.remat!r}): without recomputation the backward would keep "
         "every layer's copy of the base on the chip", UNSUPPORTED)
    need(isinstance(config.lora_rank, int) and not isinstance(config.lora_rank, bool) and config.lora_rank > 0,
         "lora_rank", f"must be an int > 0, got {config.lora_rank!r}")
    need(isinstance(config.lora_alpha, (int, float)) and not isinstance(config.lora_alpha, bool)
         and config.lora_alpha > 0, "lora_alpha", f"must be a number > 0, got {config.lora_alpha!r}")
    unknown = [name for name in config.lora_targets if name not in LORA_TARGETS]
    need(not unknown, "lora_targets", f"unknown target(s) {unknown}: choose from {LORA_TARGETS}")
    need(len(set(config.lora_targets)) == len(config.lora_targets), "lora_targets",
         f"lists a target twice: {config.lora_targets!r}")
    need(not (config.freeze_router and "router" in config.lora_targets and config.method == "lora"), "freeze_router",
         "a frozen router cannot carry a router adapter: drop 'router' from lora_targets or freeze_router")
    need(config.quantize is None or config.quantize in QUANTIZE, "quantize",
         f"must be one of {QUANTIZE} or None, got {config.quantize!r}")
    need(config.quantize is None or config.method == "lora", "quantize", "a quantised frozen base is for LoRA "
         "runs (QLoRA): set method='lora'", UNSUPPORTED)
    if config.mesh is not None:
        data, expert, _ = config.mesh
        need(config.micro_batch % (data * expert) == 0, "batch_size",
             f"each micro-batch's {config.micro_batch} sequences (batch_size / grad_accum_steps) must divide over "
             f"the mesh's data x expert = {data} x {expert} devices")
    need(config.generation_config is None or isinstance(config.generation_config, dict), "generation_config",
         f"must be a dict of generation_config.json fields, got {type(config.generation_config).__name__}",
         INVALID_TYPE)
