"""Export the whole compiled decoders for TPU and CUDA from this CPU host; started by
`tests/decoding/test_export_decode.py` in a fresh process with 8 fake CPU devices (a mesh needs them, and
their number is fixed when JAX starts).

    python -m tests.decoding.export_decode_run OUT.json

The model has Clover-35B-A3B's layer shapes (hidden 2048; GDN 16 key / 32 value heads of 128;
attention 16 query / 2 K/V heads of 256; 256 experts of 512, top-8; vocabulary 248,320) with two
layer groups (8 layers), bfloat16, the Pallas kernels (GDN chunked rule, grouped expert matmul)
on a (data 2, expert 2, tensor 2) mesh with expert parallelism. Parameters and inputs are abstract
(`jax.ShapeDtypeStruct` with their shardings), so nothing is allocated. For each platform the
block-diffusion loop (`decoding.block_loop.run_block_decoder`) and the autoregressive loop
(`decoding.autoregressive.run_autoregressive`) are exported with `jax.export`; the JSON records,
per export, the kernels' custom calls found in the module and the output shapes.
"""

from __future__ import annotations

import json
import sys

REAL_LAYERS = dict(
    model_type="clover_moe", vocab_size=248320, hidden_size=2048, num_hidden_layers=8, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_conv_kernel_dim=4, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8, full_attention_interval=4,
    mask_token_id=248319, eos_token_id=[248046], max_position_embeddings=131072, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
)
TRITON_CALL = "__gpu$xla.gpu.triton"
CUSTOM_CALLS = {"tpu": ["tpu_custom_call"], "cuda": [TRITON_CALL]}
BATCH, BLOCK, PREFIX_BLOCKS, MAX_BLOCKS = 2, 32, 2, 2


def nest(flat: dict) -> dict:
    tree: dict = {}
    for path, leaf in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return tree


def main(out_path: str) -> None:
    import jax
    import jax.numpy as jnp

    from clover_jax import CloverConfig, MeshSharding, make_mesh
    from clover_jax.core.kernels import KernelChoice
    from clover_jax.nn.model import CloverTransformer, TransformerPasses
    from clover_jax.core.param_layout import flat_layout
    from decoding.autoregressive import AutoregressiveSpec, run_autoregressive
    from decoding.block_loop import LoopSpec, Request, run_block_decoder
    from decoding.controls import Controls, TokenIds
    from decoding.schedules import low_confidence

    config = CloverConfig.from_dict(REAL_LAYERS)
    mesh_sharding = MeshSharding(make_mesh(2, 2, 2), config)
    params = nest({path: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=mesh_sharding.param_sharding(path))
                   for path, shape in flat_layout(config).items()})
    batched = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=mesh_sharding.batch_sharding(BATCH, len(shape)))
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)
    i32, f32 = jnp.int32, jnp.float32
    controls = Controls(*[scalar(f32)] * 10, scalar(i32), scalar(f32), scalar(f32))
    ids = TokenIds(jax.ShapeDtypeStruct((1,), i32), scalar(i32), scalar(i32), scalar(i32))
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    request = Request(batched((BATCH, PREFIX_BLOCKS * BLOCK), i32), batched((BATCH, BLOCK), i32),
                      batched((BATCH, BLOCK), bool), batched((BATCH,), i32), batched((BATCH,), i32),
                      batched((BATCH,), i32), batched((BATCH,), i32), batched((BATCH,), bool), batched((BATCH,), bool),
                      key, scalar(f32), {"threshold": scalar(f32)})
    loop_spec = LoopSpec(BLOCK, PREFIX_BLOCKS, MAX_BLOCKS, BLOCK, False, low_confidence, True, False, 2048)
    ar_spec = AutoregressiveSpec(PREFIX_BLOCKS * BLOCK, 64, False, 2048)
    results = {}
    for platform, kernel_platform in (("tpu", "tpu"), ("cuda", "gpu")):
        # cuDNN attention cannot be lowered without a GPU present, so attention stays on the online
        # softmax here; the GDN rule and the routed experts take the Pallas kernels.
        kernels = KernelChoice(attention="online", gdn="pallas", moe="pallas", platform=kernel_platform,
                               layer_loop="scan")
        passes = TransformerPasses(CloverTransformer(config, jnp.bfloat16, kernels, mesh_sharding))
        disabled = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
        exports = {
            "block_diffusion": lambda: jax.export.export(run_block_decoder.jitted, platforms=[platform],
                                                         disabled_checks=disabled)(
                passes, params, loop_spec, request, controls, ids),
            "autoregressive": lambda: jax.export.export(run_autoregressive.jitted, platforms=[platform],
                                                        disabled_checks=disabled)(
                passes, params, ar_spec, batched((BATCH, PREFIX_BLOCKS * BLOCK), i32), batched((BATCH,), i32),
                batched((BATCH,), i32), batched((BATCH,), bool), key, controls, ids),
        }
        for name, export in exports.items():
            exported = export()
            text = exported.mlir_module()
            results[f"{platform}/{name}"] = {
                "custom_calls": {call: text.count(call) for call in CUSTOM_CALLS[platform]},
                "shard_map": "shard_map" in text or "sdy.manual_computation" in text,
                "out_shapes": [list(a.shape) for a in exported.out_avals],
                "platforms": list(exported.platforms),
            }
            print(f"exported {platform}/{name}: {results[f'{platform}/{name}']['custom_calls']}", file=sys.stderr)
    with open(out_path, "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main(sys.argv[1])
