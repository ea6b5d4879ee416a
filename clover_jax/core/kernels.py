"""Which implementation runs each hot spot — attention, the GDN rule, the routed experts —
resolved in this one place.

`impl` is the user's word; `choose_kernels` resolves it, per platform, into a `KernelChoice`,
and the choice resolves each hot spot, once per pass, into the rule that runs there — which
kernel, interpreted or compiled, at which chunk size. The model's modules only look the rule's
kernel up in the table of functions beside them (`clover_jax.nn.attention`, `nn.gdn`,
`nn.moe`), and whatever must agree with a pass — the rollback of a recorded GDN pass rereads its
chunk — asks the same `KernelChoice`.

| impl     | attention                              | GDN causal rows (`gdn_rule`) | routed experts (`expert_rule`) |
|----------|----------------------------------------|------------------------------|--------------------------------|
| "xla"    | "online_softmax" over key blocks       | "chunked" (XLA)              | "tiled" (XLA)                  |
| "pallas" | "dot_product_attention" (cuDNN on GPU) | "pallas" (`gdn_chunk`)       | "grouped" (grouped matmuls)    |
| "auto"   | GPU: as "pallas"; TPU, CPU: as "xla"   | GPU, TPU: Pallas; CPU: XLA   | GPU, TPU: grouped; CPU: tiled  |

The serving engine's ragged pass (`clover_jax.core.ragged`) reads attention K/V through page
tables (`pages`): "pallas" is the kernel `pallas_kernels.paged_attention` (TPU and GPU drivers;
what "pallas", and "auto" on GPU and TPU, choose), "xla" the same rule in plain JAX
(`clover_jax.nn.paged_attention`; "xla", and "auto" on CPU).

One causal row (an autoregressive step) always takes the "recurrent" per-token rule. A training
pass's clean stream takes `block_states_rule`: the same "pallas" / "chunked" choice, with the state
kept at every block boundary. The
grouped matmul is megablox `gmm` on TPU for float weights and our Pallas kernel otherwise
(`pallas_kernels.platforms.grouped_matmul_kernel`). On CPU every Pallas kernel is interpreted:
slow, for parity tests only.

Attention has no Pallas kernel: "pallas" takes `jax.nn.dot_product_attention`, the platform's
fused attention (a cuDNN kernel on GPU, XLA elsewhere). Why attention stays on the online softmax
on TPU: splash/flash attention take static (NumPy) masks or segment ids, while a pass's masks
depend on the traced prefix length and per-sequence start, and the XLA fallback of
`jax.nn.dot_product_attention` materialises the [queries, keys] scores. On GPU cuDNN's fused
attention takes the traced boolean mask.

Platforms are named as JAX's backends are, in the one vocabulary of `pallas_kernels.platforms`:
"cpu", "gpu", "tpu" ("cuda" and "rocm", the lowering names, mean "gpu").
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from pallas_kernels.gdn_chunk_size import CHUNK_SIZE, chunk_for_blocks
from pallas_kernels.platforms import PLATFORMS, grouped_matmul_kernel, interpret_for, platform_name

__all__ = ["ATTENTIONS", "EXPERT_STRATEGIES", "ExpertRule", "GDNRule", "IMPLS", "KEY_BLOCK", "KernelChoice",
           "PLATFORMS", "TRAIN_EXPERT_CHUNK_ROWS", "choose_kernels", "platform_name"]

IMPLS = ("auto", "pallas", "xla")
ATTENTIONS = ("online_softmax", "dot_product_attention")
KEY_BLOCK = 1024  # keys reduced at a time by the online softmax (the memory estimate counts its scores)
# Rows per chunk of a LoRA / QLoRA training pass's routed experts (per device): 4,096 rows are
# 32,768 pairs at top-8, whose [pairs, hidden] buffers stay under 0.3 GB in bfloat16 at hidden 2,048.
TRAIN_EXPERT_CHUNK_ROWS = 4096


class GDNRule(NamedTuple):
    """The gated delta rule of a pass's causal rows: `kernel` "recurrent" (token by token, one
    row), "chunked" (`clover_jax.nn.gated_delta`, XLA) or "pallas" (`pallas_kernels.gdn_chunk`),
    `chunk_size` tokens per chunk, and whether a Pallas kernel is interpreted."""

    kernel: str
    chunk_size: int
    interpret: bool


# `routed_expert_mlp`'s strategies (clover_jax.nn.expert_dispatch.STRATEGIES; core does not import nn)
EXPERT_STRATEGIES = ("auto", "loop", "dense")


class ExpertRule(NamedTuple):
    """The routed experts of a pass: `kernel` "tiled" (`clover_jax.nn.expert_dispatch.routed_expert_mlp`,
    XLA) or "grouped" (two grouped matmuls, `grouped_kernel` "megablox" or "pallas" for
    `platform`'s driver, interpreted or not); `per_device`: they run inside `shard_map`, each
    device on its own experts (the expert axis splits them, or a Pallas custom call, which XLA
    cannot partition, runs on a mesh); `strategy`: the tiled form's (`routed_expert_mlp`);
    `chunk_rows`: a LoRA / QLoRA training pass's rows per chunk (`KernelChoice.expert_chunk_rows`)."""

    kernel: str
    grouped_kernel: str | None
    platform: str
    interpret: bool
    per_device: bool
    strategy: str = "auto"
    chunk_rows: int | None = None


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """The resolved choice; hashable, so it can be a static field of the Flax modules.

    gdn_chunk: tokens per chunk of the GDN rule. None: the XLA rule takes, per pass, the smallest
    power of two from 16 to 64 that holds the pass's causal rows (a 16-token commit pays for 16,
    not 64); the Pallas kernel keeps its own 64.

    expert_strategy: how the XLA routed experts run (`routed_expert_mlp`): "auto" (the expert loop,
    fastest), "loop", or "dense" (every expert on every token). Training (`for_training`) asks for
    "loop": over float stacks the loop has a written-out backward pass (reverse-mode differentiation
    has no rule for its data-dependent trip counts), computing only the routed pairs, as the forward
    does — and on GPU and TPU it takes the grouped matmuls instead.

    expert_chunk_rows: in a training pass whose expert stacks are frozen (LoRA, QLoRA), the routed
    experts run over at most this many rows (per device) at a time, each chunk recomputed in the
    backward pass (`expert_lora.adapted_expert_mlp`): every [pairs, ...] buffer of the layer is a
    chunk's, not the whole batch's. None: `for_training` takes TRAIN_EXPERT_CHUNK_ROWS; 0: one chunk.
    """

    attention: str = "online_softmax"  # "online_softmax" | "dot_product_attention"
    gdn: str = "xla"           # "xla" | "pallas"
    moe: str = "xla"           # "xla" | "pallas"
    platform: str = "cpu"      # where the kernels run: "cpu" | "gpu" | "tpu"
    gdn_chunk: int | None = None
    expert_strategy: str = "auto"
    expert_chunk_rows: int | None = None
    pages: str = "xla"         # the ragged pass's attention over K/V pages: "xla" | "pallas"

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"KernelChoice.attention={self.attention!r} is not one of {ATTENTIONS}")
        for field, value in (("gdn", self.gdn), ("moe", self.moe), ("pages", self.pages)):
            if value not in ("xla", "pallas"):
                raise ValueError(f"KernelChoice.{field}={value!r} is not one of ('xla', 'pallas')")
        if self.expert_strategy not in EXPERT_STRATEGIES:
            raise ValueError(f"KernelChoice.expert_strategy={self.expert_strategy!r} is not one of {EXPERT_STRATEGIES}")
        if self.expert_chunk_rows is not None and self.expert_chunk_rows < 0:
            raise ValueError(f"KernelChoice.expert_chunk_rows={self.expert_chunk_rows} must be >= 0 (0: one chunk)")
        object.__setattr__(self, "platform", platform_name(self.platform))

    @property
    def interpret(self) -> bool:
        """Pallas kernels are interpreted where there is no Pallas compiler (the CPU)."""
        return interpret_for(self.platform, None)

    def for_training(self) -> "KernelChoice":
        """The choice a training pass runs. Its routed experts never take the dense every-expert
        form: on GPU and TPU they are the grouped matmuls, whose backward is grouped matmuls too
        (`pallas_kernels.grouped_matmul_backward`), whatever `moe` says; on CPU the expert loop
        with its written-out backward, unless `moe="pallas"` asks for the grouped form (interpreted:
        the tests compare the two)."""
        moe = "pallas" if self.platform != "cpu" else self.moe
        chunk_rows = TRAIN_EXPERT_CHUNK_ROWS if self.expert_chunk_rows is None else self.expert_chunk_rows
        return dataclasses.replace(self, moe=moe, expert_strategy="loop", expert_chunk_rows=chunk_rows)

    def gdn_rule(self, causal_rows: int) -> GDNRule:
        """The rule for a pass with `causal_rows` causal rows."""
        if causal_rows == 1:
            return GDNRule("recurrent", 1, self.interpret)
        if self.gdn == "pallas":
            return GDNRule("pallas", self.gdn_chunk or CHUNK_SIZE, self.interpret)
        chunk = self.gdn_chunk or min(CHUNK_SIZE, max(16, 1 << max(0, causal_rows - 1).bit_length()))
        return GDNRule("chunked", chunk, self.interpret)

    def block_states_rule(self, block_size: int) -> GDNRule:
        """The rule of a training pass's clean stream, whose state every noisy block reads at its
        block's start: chunks end on block boundaries (`chunk_for_blocks`). The Pallas kernel
        where `gdn` is "pallas" and the block divides 64 or is a multiple of it; the XLA rule
        otherwise (its chunk may be any block)."""
        chunk = chunk_for_blocks(block_size)
        if self.gdn == "pallas" and chunk is not None:
            return GDNRule("pallas", chunk, self.interpret)
        return GDNRule("chunked", chunk or block_size, self.interpret)

    def expert_rule(self, quantized: bool, expert_devices: int = 1, on_mesh: bool = False) -> ExpertRule:
        """The rule for routed experts whose weights are `quantized` (or not), on a mesh whose expert
        axis has `expert_devices` devices (`on_mesh`: there is a mesh at all)."""
        if self.moe == "xla":
            return ExpertRule("tiled", None, self.platform, False, on_mesh and expert_devices > 1, self.expert_strategy,
                              chunk_rows=self.expert_chunk_rows or None)
        kernel = "pallas" if self.platform == "cpu" else grouped_matmul_kernel(self.platform, "auto", False, quantized)
        return ExpertRule("grouped", kernel, self.platform, self.interpret, on_mesh,
                          chunk_rows=self.expert_chunk_rows or None)


def choose_kernels(impl: str = "auto", platform: str | None = None) -> KernelChoice:
    """Resolve `impl` for `platform` (default: the default backend's)."""
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")
    platform = platform_name(platform or jax.default_backend())
    if impl == "xla" or (impl == "auto" and platform == "cpu"):
        return KernelChoice(platform=platform)
    attention = "dot_product_attention" if impl == "pallas" or platform == "gpu" else "online_softmax"
    return KernelChoice(attention=attention, gdn="pallas", moe="pallas", platform=platform, pages="pallas")
