"""Where code runs, in one vocabulary, and which compiled form of a kernel runs there.

**The platform vocabulary** is JAX's backend names: ``"cpu"``, ``"gpu"``, ``"tpu"`` (what
`jax.default_backend()` and `Device.platform` say). JAX lowers for a GPU under the names
``"cuda"`` and ``"rocm"`` (`jax.export(platforms=[...])`, `jax.lax.platform_dependent`);
wherever a platform is passed in, those are accepted and mean ``"gpu"`` (`platform_name`).
`clover_jax.core.kernels` speaks the same vocabulary (it imports it from here), and reads here
which grouped matmul runs on a platform (`grouped_matmul_kernel`).

Each kernel here has two drivers around the same math, named for the platform they are for:

* ``"gpu"``: every program is independent (Triton runs them concurrently), so sequential work
  (chunks of a recurrence, the contraction dimension of a matmul) is a loop inside the kernel.
* ``"tpu"``: Mosaic runs the grid in order, so sequential work is a grid axis marked
  ``"arbitrary"`` and what it carries lives in VMEM; blocks obey the TPU (8, 128) rule.

Both drivers also run in interpret mode on any platform, which is how the tests check the TPU
driver on a CPU.

The choice is made with `jax.lax.platform_dependent`, i.e. when the computation is lowered for
a platform, not from `jax.default_backend()` at trace time. So `jax.export` from a CPU host for
``platforms=["cuda"]`` gets the Triton kernel, and ``interpret=None`` (interpret on CPU,
compile elsewhere) means the same as "True when the backend is CPU" for ordinary `jax.jit`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
GPU_LOWERINGS = ("cuda", "rocm")  # JAX's lowering names for a GPU; both mean "gpu"
Variant = Literal["auto", "gpu", "tpu"]
_LOWERING_PLATFORMS = ("cpu", *GPU_LOWERINGS, "tpu")  # the keywords `jax.lax.platform_dependent` takes


def platform_name(platform: str) -> str:
    """`platform` in the one vocabulary: "cpu", "gpu" or "tpu" ("cuda" and "rocm" are "gpu")."""
    name = "gpu" if platform in GPU_LOWERINGS else platform
    if name not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; expected one of {', '.join(PLATFORMS)} "
                         f"({' and '.join(GPU_LOWERINGS)} mean gpu)")
    return name


GroupedKernel = Literal["auto", "pallas", "megablox", "mosaic_gpu", "xla"]


def grouped_matmul_kernel(platform: str, kernel: GroupedKernel, has_active_groups: bool,
                          quantized: bool = False) -> str:
    """The grouped matmul `kernel="auto"` means on `platform`: `jax.lax.ragged_dot` on CPU (Pallas
    only interprets there); on TPU megablox `gmm`, JAX's tuned kernel, except for a listed subset
    of groups (it has no such form) or quantised weights (it takes float weights only); our
    Pallas kernel otherwise (`grouped_matmul_platform` runs the choice)."""
    if kernel != "auto":
        return kernel
    platform = platform_name(platform)
    if platform == "cpu":
        return "xla"
    if platform == "tpu" and not has_active_groups and not quantized:
        return "megablox"
    return "pallas"


def variant_for(platform: str, variant: Variant) -> str:
    """The driver used on `platform`: the TPU one on TPU, the GPU one elsewhere (CPU included,
    where it is interpreted), unless a driver is forced."""
    if variant not in ("auto", "gpu", "tpu"):
        raise ValueError(f"variant must be 'auto', 'gpu' or 'tpu', got {variant!r}")
    if variant != "auto":
        return variant
    return "tpu" if platform_name(platform) == "tpu" else "gpu"


def interpret_for(platform: str, interpret: bool | None) -> bool:
    """`interpret=None` interprets on CPU only (Pallas has no CPU compiler)."""
    return platform_name(platform) == "cpu" if interpret is None else bool(interpret)


def per_platform(build: Callable[[str, bool], Callable], variant: Variant, interpret: bool | None) -> Callable:
    """A function that runs `build(variant, interpret)` chosen for the platform it is lowered for.

    `build` returns a function of the kernel's array arguments; it is traced once per distinct
    (variant, interpret) pair, and only the branch of the lowering platform reaches the compiler.
    """
    choices = {lowering: (variant_for(lowering, variant), interpret_for(lowering, interpret))
               for lowering in _LOWERING_PLATFORMS}
    built = {choice: build(*choice) for choice in set(choices.values())}
    if len(built) == 1:
        return next(iter(built.values()))
    return lambda *args: jax.lax.platform_dependent(
        *args, **{lowering: built[choice] for lowering, choice in choices.items()})
