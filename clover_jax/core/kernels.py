"""Which implementation runs each hot spot: one user switch, `impl="auto" | "pallas" | "xla"`.

`impl` is the user's word; `choose_kernels` resolves it, per platform, into a `KernelChoice`
whose fields are named for what they select:

| impl     | `attention`                               | `gdn` (chunked rule)         | `moe` (routed experts)     |
|----------|-------------------------------------------|------------------------------|----------------------------|
| "xla"    | "online_softmax" over key blocks (XLA)    | "xla": `gated_delta` scan    | "xla": tiled scan          |
| "pallas" | "dot_product_attention" (cuDNN on GPU)    | "pallas": Pallas `gdn_chunk` | "pallas": grouped matmul   |
| "auto"   | GPU: as "pallas"; TPU, CPU: as "xla"      | GPU, TPU: Pallas; CPU: XLA   | GPU, TPU: Pallas; CPU: XLA |

`impl="pallas"` forces the Pallas kernels of `pallas_kernels/`. Attention has none: with
"pallas" it takes `jax.nn.dot_product_attention`, the platform's fused attention (a cuDNN
kernel on GPU, XLA elsewhere), not a Pallas kernel. Why attention stays on the online softmax
on TPU: splash/flash attention take static (NumPy) masks or segment ids, while a pass's masks
depend on the traced prefix length and per-sequence start, and the XLA fallback of
`jax.nn.dot_product_attention` materialises the [queries, keys] scores. On GPU cuDNN's fused
attention takes the traced boolean mask.

On CPU "pallas" runs the kernels in interpret mode: slow, for parity tests only.

Platforms are named as JAX's backends are: "cpu", "gpu", "tpu"; the lowering names "cuda" and
"rocm" are accepted and mean "gpu" (`pallas_kernels.platforms`, the same vocabulary; not
imported here, since importing Pallas costs startup time on CPU).
"""

from __future__ import annotations

import dataclasses

import jax

IMPLS = ("auto", "pallas", "xla")
PLATFORMS = ("cpu", "gpu", "tpu")  # as `pallas_kernels.platforms.PLATFORMS`
GPU_LOWERINGS = ("cuda", "rocm")
ATTENTIONS = ("online_softmax", "dot_product_attention")
KEY_BLOCK = 1024  # keys reduced at a time by the online softmax (the memory estimate counts its scores)


def platform_name(platform: str) -> str:
    """`platform` in the one vocabulary: "cpu", "gpu" or "tpu" ("cuda" and "rocm" are "gpu")."""
    name = "gpu" if platform in GPU_LOWERINGS else platform
    if name not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; expected cpu, gpu or tpu (cuda and rocm mean gpu)")
    return name


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The resolved choice; hashable, so it can be a static field of the Flax modules."""

    attention: str = "online_softmax"  # "online_softmax" | "dot_product_attention"
    gdn: str = "xla"           # "xla" | "pallas"
    moe: str = "xla"           # "xla" | "pallas"
    platform: str = "cpu"      # where the kernels run: "cpu" | "gpu" | "tpu"
    layer_loop: str = "scan"   # "scan" | "unrolled": how the layer groups run (`clover_jax.nn.model`)
    # Tokens per chunk of the GDN chunked rule. None: chosen per pass, the smallest power of two
    # from 16 to 64 that holds the pass's causal rows (a 16-token commit pays for 16, not 64); the
    # Pallas kernel keeps its own 64 unless this is set.
    gdn_chunk: int | None = None

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"KernelChoice.attention={self.attention!r} is not one of {ATTENTIONS}")
        object.__setattr__(self, "platform", platform_name(self.platform))

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
    platform = platform_name(platform or jax.default_backend())
    # XLA:CPU copies every slice of a stacked weight before a matmul; accelerators read it in place.
    layer_loop = "unrolled" if platform == "cpu" else "scan"
    if impl == "xla" or (impl == "auto" and platform == "cpu"):
        return KernelChoice(platform=platform, layer_loop=layer_loop)
    attention = "dot_product_attention" if impl == "pallas" or platform == "gpu" else "online_softmax"
    return KernelChoice(attention=attention, gdn="pallas", moe="pallas", platform=platform, layer_loop=layer_loop)
