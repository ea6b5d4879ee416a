"""The platform's fused attention (`jax.nn.dot_product_attention`) over the same key segments as
`online_attention`, selected by `KernelChoice.attention == "dot_product_attention"` (what
`impl="pallas"`, and `impl="auto"` on GPU, choose; it is not a Pallas kernel).

The segments' keys are concatenated and their masks become one boolean mask
[batch, 1, queries, keys]; on GPU cuDNN runs it as one fused kernel. Queries that may see no
key get zeros, as in `online_attention` (the XLA implementation would average every value).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from clover_jax.nn.online_attention import KeySegment


def fused_attention(query: jax.Array, segments: list[KeySegment], platform: str) -> jax.Array:
    """query: [batch, queries, heads, head_dim] -> [batch, queries, heads, head_dim].

    platform: "cpu", "gpu" or "tpu" (`KernelChoice.platform`); cuDNN runs it on "gpu", XLA elsewhere."""
    keys, values = zip(*(s.read(0, s.length) for s in segments), strict=True)
    key = jnp.concatenate([k.astype(query.dtype) for k in keys], axis=1)
    value = jnp.concatenate([v.astype(query.dtype) for v in values], axis=1)
    allowed = jnp.concatenate([s.allowed(jnp.arange(s.length)) for s in segments], axis=-1)  # [b, q, k]
    out = jax.nn.dot_product_attention(query, key, value, mask=allowed[:, None],
                                       implementation="cudnn" if platform == "gpu" else "xla")
    return jnp.where(jnp.any(allowed, axis=-1)[..., None, None], out, 0).astype(query.dtype)
