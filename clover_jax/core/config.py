"""Model configuration: one frozen dataclass parsed from the three accepted `config.json` shapes.

Accepted `model_type`s (docs/design.md §2):
  * ``clover_moe``       — flat, a Clover checkpoint (adds mask token and coreset fields);
  * ``qwen3_5_moe_text`` — flat, a text-only Qwen3.5/3.6-MoE checkpoint;
  * ``qwen3_5_moe``      — the multimodal wrapper; the text fields live under ``text_config``.

Fields that the JAX model does not use but Hugging Face writes (``architectures``,
``use_cache``, ``initializer_range``, ...) are accepted silently; any other unrecognised field
in a ``config.json`` is logged as a warning (real checkpoints grow fields over time, so refusing
them would break loading), while an unknown keyword passed to :meth:`CloverConfig.replace` or to
the constructor is an error.

A field of the wrong JSON type (`"96"` for an integer, `"false"` for a boolean, `true` for an
integer, a list for an object), a non-finite or non-positive `rope_theta` / `rms_norm_eps`, or
`full_attention_interval` 0 is a `ConfigError` naming the field; nothing is coerced
(`clover_jax.core.json_fields`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Mapping

from clover_jax.core.json_fields import ConfigError, JsonFields, is_finite_number, is_integer, read_json_object, show

logger = logging.getLogger(__name__)

ACCEPTED_MODEL_TYPES = ("clover_moe", "qwen3_5_moe_text", "qwen3_5_moe")
LAYER_TYPES = ("linear_attention", "full_attention")

# Fields Hugging Face configs carry that have no effect on the JAX model.
_IGNORED_FIELDS = frozenset({
    "architectures", "auto_map", "attention_dropout", "bos_token_id", "dtype", "torch_dtype",
    "initializer_range", "output_router_logits", "router_aux_loss_coef", "transformers_version",
    "use_cache", "pad_token_id", "attn_output_gate", "mamba_ssm_dtype", "mtp_num_hidden_layers",
    "mtp_use_dedicated_embeddings", "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob",
    "output_attentions", "output_hidden_states", "return_dict", "_name_or_path", "name_or_path",
    "model_type", "full_attention_interval", "rope_parameters", "rope_scaling", "rope_theta",
    "partial_rotary_factor", "layer_types", "eos_token_id", "tie_word_embeddings", "base_config_key",
    "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "tokenizer_class", "sliding_window", "use_sliding_window", "max_window_layers", "intermediate_size",
    "quantization_config", "vision_config", "text_config", "image_token_id", "video_token_id",
    "vision_start_token_id", "vision_end_token_id", "block_size",
})


@dataclasses.dataclass(frozen=True)
class CloverConfig:
    """Architecture of a Clover / Qwen3.5-MoE text model.

    Names follow the Hugging Face config so a reader can match them to `config.json`.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 131_072
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    eos_token_id: tuple[int, ...] = ()
    # Clover additions (docs/design.md §2); absent for base Qwen checkpoints.
    mask_token_id: int | None = None
    moe_block_coreset_enabled: bool = True
    moe_block_coreset_top_p: float = 0.9
    model_type: str = "clover_moe"
    checkpoint_dtype: str | None = None  # e.g. "bfloat16", as written by the checkpoint

    def __post_init__(self):
        for name in ("layer_types", "eos_token_id"):  # hashable: the config is a static jit argument
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        self._validate()

    # ----------------------------------------------------------------- derived sizes
    @property
    def rotary_dim(self) -> int:
        """Leading dims of each attention head that RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN depthwise convolution: q, k and v concatenated."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def group_pattern(self) -> tuple[str, ...]:
        """The repeating unit of `layer_types` that one scanned layer group holds.

        Qwen3.6 gives (3 x linear_attention, full_attention) x 10. A layout that does not repeat is
        one group holding every layer: it still runs, but its compile time grows with depth.
        """
        return _smallest_period(self.layer_types)

    @property
    def num_groups(self) -> int:
        return self.num_hidden_layers // len(self.group_pattern)

    # ----------------------------------------------------------------- validation
    def _validate(self) -> None:
        def need(condition: bool, message: str) -> None:
            if not condition:
                raise ConfigError(message)

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "moe_intermediate_size", "num_experts", "num_experts_per_tok",
                     "max_position_embeddings"):
            value = getattr(self, name)
            need(is_integer(value) and value >= 1, f"config.{name} must be a positive integer, got {show(value)}")
        need(is_integer(self.shared_expert_intermediate_size) and self.shared_expert_intermediate_size >= 1,
             "config.shared_expert_intermediate_size must be >= 1 (every Qwen3.5-MoE layer has a shared expert)")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            need(is_finite_number(value) and value > 0, f"config.{name} must be a finite number > 0, got {show(value)}")
        for name in ("partial_rotary_factor", "moe_block_coreset_top_p"):
            value = getattr(self, name)
            need(is_finite_number(value), f"config.{name} must be a finite number, got {show(value)}")
        for name in ("tie_word_embeddings", "attention_bias", "moe_block_coreset_enabled"):
            need(isinstance(getattr(self, name), bool), f"config.{name} must be true or false, got "
                                                        f"{show(getattr(self, name))}")
        need(all(isinstance(kind, str) for kind in self.layer_types),
             f"config.layer_types must be a list of strings, got {show(self.layer_types)}")
        need(len(self.layer_types) == self.num_hidden_layers,
             f"config.layer_types has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        need(not unknown, f"config.layer_types holds unknown layer types {unknown}; allowed: {list(LAYER_TYPES)}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"config.num_attention_heads={self.num_attention_heads} is not a multiple of "
             f"num_key_value_heads={self.num_key_value_heads}")
        need(self.linear_num_value_heads % self.linear_num_key_heads == 0,
             f"config.linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
             f"linear_num_key_heads={self.linear_num_key_heads}")
        need(self.num_experts_per_tok <= self.num_experts,
             f"config.num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}")
        need(0.0 < self.partial_rotary_factor <= 1.0,
             f"config.partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        need(self.rotary_dim % 2 == 0 and self.rotary_dim > 0,
             f"head_dim * partial_rotary_factor = {self.head_dim} * {self.partial_rotary_factor} must be a "
             "positive even number of rotated dims")
        need(self.hidden_act == "silu", f"config.hidden_act={self.hidden_act!r} is not supported; only 'silu'")
        need(not self.attention_bias, "config.attention_bias=true is not supported by Qwen3.5-MoE checkpoints")
        need(0.0 < self.moe_block_coreset_top_p <= 1.0,
             f"config.moe_block_coreset_top_p must be in (0, 1], got {self.moe_block_coreset_top_p}")
        if self.mask_token_id is not None:
            need(is_integer(self.mask_token_id) and 0 <= self.mask_token_id < self.vocab_size,
                 f"config.mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        for eos in self.eos_token_id:
            need(is_integer(eos) and 0 <= eos < self.vocab_size,
                 f"config.eos_token_id {eos} is outside the vocabulary [0, {self.vocab_size})")

    # ----------------------------------------------------------------- construction
    def replace(self, **changes: Any) -> "CloverConfig":
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ConfigError(f"unknown config fields {unknown}; known: "
                              f"{sorted(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> "CloverConfig":
        """Parse a `config.json` object of any accepted shape (`source` names it in errors)."""
        model_type, text, prefix = text_model_fields(raw, source)
        return cls._from_text_fields(JsonFields(text, source, prefix), model_type)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "CloverConfig":
        config_path = config_json_path(path)
        return cls.from_dict(read_json_object(config_path), config_path)

    @classmethod
    def _from_text_fields(cls, fields: JsonFields, model_type: str) -> "CloverConfig":
        text = fields.values
        field_names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(text) - field_names - _IGNORED_FIELDS)
        if unknown:
            logger.warning("config.json fields not used by clover-jax: %s", unknown)

        rope_key = "rope_parameters" if fields.has("rope_parameters") else "rope_scaling"
        rope = JsonFields(fields.mapping(rope_key, {}), fields.source, f"{fields.prefix}{rope_key}.")
        rope_type = rope.string("rope_type", rope.string("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_type={rope_type!r} is not supported; Qwen3.5/3.6 use 'default'")
        rope_theta = rope.number("rope_theta", fields.number("rope_theta", 10_000_000.0, positive=True), positive=True)
        partial = rope.number("partial_rotary_factor", fields.number("partial_rotary_factor", 0.25))

        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                    "linear_num_value_heads", "moe_intermediate_size", "num_experts", "num_experts_per_tok")
        missing = [name for name in required if name not in text]
        if missing:
            raise ConfigError(f"{fields.source} lacks required fields {missing}")
        values: dict[str, Any] = {name: fields.integer(name, minimum=1) for name in required}

        layer_types = fields.strings("layer_types", None)
        if layer_types is None:
            interval = fields.integer("full_attention_interval", 4, minimum=1)
            layer_types = tuple("linear_attention" if (i + 1) % interval else "full_attention"
                                for i in range(values["num_hidden_layers"]))
        dtype = fields.string("dtype", None)
        values.update(
            head_dim=fields.integer("head_dim", values["hidden_size"] // values["num_attention_heads"], minimum=1),
            linear_conv_kernel_dim=fields.integer("linear_conv_kernel_dim", 4, minimum=1),
            shared_expert_intermediate_size=fields.integer("shared_expert_intermediate_size", 512, minimum=1),
            layer_types=layer_types,
            rms_norm_eps=fields.number("rms_norm_eps", 1e-6, positive=True),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            max_position_embeddings=fields.integer("max_position_embeddings", 131_072, minimum=1),
            tie_word_embeddings=fields.boolean("tie_word_embeddings", False),
            hidden_act=fields.string("hidden_act", "silu"),
            attention_bias=fields.boolean("attention_bias", False),
            eos_token_id=fields.ids("eos_token_id"),
            mask_token_id=fields.integer("mask_token_id", None, minimum=0),
            moe_block_coreset_enabled=fields.boolean("moe_block_coreset_enabled", cls.moe_block_coreset_enabled),
            moe_block_coreset_top_p=fields.number("moe_block_coreset_top_p", cls.moe_block_coreset_top_p),
            model_type=model_type,
            checkpoint_dtype=dtype if dtype is not None else fields.string("torch_dtype", None),
        )
        return cls(**values)


# Clover-35B-A3B-Preview's config.json fields (the model card's shapes: 40 layers of 3 GDN + 1
# attention, hidden 2048, 256 routed experts of 512, top-8, vocabulary 248,320): what planning,
# compiling for accelerators and the benchmarks use when they need the real model without its
# checkpoint. `CloverConfig.from_dict(CLOVER_35B_A3B)`. The mask and EOS ids are placeholders at the
# end of the vocabulary (a checkpoint's own config.json gives the real ones); shapes do not depend on them.
CLOVER_35B_A3B: dict[str, Any] = dict(
    model_type="clover_moe", vocab_size=248320, hidden_size=2048, num_hidden_layers=40, full_attention_interval=4,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256,
    num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    max_position_embeddings=131072, tie_word_embeddings=False, mask_token_id=248319, eos_token_id=[248046],
    dtype="bfloat16")


def config_json_path(directory: str | os.PathLike) -> str:
    """The checkpoint directory's config.json; ConfigError when there is none."""
    path = os.path.join(os.fspath(directory), "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"no config.json in {os.fspath(directory)!r}")
    return path


def read_text_model_fields(directory: str | os.PathLike) -> dict[str, Any]:
    """The text model's raw fields in a checkpoint's config.json (the `qwen3_5_moe` wrapper's
    `text_config`, with what the wrapper carries at its top level), for tools that rewrite a
    config; the values are as stored, not checked (`CloverConfig.from_pretrained` checks them)."""
    path = config_json_path(directory)
    return text_model_fields(read_json_object(path), path)[1]


def text_model_fields(raw: Any, source: str = "config.json") -> tuple[str, dict[str, Any], str]:
    """(model_type, the text model's fields, where they sit: "" or "text_config.") of a
    config.json object of any accepted shape; ConfigError for any other."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source} must hold a JSON object {{...}}, got {show(raw)}")
    model_type = raw.get("model_type")
    if model_type not in ACCEPTED_MODEL_TYPES:
        raise ConfigError(
            f"{source} has model_type={model_type!r}; clover-jax accepts {list(ACCEPTED_MODEL_TYPES)}")
    if model_type != "qwen3_5_moe":
        return model_type, dict(raw), ""
    if not isinstance(raw.get("text_config"), dict):
        raise ConfigError(f"{source} with model_type 'qwen3_5_moe' needs a 'text_config' object, got "
                          f"{show(raw.get('text_config'))}")
    text = dict(raw["text_config"])
    # The wrapper carries these at its top level in some exports.
    for key in ("tie_word_embeddings", "eos_token_id", "mask_token_id"):
        if key not in text and key in raw:
            text[key] = raw[key]
    return model_type, text, "text_config."


def _smallest_period(sequence: tuple[str, ...]) -> tuple[str, ...]:
    """Shortest prefix whose repetition gives `sequence` (the whole sequence if none shorter does)."""
    length = len(sequence)
    for period in range(1, length + 1):
        if length % period == 0 and tuple(sequence[:period]) * (length // period) == tuple(sequence):
            return tuple(sequence[:period])
    return tuple(sequence)

