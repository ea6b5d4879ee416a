"""Small building blocks shared by the attention, GDN and MoE modules, and `table_param`, by
which every module creates its parameters from the parameter table (`clover_jax.core.params`).

Weights keep the Hugging Face layout `[out_features, in_features]` so that the checkpoint table
in `weights/` maps names without transposes and a reader can compare shapes with the checkpoint.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from clover_jax.core.config import CloverConfig
from clover_jax.core.params import table_row
from clover_jax.core.quantization import QuantizedWeight, dequantize

_INITIALIZERS = {"normal": nn.initializers.normal(stddev=0.02), "conv": nn.initializers.normal(stddev=0.1),
                 "zeros": nn.initializers.zeros, "ones": nn.initializers.ones}


def table_param(module: nn.Module, config: CloverConfig, name: str) -> "jax.Array | QuantizedWeight":
    """Parameter `name` of `module` as its row of the parameter table declares it: the shape (for
    `config`) and initialiser, in the module's `dtype`. A stored value is returned as it is —
    weights may be held quantised (`QuantizedWeight`), whose arrays Flax's `param` would refuse.

    The row's path is the module's names from the nearest enclosing module that declares where it
    sits in the table (`TABLE_SCOPE`: (inside a decoder layer?, path prefix)), so a layer or a
    token mixer applied on its own finds the same rows as inside the model."""
    in_layers, path = _table_path(module)
    row = table_row(in_layers, path + (name,))
    if row is None:
        raise KeyError(f"the parameter table has no row {'/'.join(path + (name,))} "
                       f"({'in a decoder layer' if in_layers else 'at the top'})")
    if module.has_variable("params", name):
        return module.get_variable("params", name)
    init = nn.initializers.constant(row.default(config)) if row.init == "default" else _INITIALIZERS[row.init]
    return module.param(name, init, row.shape(config), module.dtype)


def _table_path(module: nn.Module) -> tuple[bool, tuple[str, ...]]:
    names, node = [], module
    while isinstance(node, nn.Module):
        scope = getattr(type(node), "TABLE_SCOPE", None)
        if scope is not None:
            in_layers, prefix = scope
            return in_layers, tuple(prefix) + tuple(reversed(names))
        names.append(node.name)
        node = node.parent
    raise KeyError(f"{type(module).__name__} is not inside a module that declares its place in the parameter table")


def low_rank_update(module: nn.Module, name: str, x: jax.Array) -> jax.Array | None:
    """The LoRA term `(x Aᵀ) Bᵀ` of parameter `name`, or None when the module holds no adapter for it.

    A training pass with adapters (`clover_jax.adapters.lora`) places them beside the weight as
    `{name}_lora_a`: float32 [rank, in] and `{name}_lora_b`: float32 [out, rank], the scale
    `alpha / rank` already folded into B. They are not rows of the parameter table: a model without
    them (every inference pass, a merged checkpoint) runs exactly as before. The update is computed
    in float32, as the adapters are held; x: [..., in] -> float32 [..., out]."""
    if not module.has_variable("params", f"{name}_lora_a"):
        return None
    a, b = module.get_variable("params", f"{name}_lora_a"), module.get_variable("params", f"{name}_lora_b")
    inner = jnp.einsum("...i,ri->...r", x.astype(jnp.float32), a.astype(jnp.float32))
    return jnp.einsum("...r,or->...o", inner, b.astype(jnp.float32))


class Linear(nn.Module):
    """`y = x Wᵀ` with `weight: [out_features, in_features]` (its row of the parameter table), no
    bias (Qwen3.5 has none). The weight may be a `QuantizedWeight`; it is dequantised before the
    matmul. With a LoRA adapter beside it (`low_rank_update`), `y = x Wᵀ + (x Aᵀ) Bᵀ`."""

    config: CloverConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = dequantize(table_param(self, self.config, "weight"), self.dtype)
        out = jnp.einsum("...i,oi->...o", x.astype(self.dtype), weight)
        update = low_rank_update(self, "weight", x)
        return out if update is None else (out.astype(jnp.float32) + update).astype(self.dtype)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm, `x * rsqrt(mean(x²) + eps) * (1 + w)`, computed in float32."""

    config: CloverConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = table_param(self, self.config, "weight")
        normed = rms_normalize(x.astype(jnp.float32), self.config.rms_norm_eps)
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


class GatedRMSNorm(nn.Module):
    """GDN output norm: `w * rmsnorm(o) * silu(z)` with a plain weight (not `1 + w`).

    The rounding points follow transformers' `Qwen3_5MoeRMSNormGated`: normalise in float32,
    round to the input dtype, scale by `w`, gate in float32.
    """

    config: CloverConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        weight = table_param(self, self.config, "weight")
        normed = rms_normalize(x.astype(jnp.float32), self.config.rms_norm_eps).astype(x.dtype)
        scaled = (weight * normed).astype(jnp.float32)
        return (scaled * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """`x * rsqrt(mean(x²) + eps)` over the last axis."""
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """`x * rsqrt(sum(x²) + eps)` over the last axis, as the FLA kernels and transformers do."""
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)
