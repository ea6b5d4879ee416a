"""Write a parameter pytree as a Hugging Face layout checkpoint: the loader's table, inverted.

`save_params` walks `weights.name_table.expected_placements(config)` — the placements the loader
reads, derived from the parameter table `clover_jax.core.params` — and writes each canonical
tensor `params[path][index]` under its canonical name: the text-only `model.` prefix, routed experts one per expert
(`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`, as `save_pretrained` writes them), the
conv weights with their `[channels, 1, kernel]` shape, and for `clover_moe` configs the Clover
block-mode tensors of docs/design.md §2 (base Qwen configs get none, and refuse block-mode parameters
that differ from docs/design.md §2 defaults, which their checkpoint could not hold). Loading the
result gives back the same parameters (tested), with `strict=True` for Clover checkpoints.

The whole checkpoint is assembled in host memory before the single `model.safetensors` file is
written; this is meant for small models (the bundled tiny Clover, tests), not for 35B ones.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from typing import Any

import jax
import ml_dtypes
import numpy as np

from clover_jax.core.config import CloverConfig
from clover_jax.core.param_layout import flat_layout
from clover_jax.core.tree_paths import get, key_names
from weights.name_table import SQUEEZE_CHANNEL, expected_placements

logger = logging.getLogger(__name__)

DTYPE_NAMES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
               "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def config_dict(config: CloverConfig, dtype: str, **extra: Any) -> dict[str, Any]:
    """The flat `config.json` of `config` (the multimodal `qwen3_5_moe` type is written as its
    text model, `qwen3_5_moe_text`, since the tensors carry the text-only prefix)."""
    model_type = "qwen3_5_moe_text" if config.model_type == "qwen3_5_moe" else config.model_type
    fields: dict[str, Any] = {
        "architectures": ["CloverMoeModelLM" if model_type == "clover_moe" else "Qwen3_5MoeForCausalLM"],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "layer_types": list(config.layer_types),
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "linear_conv_kernel_dim": config.linear_conv_kernel_dim,
        "linear_key_head_dim": config.linear_key_head_dim,
        "linear_value_head_dim": config.linear_value_head_dim,
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
        "moe_intermediate_size": config.moe_intermediate_size,
        "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta,
                            "partial_rotary_factor": config.partial_rotary_factor},
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": config.hidden_act,
        "attention_bias": config.attention_bias,
        "dtype": dtype,
    }
    if config.eos_token_id:
        eos = list(config.eos_token_id)
        fields["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if model_type == "clover_moe":
        fields.update(mask_token_id=config.mask_token_id,
                      moe_block_coreset_enabled=config.moe_block_coreset_enabled,
                      moe_block_coreset_top_p=config.moe_block_coreset_top_p)
    fields.update(extra)
    return fields


def checkpoint_tensors(params: dict, config: CloverConfig, dtype: Any = None) -> dict[str, np.ndarray]:
    """Canonical checkpoint name -> host array, for every tensor the loader expects.

    dtype: None keeps each parameter's dtype; otherwise every tensor is cast to it.
    """
    _check_params(params, config)
    target = None if dtype is None else np.dtype(DTYPE_NAMES.get(str(dtype), dtype))
    host: dict[tuple[str, ...], np.ndarray] = {}
    tensors: dict[str, np.ndarray] = {}
    clover = config.model_type == "clover_moe"
    for name, placement in expected_placements(config).items():
        if placement.path not in host:
            host[placement.path] = np.asarray(jax.device_get(get(params, placement.path)))
        tensor = host[placement.path][placement.index]
        if placement.default is not None and not clover:  # a Clover block-mode tensor in a base Qwen config
            if np.any(tensor != np.asarray(placement.default, tensor.dtype)):
                raise ValueError(f"{name} differs from its default (docs/design.md §2), but a {config.model_type} "
                                 "checkpoint has no Clover block-mode tensors; save with model_type 'clover_moe'")
            continue
        if placement.transform == SQUEEZE_CHANNEL:
            tensor = tensor.reshape(placement.shape)
        if tuple(tensor.shape) != tuple(placement.shape):
            raise AssertionError(f"name table gives {name} shape {placement.shape}, parameter slice has {tensor.shape}")
        tensors[name] = np.ascontiguousarray(tensor if target is None else tensor.astype(target))
    return tensors


def save_params(params: dict, config: CloverConfig, out_dir: str | os.PathLike, dtype: Any = None,
                extra_config: dict[str, Any] | None = None) -> str:
    """Write `config.json` and `model.safetensors` for `params` into `out_dir`; returns the directory.

    dtype: "float32", "bfloat16", "float16" or None (keep the parameters' dtype).
    extra_config: more `config.json` fields (e.g. `pad_token_id`, `bos_token_id`).
    """
    from safetensors.numpy import save_file

    out_dir = os.fspath(out_dir)
    if dtype is not None and str(dtype) not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_NAMES)} or None, got {dtype!r}")
    tensors = checkpoint_tensors(params, config, dtype)
    dtype_name = str(dtype) if dtype is not None else _dominant_dtype(tensors)
    os.makedirs(out_dir, exist_ok=True)
    config_text = json.dumps(config_dict(config, dtype_name, **(extra_config or {})), indent=2) + "\n"
    _replace_file(os.path.join(out_dir, "model.safetensors"),
                  lambda path: save_file(tensors, path, metadata={"format": "pt"}))
    _replace_file(os.path.join(out_dir, "config.json"), lambda path: _write_text(path, config_text))
    logger.info("wrote %d tensors (%s) to %s", len(tensors), dtype_name, out_dir)
    return out_dir


def _replace_file(path: str, write) -> None:
    """`write(temporary)` beside `path`, then rename it over `path`: a write that fails (a full disk)
    leaves what `path` held before, and no partial file, and says what it was writing where."""
    temporary = f"{path}.partial-{os.getpid()}"
    try:
        write(temporary)
        os.replace(temporary, path)
    except (OSError, _safetensors_error()) as error:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise OSError(getattr(error, "errno", None) or errno.EIO,
                      f"writing {path} failed ({error}); a full disk? what was there before is unchanged") from error


def _safetensors_error() -> type:
    """The exception safetensors raises for a failed write (its Rust I/O errors), OSError if none."""
    try:
        from safetensors import SafetensorError
    except ImportError:
        return OSError
    return SafetensorError


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)


def _check_params(params: dict, config: CloverConfig) -> None:
    """The pytree must hold exactly the parameters of `config`, with their shapes."""
    expected = flat_layout(config)
    found = {key_names(path): tuple(leaf.shape) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    problems = [f"missing {'/'.join(p)}" for p in expected if p not in found]
    problems += [f"unexpected {'/'.join(p)}" for p in found if p not in expected]
    problems += [f"{'/'.join(p)} has shape {found[p]}, expected {shape} from the config"
                 for p, shape in expected.items() if p in found and found[p] != shape]
    if problems:
        raise ValueError("params do not fit the config: " + "; ".join(problems))


def _dominant_dtype(tensors: dict[str, np.ndarray]) -> str:
    by_dtype: dict[str, int] = {}
    for tensor in tensors.values():
        by_dtype[tensor.dtype.name] = by_dtype.get(tensor.dtype.name, 0) + tensor.nbytes
    return max(by_dtype, key=by_dtype.get)
