"""Compile every Pallas kernel for TPU v5e, TPU v6e and an H200 (sm_90) from this CPU host, at
Clover-35B-A3B's shapes and with the arguments the model passes; started by
`tests/pallas_kernels/test_compile.py` in a process that has the compilers on its path.

    python -m tests.pallas_kernels.compile_kernels_run OUT.json [TARGET ...]

Each case is lowered, checked for the kernel's custom call, and compiled by the target's compiler
(Mosaic for TPU, Triton + ptxas for the GPU). The JSON maps "target/case" to
{"custom_call": bool, "out": [[shape, dtype], ...], "temp_bytes": int} or {"error": "..."}.
"""

from __future__ import annotations

import json
import sys

TARGETS = ("v5e-1", "v6e-1", "H200")
# What the test suite compiles: one TPU and one GPU (about 30 s of compiling per TPU target on 2 cores).
# v5e's kernels compile in `make bench` inside whole programs: the decoding loops on v5e-8 in every
# format (benchmarks/compile_targets.py) and the train step on v5e-8 (benchmarks/train_compile.py).
SUITE_TARGETS = ("v6e-1", "H200")
PLATFORMS = {"v5e-1": "tpu", "v6e-1": "tpu", "H200": "gpu"}
CUSTOM_CALL = {"tpu": "tpu_custom_call", "gpu": "__gpu$xla.gpu.triton"}
# Qwen3.6-35B-A3B: hidden 2048; GDN 16 key heads, 32 value heads, head dim 128; 256 routed experts of
# intermediate 512, top-8. A prefill chunk is 2048 tokens (16,384 routed rows); a denoising step of a
# 32-token block routes 256 rows.
TOKENS, KEY_HEADS, VALUE_HEADS, HEAD_DIM = 2048, 16, 32, 128
HIDDEN, EXPERTS, INTERMEDIATE, TOP_K = 2048, 256, 512, 8
MATMULS = {"gate_up": (HIDDEN, 2 * INTERMEDIATE), "down": (INTERMEDIATE, HIDDEN)}  # (depth, cols)
FORMATS = (None, "int8", "int4-g128")
# GDN's lengths: a prefill chunk and a block commit. Triton + ptxas take ~25 s per length on 2 cores,
# so the GPU compiles the chunk here and the 32-token commit inside the H200x2 block-diffusion loop
# (tests/clover_jax/parallel/test_compile_targets.py).
GDN_TOKENS = {"tpu": (TOKENS, 32), "gpu": (TOKENS,)}


