"""Which implementation runs each hot spot: one switch, `impl="auto" | "pallas" | "xla"`.

| impl     | attention                                      | GDN chunked rule           | routed experts                  |
|----------|------------------------------------------------|----------------------------|---------------------------------|
| "xla"    | online softmax over key blocks                 | `gated_delta` (lax.scan)   | tiled scan (`expert_dispatch`)  |
| "pallas" | `jax.nn.dot_product_attention` (cuDNN on GPU)  | Pallas `gdn_chunk`         | Pallas grouped matmul           |
| "auto"   | GPU: as "pallas"; TPU, CPU: as "xla"           | GPU, TPU: Pallas; CPU: XLA | GPU, TPU: Pallas; CPU: XLA      |

Why attention stays on the online-softmax path on TPU: splash/flash attention take static
(NumPy) masks or segment ids, while a pass's masks depend on the traced prefix length and
per-sequence start, and the XLA fallback of `jax.nn.dot_product_attention` materialises the
[queries, keys] scores. On GPU cuDNN's fused attention takes the traced boolean mask.

On CPU "pallas" runs the kernels in interpret mode: slow, for parity tests only.
"""

from __future__ import annotations

import dataclasses

import jax

IMPLS = ("auto", "pallas", "xla")


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The resolved choice; hashable, so it can be a static field of the Flax modules."""

    attention: str = "online"  # "online" | "fused"
    gdn: str = "xla"           # "xla" | "pallas"
    moe: str = "xla"           # "xla" | "pallas"
    platform: str = "cpu"      # where the kernels run: "cpu" | "gpu" | "tpu"
    layer_loop: str = "scan"   # "scan" | "unrolled": how the layer groups run (`clover_jax.model`)
    # Tokens per chunk of the GDN chunked rule. None: chosen per pass, the smallest power of two
    # from 16 to 64 that holds the pass's causal rows (a 16-token commit pays for 16, not 64); the
    # Pallas kernel keeps its own 64 unless this is set.
    gdn_chunk: int | None = None

    def gdn_chunk_for(self, causal_rows: int) -> int:
        """The GDN chunk of a pass with `causal_rows` causal rows."""
        if self.gdn_chunk is not None:
            return self.gdn_chunk
        return min(64, max(16, 1 << max(0, causal_rows - 1).bit_length()))

    @property
    def interpret(self) -> bool:
        return self.platform == "cpu"


def choose_kernels(impl: str = "auto", platform: str | None = None) -> KernelChoice:
    """Resolve `impl` for `platform` (default: the default backend's)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    platform = platform or jax.default_backend()
    platform = "gpu" if platform in ("cuda", "rocm", "gpu") else platform
    if platform not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"unknown platform {platform!r}; expected cpu, gpu or tpu")
    # XLA:CPU copies every slice of a stacked weight before a matmul; accelerators read it in place.
    layer_loop = "unrolled" if platform == "cpu" else "scan"
    if impl == "xla" or (impl == "auto" and platform == "cpu"):
        return KernelChoice(platform=platform, layer_loop=layer_loop)
    attention = "fused" if impl == "pallas" or platform == "gpu" else "online"
    return KernelChoice(attention=attention, gdn="pallas", moe="pallas", platform=platform, layer_loop=layer_loop)
