"""The kernels lower to Triton (CUDA) and Mosaic (TPU) at the real model's shapes.

`jax.export` from this CPU host runs the Pallas lowering for the target: block-shape rules, the
ops each backend can lower, the grid and scalar-prefetch plumbing. It does not compile the
kernel (Triton's PTX step, Mosaic's layout passes run on the device), so a device can still
find more; see docs/kernels.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import gdn_chunk, grouped_matmul, grouped_matmul_for_platform

TRITON_CALL = "__gpu$xla.gpu.triton"
KERNEL_CALL = {"cuda": TRITON_CALL, "tpu": "tpu_custom_call"}
ALLOW_TRITON = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32

# Qwen3.6-35B-A3B: hidden 2048; GDN 16 key heads, 32 value heads, head dim 128;
# 256 routed experts of intermediate 512.
TOKENS, KEY_HEADS, VALUE_HEADS, HEAD_DIM = 2048, 16, 32, 128
HIDDEN, EXPERTS, INTERMEDIATE, ROUTED_ROWS = 2048, 256, 512, 4096


def spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def export(function, platform, *args):
    exported = jax.export.export(jax.jit(function), platforms=[platform], disabled_checks=ALLOW_TRITON)(*args)
    return exported, exported.mlir_module()


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_gdn_chunk_lowers_at_model_shapes(platform):
    qk = spec((1, TOKENS, KEY_HEADS, HEAD_DIM), BF16)
    per_token = spec((1, TOKENS, VALUE_HEADS), BF16)
    args = (qk, qk, spec((1, TOKENS, VALUE_HEADS, HEAD_DIM), BF16), per_token, per_token,
            spec((1, VALUE_HEADS, HEAD_DIM, HEAD_DIM), F32))
    exported, module = export(lambda *a: gdn_chunk(*a, interpret=False), platform, *args)
    assert KERNEL_CALL[platform] in module
    assert [(a.shape, a.dtype) for a in exported.out_avals] == [
        ((1, TOKENS, VALUE_HEADS, HEAD_DIM), F32), ((1, VALUE_HEADS, HEAD_DIM, HEAD_DIM), F32)]


ROUTED_MATMULS = {  # lhs, rhs in the checkpoint's [experts, out, in] layout
    "gate_up": ((ROUTED_ROWS, HIDDEN), (EXPERTS, 2 * INTERMEDIATE, HIDDEN)),
    "down": ((ROUTED_ROWS, INTERMEDIATE), (EXPERTS, HIDDEN, INTERMEDIATE)),
}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("matmul", ROUTED_MATMULS)
@pytest.mark.parametrize("coreset", [False, True])
def test_grouped_matmul_lowers_at_routed_expert_shapes(platform, matmul, coreset):
    lhs, rhs = ROUTED_MATMULS[matmul]
    args = [spec(lhs, BF16), spec(rhs, BF16), spec((EXPERTS,), I32)] + ([spec((64,), I32)] if coreset else [])
    exported, module = export(lambda lhs, rhs, sizes, *active: grouped_matmul(
        lhs, rhs, sizes, active_groups=active[0] if active else None, interpret=False), platform, *args)
    assert KERNEL_CALL[platform] in module
    assert [(a.shape, a.dtype) for a in exported.out_avals] == [((lhs[0], rhs[1]), BF16)]


@pytest.mark.parametrize("platform,kernel,custom_call", [
    ("tpu", "auto", "tpu_custom_call"),     # megablox gmm
    ("cuda", "mosaic_gpu", "mosaic_gpu"),   # JAX's Hopper ragged dot, opt-in
])
def test_jax_shipped_grouped_matmuls_lower_at_gate_up_shapes(platform, kernel, custom_call):
    lhs, rhs = ROUTED_MATMULS["gate_up"]
    _, module = export(lambda *a: grouped_matmul_for_platform(platform, *a, kernel=kernel), platform,
                       spec(lhs, BF16), spec(rhs, BF16), spec((EXPERTS,), I32))
    assert custom_call in module
