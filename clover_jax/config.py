"""Model configuration: one frozen dataclass parsed from the three accepted `config.json` shapes.

Accepted `model_type`s (spec §2):
  * ``clover_moe``       — flat, a Clover checkpoint (adds mask token and coreset fields);
  * ``qwen3_5_moe_text`` — flat, a text-only Qwen3.5/3.6-MoE checkpoint;
  * ``qwen3_5_moe``      — the multimodal wrapper; the text fields live under ``text_config``.

Fields that the JAX model does not use but Hugging Face writes (``architectures``,
``use_cache``, ``initializer_range``, ...) are accepted silently; any other unrecognised field
in a ``config.json`` is logged as a warning (real checkpoints grow fields over time, so refusing
them would break loading), while an unknown keyword passed to :meth:`CloverConfig.replace` or to
the constructor is an error.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

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


class ConfigError(ValueError):
    """A config.json that cannot describe a model this library runs."""


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
    # Clover additions (spec §2); absent for base Qwen checkpoints.
    mask_token_id: int | None = None
    moe_block_coreset_enabled: bool = True
    moe_block_coreset_top_p: float = 0.9
    model_type: str = "clover_moe"
    checkpoint_dtype: str | None = None  # e.g. "bfloat16", as written by the checkpoint

    def __post_init__(self):
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
            need(isinstance(value, int) and value >= 1, f"config.{name} must be a positive integer, got {value!r}")
        need(self.shared_expert_intermediate_size >= 1,
             "config.shared_expert_intermediate_size must be >= 1 (every Qwen3.5-MoE layer has a shared expert)")
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
        need(self.rms_norm_eps > 0, f"config.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.mask_token_id is not None:
            need(0 <= self.mask_token_id < self.vocab_size,
                 f"config.mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        for eos in self.eos_token_id:
            need(0 <= eos < self.vocab_size,
                 f"config.eos_token_id {eos} is outside the vocabulary [0, {self.vocab_size})")

    # ----------------------------------------------------------------- construction
    def replace(self, **changes: Any) -> "CloverConfig":
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ConfigError(f"unknown config fields {unknown}; known: {sorted(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "CloverConfig":
        """Parse a `config.json` dict of any accepted shape."""
        model_type = raw.get("model_type")
        if model_type not in ACCEPTED_MODEL_TYPES:
            raise ConfigError(
                f"config.json has model_type={model_type!r}; clover-jax accepts {list(ACCEPTED_MODEL_TYPES)}")
        text = dict(raw)
        if model_type == "qwen3_5_moe":
            if not isinstance(raw.get("text_config"), dict):
                raise ConfigError("config.json with model_type 'qwen3_5_moe' needs a 'text_config' object")
            text = dict(raw["text_config"])
            # The wrapper carries these at its top level in some exports.
            for key in ("tie_word_embeddings", "eos_token_id"):
                if key not in text and key in raw:
                    text[key] = raw[key]
        return cls._from_text_fields(text, model_type)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "CloverConfig":
        config_path = os.path.join(os.fspath(path), "config.json")
        if not os.path.isfile(config_path):
            raise ConfigError(f"no config.json in {os.fspath(path)!r}")
        try:
            with open(config_path) as handle:
                raw = json.load(handle)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{config_path} is not valid JSON: {error}") from error
        return cls.from_dict(raw)

    @classmethod
    def _from_text_fields(cls, text: dict[str, Any], model_type: str) -> "CloverConfig":
        field_names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(text) - field_names - _IGNORED_FIELDS)
        if unknown:
            logger.warning("config.json fields not used by clover-jax: %s", unknown)

        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_type={rope_type!r} is not supported; Qwen3.5/3.6 use 'default'")
        rope_theta = rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))

        num_layers = text.get("num_hidden_layers")
        layer_types = text.get("layer_types")
        if layer_types is None and isinstance(num_layers, int):
            interval = text.get("full_attention_interval", 4)
            layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]

        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                    "linear_num_value_heads", "moe_intermediate_size", "num_experts", "num_experts_per_tok")
        missing = [name for name in required if name not in text]
        if missing:
            raise ConfigError(f"config.json lacks required fields {missing}")

        eos = text.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        values: dict[str, Any] = {name: text[name] for name in required}
        values.update(
            head_dim=text.get("head_dim", text["hidden_size"] // text["num_attention_heads"]),
            linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
            shared_expert_intermediate_size=text.get("shared_expert_intermediate_size", 512),
            layer_types=tuple(layer_types),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            max_position_embeddings=text.get("max_position_embeddings", 131_072),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            hidden_act=text.get("hidden_act", "silu"),
            attention_bias=bool(text.get("attention_bias", False)),
            eos_token_id=eos_ids,
            mask_token_id=text.get("mask_token_id"),
            moe_block_coreset_enabled=bool(text.get("moe_block_coreset_enabled", True)),
            moe_block_coreset_top_p=float(text.get("moe_block_coreset_top_p", 0.9)),
            model_type=model_type,
            checkpoint_dtype=text.get("dtype", text.get("torch_dtype")),
        )
        return cls(**values)


def _smallest_period(sequence: tuple[str, ...]) -> tuple[str, ...]:
    """Shortest prefix whose repetition gives `sequence` (the whole sequence if none shorter does)."""
    length = len(sequence)
    for period in range(1, length + 1):
        if length % period == 0 and tuple(sequence[:period]) * (length // period) == tuple(sequence):
            return tuple(sequence[:period])
    return tuple(sequence)

