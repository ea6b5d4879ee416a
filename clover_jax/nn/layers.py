"""Small building blocks shared by the attention, GDN and MoE modules.

Weights keep the Hugging Face layout `[out_features, in_features]` so that the checkpoint table
in `weights/` maps names without transposes and a reader can compare shapes with the checkpoint.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from clover_jax.core.quantization import QuantizedWeight, dequantize

default_init = nn.initializers.normal(stddev=0.02)


def weight_param(module: nn.Module, name: str, shape: tuple[int, ...], dtype) -> "jax.Array | QuantizedWeight":
    """A weight that may be held quantised: the stored value as it is (Flax's `param` would
    refuse a `QuantizedWeight` whose arrays differ from `shape`), or a new one at init."""
    if module.has_variable("params", name):
        return module.get_variable("params", name)
    return module.param(name, default_init, shape, dtype)


class Linear(nn.Module):
    """`y = x Wᵀ` with `weight: [out_features, in_features]`, no bias (Qwen3.5 has none).
    The weight may be a `QuantizedWeight`; it is dequantised before the matmul."""

    out_features: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = dequantize(weight_param(self, "weight", (self.out_features, x.shape[-1]), self.dtype), self.dtype)
        return jnp.einsum("...i,oi->...o", x.astype(self.dtype), weight)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm, `x * rsqrt(mean(x²) + eps) * (1 + w)`, computed in float32."""

    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.zeros, (x.shape[-1],), self.dtype)
        normed = rms_normalize(x.astype(jnp.float32), self.eps)
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


class GatedRMSNorm(nn.Module):
    """GDN output norm: `w * rmsnorm(o) * silu(z)` with a plain weight (not `1 + w`).

    The rounding points follow transformers' `Qwen3_5MoeRMSNormGated`: normalise in float32,
    round to the input dtype, scale by `w`, gate in float32.
    """

    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        normed = rms_normalize(x.astype(jnp.float32), self.eps).astype(x.dtype)
        scaled = (weight * normed).astype(jnp.float32)
        return (scaled * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """`x * rsqrt(mean(x²) + eps)` over the last axis."""
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """`x * rsqrt(sum(x²) + eps)` over the last axis, as the FLA kernels and transformers do."""
    return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)