def cases(platform: str):
    """(name, function, abstract args) of every kernel call to compile."""
    import jax
    import jax.numpy as jnp

    from clover_jax.core.quantization import QuantSpec
    from pallas_kernels import gdn_chunk, grouped_matmul, grouped_matmul_for_platform

    spec = jax.ShapeDtypeStruct
    f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
    for tokens in GDN_TOKENS[platform]:
        # As `clover_jax.nn.gdn` calls it: q, k float32 (L2-normalised in float32), v bf16, decay
        # float32, beta bf16 (a sigmoid of a bf16 projection), float32 state.
        qk = spec((1, tokens, KEY_HEADS, HEAD_DIM), f32)
        per_token = (spec((1, tokens, VALUE_HEADS), f32), spec((1, tokens, VALUE_HEADS), bf16))
        args = (qk, qk, spec((1, tokens, VALUE_HEADS, HEAD_DIM), bf16), *per_token,
                spec((1, VALUE_HEADS, HEAD_DIM, HEAD_DIM), f32))
        yield f"gdn_chunk/{tokens}", lambda *a: gdn_chunk(*a, interpret=False), args
    yield from gdn_backward_cases()
    for fmt in FORMATS:
        quant = QuantSpec.parse(fmt)
        for name, (depth, cols) in MATMULS.items():
            if quant is None:
                weights = (spec((EXPERTS, cols, depth), bf16), None)
            else:
                (values_shape, scales_shape), (values_dtype, scales_dtype) = (
                    quant.stored_shapes((EXPERTS, cols, depth)), quant.stored_dtypes())
                weights = (spec(values_shape, values_dtype), spec(scales_shape, scales_dtype))
            for rows in (TOKENS * TOP_K, 32 * TOP_K):
                # As `clover_jax.nn.expert_dispatch.grouped_expert_mlp` calls it (kernel "auto").
                args = ((spec((rows, depth), bf16), weights[0], spec((EXPERTS,), i32))
                        + weights[1:2] * (quant is not None))
                yield (f"experts/{fmt or 'bf16'}/{name}/{rows}",
                       lambda lhs, rhs, sizes, *scales: grouped_matmul_for_platform(
                           platform, lhs, rhs, sizes, rhs_scales=scales[0] if scales else None), args)
            # Only the coreset's experts (`active_groups`): our kernel, at a denoising step's rows.
            args = (spec((32 * TOP_K, depth), bf16), weights[0], spec((EXPERTS,), i32), spec((64,), i32)) + (
                weights[1:2] * (quant is not None))
            yield (f"experts_active_groups/{fmt or 'bf16'}/{name}",
                   lambda lhs, rhs, sizes, active, *scales: grouped_matmul(
                       lhs, rhs, sizes, rhs_scales=scales[0] if scales else None, active_groups=active,
                       variant="tpu" if platform == "tpu" else "gpu", interpret=False), args)
    yield from expert_backward_cases(platform)
    yield from paged_attention_cases()


# The serving engine's attention over K/V pages (`pallas_kernels.paged_attention`), as its ragged pass
# calls it at Clover-35B's attention shapes: a pass of 1,024 tokens in tiles of 16 rows, 16 slots of
# 32,768 positions in pages of 16 (the attention layers' 10 groups in one pool).
PAGED = {"tokens": 1024, "heads": 16, "kv_heads": 2, "head_dim": 256, "page": 16, "slots": 16,
         "pages_per_slot": 2048, "groups": 10}


def paged_attention_cases():
    """(name, function, abstract args) of the paged attention kernel."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.paged_attention import TILE_ROWS, paged_attention

    spec = jax.ShapeDtypeStruct
    bf16, i32 = jnp.bfloat16, jnp.int32
    shape = PAGED
    tiles = shape["tokens"] // TILE_ROWS + shape["slots"]
    pages = spec((shape["groups"], shape["slots"] * shape["pages_per_slot"] + 1, shape["kv_heads"], shape["page"],
                  shape["head_dim"]), bf16)
    args = (spec((shape["tokens"], shape["heads"], shape["head_dim"]), bf16), pages, pages, spec((), i32),
            spec((shape["slots"], shape["pages_per_slot"]), i32), spec((shape["tokens"],), i32),
            spec((tiles, TILE_ROWS), i32), spec((tiles,), i32))
    yield "paged_attention", lambda *a: paged_attention(*a, interpret=False), args


# ------------------------------------------------------------ the routed experts' backward pass
BACKWARD_ROWS = TOKENS * TOP_K  # a training chunk of 2048 tokens


def expert_backward_cases(platform: str):
    """(name, function, abstract args) of the grouped matmul's backward at Clover-35B's expert
    shapes, as a training pass differentiates `grouped_matmul_for_platform` (kernel "auto"): the
    vjp of each matmul, given its output's cotangent — d lhs and d rhs for bfloat16 weights, d lhs
    alone through int8 and int4 weights (a frozen QLoRA base)."""
    import jax
    import jax.numpy as jnp

    from clover_jax.core.quantization import QuantSpec
    from pallas_kernels import grouped_matmul_for_platform

    spec = jax.ShapeDtypeStruct
    bf16, i32 = jnp.bfloat16, jnp.int32
    for fmt in FORMATS:
        quant = QuantSpec.parse(fmt)
        # gate_up only, the larger of the two (each case costs ~10 s of compiling per target):
        # the down projection's backward is the same kernels at other widths.
        for name, (depth, cols) in [("gate_up", MATMULS["gate_up"])]:
            lhs, d_out = spec((BACKWARD_ROWS, depth), bf16), spec((BACKWARD_ROWS, cols), bf16)
            sizes = spec((EXPERTS,), i32)
            if quant is None:
                def backward(lhs, rhs, sizes, d_out):
                    matmul = lambda lhs, rhs: grouped_matmul_for_platform(platform, lhs, rhs, sizes)
                    return jax.vjp(matmul, lhs, rhs)[1](d_out)

                args = (lhs, spec((EXPERTS, cols, depth), bf16), sizes, d_out)
            else:
                def backward(lhs, values, sizes, d_out, scales):
                    matmul = lambda lhs: grouped_matmul_for_platform(platform, lhs, values, sizes, rhs_scales=scales)
                    return jax.vjp(matmul, lhs)[1](d_out)

                (values_shape, scales_shape), (values_dtype, scales_dtype) = (
                    quant.stored_shapes((EXPERTS, cols, depth)), quant.stored_dtypes())
                args = (lhs, spec(values_shape, values_dtype), sizes, d_out, spec(scales_shape, scales_dtype))
            yield f"experts_backward/{fmt or 'bf16'}/{name}", backward, args


# The training pass's GDN rule, differentiated: the clean stream of 2,048 tokens with the state
# before every block of 32 (`gdn_chunk_with_block_states`), forward the Pallas kernel, backward the
# XLA rule's derivative. Its own function: other cases are added beside it.
BACKWARD_BLOCK = 32


def gdn_backward_cases():
    """(name, function, abstract args): value and gradients w.r.t. q, k, v, decay, beta."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import gdn_chunk_with_block_states

    spec = jax.ShapeDtypeStruct
    f32, bf16 = jnp.float32, jnp.bfloat16
    qk = spec((1, TOKENS, KEY_HEADS, HEAD_DIM), f32)
    args = (qk, qk, spec((1, TOKENS, VALUE_HEADS, HEAD_DIM), bf16), spec((1, TOKENS, VALUE_HEADS), f32),
            spec((1, TOKENS, VALUE_HEADS), bf16), spec((1, TOKENS // BACKWARD_BLOCK), jnp.bool_))

    def loss(query, key, value, decay, beta, resets):
        out, _, states = gdn_chunk_with_block_states(query, key, value, decay, beta, block_size=BACKWARD_BLOCK,
                                                     resets=resets, interpret=False)
        return jnp.sum(out * out) + jnp.sum(states * states)

    yield f"gdn_chunk_backward/{TOKENS}", jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)), args


def main(out_path: str, targets: tuple[str, ...] = TARGETS) -> None:
    import jax

    from clover_jax.api.compile.deviceless import compiler_error
    from clover_jax.parallel.targets import compile_only_devices, target

    results = {}
    for name in targets:
        chosen = target(name)
        device = compile_only_devices(chosen)[0]
        sharding = jax.sharding.SingleDeviceSharding(device)
        for case, function, args in cases(chosen.platform):
            placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
            try:
                # Mosaic's lowering of integer arithmetic asks the default device what it is
                with jax.default_device(device):
                    lowered = jax.jit(function).lower(*placed)
                compiled = lowered.compile()
                results[f"{name}/{case}"] = {
                    "custom_call": CUSTOM_CALL[chosen.platform] in lowered.as_text(),
                    "out": [[list(o.shape), str(o.dtype)] for o in jax.tree.leaves(lowered.out_info)],
                    "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                }
            except Exception as error:  # the compiler's refusal is the finding
                results[f"{name}/{case}"] = {"error": compiler_error(error)}
            print(name, case, results[f"{name}/{case}"], file=sys.stderr)
    with open(out_path, "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main(sys.argv[1], tuple(sys.argv[2:]) or TARGETS)
