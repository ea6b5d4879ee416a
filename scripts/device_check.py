"""One command to run on the first accelerator at hand: do the Pallas kernels compile and equal
their oracles at Clover-35B's shapes, how fast are they, and how fast does a model with the real
layer shapes decode at batch 1?

    python scripts/device_check.py                      # on a GPU or TPU: real shapes
    python scripts/device_check.py --small              # anywhere (CPU: interpret mode), small shapes
    python scripts/device_check.py --out result.json --markdown docs/device_check.md

Checks (each a row of the JSON and the Markdown):
  * `gdn_chunk` against `gdn_chunk_reference` (the gated delta rule token by token): 2048 tokens,
    16 key / 32 value heads of 128, bfloat16 inputs, float32 state; max abs difference of the
    outputs and the final state, relative to their scale, and the kernel's median time against
    the XLA chunked rule's (`clover_jax.nn.gated_delta`);
  * `grouped_matmul` against `grouped_matmul_reference` (`jax.lax.ragged_dot`): 4096 routed rows,
    hidden 2048, 256 experts of intermediate 512 (gate_up and down), with and without a coreset of
    64 active experts; and `grouped_matmul_for_platform` (megablox on TPU); times beside ragged_dot;
  * `paged_attention` (the serving engine's attention over K/V pages) against
    `paged_attention_reference`: a pass of 1,024 rows in tiles of 16 over 16 slots of 4,096
    positions, 16 query / 2 key-value heads of 256, bfloat16; its time beside the plain-JAX rule's;
  * decoding: a random model with the real layer shapes and `--groups` layer groups (3 GDN + 1
    attention each; vocabulary 248,320; bfloat16), batch 1: autoregressive tokens/s, and the time of
    one denoising step of a 32-token block with the coreset, both with `impl="auto"`;
  * the serving engine on a random model of `--engine-groups` groups (10: Clover-35B's 40 layers, on
    a device), block diffusion at block size 32: the median time of one engine pass with 1 request
    and with 16 (a narrow set: the passes those requests meet compile as they come).
The device is named in the output. Nothing is written unless --out / --markdown is given.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REAL = dict(tokens=2048, key_heads=16, value_heads=32, head_dim=128, rows=4096, hidden=2048, experts=256,
            intermediate=512, coreset=64, vocab=248320, attention_heads=16, kv_heads=2, attention_head_dim=256,
            paged_tokens=1024, paged_slots=16, paged_context=4096)
SMALL = dict(tokens=80, key_heads=2, value_heads=4, head_dim=16, rows=96, hidden=64, experts=8, intermediate=32,
             coreset=3, vocab=512, attention_heads=4, kv_heads=2, attention_head_dim=32, paged_tokens=64,
             paged_slots=4, paged_context=64)


def timed(fn, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def relative_error(ours, reference) -> float:
    import jax.numpy as jnp

    ours, reference = jnp.asarray(ours, jnp.float32), jnp.asarray(reference, jnp.float32)
    return float(jnp.max(jnp.abs(ours - reference)) / (jnp.max(jnp.abs(reference)) + 1e-30))


def check_gdn(shapes: dict, interpret: bool, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from clover_jax.nn.gated_delta import chunked_gated_delta_rule
    from clover_jax.nn.layers import l2_normalize
    from pallas_kernels import gdn_chunk, gdn_chunk_reference

    keys = jax.random.split(jax.random.key(0), 6)
    t, hk, hv, d = shapes["tokens"], shapes["key_heads"], shapes["value_heads"], shapes["head_dim"]
    query = l2_normalize(jax.random.normal(keys[0], (1, t, hk, d))) * d ** -0.5
    key = l2_normalize(jax.random.normal(keys[1], (1, t, hk, d)))
    value = jax.random.normal(keys[2], (1, t, hv, d))
    decay = -jax.nn.softplus(jax.random.normal(keys[3], (1, t, hv)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (1, t, hv)))
    state = jax.random.normal(keys[5], (1, hv, d, d)) * 0.1
    inputs = [x.astype(jnp.bfloat16) for x in (query, key, value, decay, beta)] + [state]
    kernel = jax.jit(lambda *a: gdn_chunk(*a, interpret=interpret))
    reference = jax.jit(gdn_chunk_reference)
    xla = jax.jit(chunked_gated_delta_rule)
    (out, final), (expected, expected_final) = kernel(*inputs), reference(*inputs)
    error = max(relative_error(out, expected), relative_error(final, expected_final))
    result = {"kernel": "gdn_chunk", "shape": f"{t} tokens, {hk}/{hv} heads of {d}", "relative_error": error,
              "passed": error < 2e-2}
    if not interpret:
        result.update(kernel_ms=1e3 * timed(lambda: kernel(*inputs), repeats),
                      xla_ms=1e3 * timed(lambda: xla(*inputs), repeats))
    return result


def check_grouped_matmuls(shapes: dict, platform: str, interpret: bool, repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import grouped_matmul, grouped_matmul_for_platform, grouped_matmul_reference

    rows, hidden, experts, inter = shapes["rows"], shapes["hidden"], shapes["experts"], shapes["intermediate"]
    rng = np.random.default_rng(0)
    sizes = np.bincount(rng.integers(0, experts, rows - rows // 16), minlength=experts).astype(np.int32)
    group_sizes = jnp.asarray(sizes)  # rows past the total are padding and give 0
    active = jnp.asarray(np.sort(rng.choice(experts, shapes["coreset"], replace=False)).astype(np.int32))
    results = []
    for name, (depth, cols) in {"gate_up": (hidden, 2 * inter), "down": (inter, hidden)}.items():
        lhs = jnp.asarray(rng.standard_normal((rows, depth)), jnp.bfloat16)
        rhs = jnp.asarray(rng.standard_normal((experts, cols, depth)) / depth ** 0.5, jnp.bfloat16)
        reference = jax.jit(grouped_matmul_reference)
        cases = {
            "grouped_matmul": (jax.jit(lambda x, w, g: grouped_matmul(x, w, g, interpret=interpret)), None),
            "grouped_matmul (coreset)": (jax.jit(lambda x, w, g: grouped_matmul(x, w, g, active_groups=active,
                                                                                 interpret=interpret)), active),
        }
        if platform != "cpu":
            cases["grouped_matmul_for_platform"] = (
                jax.jit(lambda x, w, g: grouped_matmul_for_platform(platform, x, w, g)), None)
        for kernel_name, (kernel, groups) in cases.items():
            expected = jax.jit(functools.partial(grouped_matmul_reference, active_groups=groups))(lhs, rhs,
                                                                                                  group_sizes)
            error = relative_error(kernel(lhs, rhs, group_sizes), expected)
            result = {"kernel": f"{kernel_name} {name}", "shape": f"{rows} rows, {experts} x [{cols}, {depth}]",
                      "relative_error": error, "passed": error < 2e-2}
            if not interpret:
                result.update(kernel_ms=1e3 * timed(functools.partial(kernel, lhs, rhs, group_sizes), repeats),
                              ragged_dot_ms=1e3 * timed(functools.partial(reference, lhs, rhs, group_sizes), repeats))
            results.append(result)
    return results


def random_model(shapes: dict, groups: int, dtype):
    """A `CloverModel` with the given layer shapes and random weights made on the device."""
    import jax
    import jax.numpy as jnp

    from clover_jax import CloverConfig, CloverModel
    from clover_jax.core.param_layout import flat_layout

    config = CloverConfig.from_dict(dict(
        model_type="clover_moe", vocab_size=shapes["vocab"], hidden_size=shapes["hidden"],
        num_hidden_layers=4 * groups, num_attention_heads=shapes["attention_heads"],
        num_key_value_heads=shapes["kv_heads"], head_dim=shapes["attention_head_dim"],
        linear_key_head_dim=shapes["head_dim"], linear_value_head_dim=shapes["head_dim"],
        linear_num_key_heads=shapes["key_heads"], linear_num_value_heads=shapes["value_heads"],
        linear_conv_kernel_dim=4, moe_intermediate_size=shapes["intermediate"],
        shared_expert_intermediate_size=shapes["intermediate"], num_experts=shapes["experts"],
        num_experts_per_tok=min(8, shapes["experts"]), full_attention_interval=4, mask_token_id=shapes["vocab"] - 1,
        eos_token_id=[shapes["vocab"] - 2], max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}))
    flat, key = {}, jax.random.key(1)
    for index, (path, shape) in enumerate(flat_layout(config).items()):
        matrix = len(shape) >= 2 and path[-1] not in ("conv1d_weight", "conv1d_right_weight")
        leaf = (jax.random.normal(jax.random.fold_in(key, index), shape, jnp.float32) * 0.02 if matrix
                else jnp.zeros(shape, jnp.float32))
        flat[path] = leaf.astype(dtype)
    params: dict = {}
    for path, leaf in flat.items():
        node = params
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = leaf
    return CloverModel(config, params, dtype)


def check_decoding(shapes: dict, groups: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from decoding import generate

    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    model = random_model(shapes, groups, dtype)
    prompt = np.random.default_rng(0).integers(0, shapes["vocab"] - 2, 64).tolist()
    new = 32
    decode = lambda n: generate(model, [prompt], mode="autoregressive", max_new_tokens=n, repetition_penalty=1.0,
                                presence_penalty=0.0, dllm_length_penalty=0.0, dllm_think_end_bias=0.0)
    decode(new), decode(8)
    long = statistics.median(_seconds(lambda: decode(new)) for _ in range(repeats))
    short = statistics.median(_seconds(lambda: decode(8)) for _ in range(repeats))
    state = model.init_state(1, 256 + 32)
    _, state = model.extend(state, np.asarray([prompt * 4], np.int32), logits="none")
    block = np.full((1, 32), model.config.mask_token_id, np.int32)
    step = timed(lambda: model.denoise(state, block).logits, repeats)
    return {"layers": 4 * groups, "dtype": str(jnp.dtype(dtype)), "kernels": str(model.kernels),
            "autoregressive_tokens_per_s": (new - 8) / max(long - short, 1e-9),
            "autoregressive_generate_32_tokens_s": long, "denoise_step_ms_after_256": 1e3 * step}


def check_paged_attention(shapes: dict, interpret: bool, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from clover_jax.nn.paged_attention import paged_attention as plain
    from pallas_kernels.paged_attention import TILE_ROWS, paged_attention
    from pallas_kernels.paged_attention_reference import paged_attention_reference

    tokens, slots, context, page = shapes["paged_tokens"], shapes["paged_slots"], shapes["paged_context"], 16
    heads, kv_heads, dim = shapes["attention_heads"], shapes["kv_heads"], shapes["attention_head_dim"]
    per_slot = context // page
    rng = np.random.default_rng(0)
    pages = lambda: jnp.asarray(rng.normal(size=(1, slots * per_slot + 1, kv_heads, page, dim)), jnp.bfloat16)
    keys, values = pages(), pages()
    table = jnp.asarray(1 + rng.permutation(slots * per_slot).reshape(slots, per_slot), jnp.int32)
    rows_per_slot = tokens // slots
    slot = np.repeat(np.arange(slots), rows_per_slot).astype(np.int32)
    limit = (context - rows_per_slot + np.tile(np.arange(1, rows_per_slot + 1), slots)).astype(np.int32)
    tiles = np.arange(tokens, dtype=np.int32).reshape(-1, TILE_ROWS)
    tile_slot = slot[tiles[:, 0]]
    query = jnp.asarray(rng.normal(size=(tokens, heads, dim)) * dim ** -0.5, jnp.bfloat16)
    args = (query, keys, values, jnp.int32(0), table, jnp.asarray(limit), jnp.asarray(tiles), jnp.asarray(tile_slot))
    kernel = jax.jit(lambda *a: paged_attention(*a, interpret=interpret))
    ours = kernel(*args)
    reference = paged_attention_reference(query, keys, values, 0, table, jnp.asarray(slot), jnp.asarray(limit))
    error = relative_error(ours, reference)
    # bfloat16 attention weights meet the values in the kernel (as flash attention's do): bfloat16's rounding
    row = {"kernel": "paged_attention", "shape": f"{tokens} rows x {heads}/{kv_heads} heads x {dim}, {slots} slots "
           f"of {context}", "relative_error": error, "passed": error < 2e-2}
    if not interpret:
        # the plain-JAX rule scales its queries itself: it is handed them unscaled
        unscaled = (query.astype(jnp.float32) / dim ** -0.5).astype(query.dtype)
        rule = jax.jit(lambda *a: plain(*a))
        rule_args = (unscaled, keys, values, 0, table, jnp.asarray(tiles), jnp.asarray(tile_slot), jnp.asarray(limit))
        row["kernel_ms"] = round(1e3 * timed(lambda: kernel(*args), repeats), 3)
        row["xla_ms"] = round(1e3 * timed(lambda: rule(*rule_args), repeats), 3)
    return row


def check_engine(shapes: dict, groups: int) -> dict:
    """ms per engine pass with 1 and 16 requests decoding by block diffusion (block size 32)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from decoding.engine import Engine, EngineRequest

    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    model = random_model(shapes, groups, dtype)
    rng = np.random.default_rng(0)
    request = lambda seed: EngineRequest(rng.integers(0, shapes["vocab"] - 2, 100).tolist(), seed=seed, overrides={
        "max_new_tokens": 96, "block_size": 32, "dllm_length_penalty": 0.0, "threshold": 0.99})
    out = {"layers": 4 * groups, "dtype": str(jnp.dtype(dtype))}
    with Engine(model, max_running=16, block_sizes=[32], prefill_budget=512, kv_cache_bytes=1 << 30) as engine:
        for count in (1, 16):
            engine.run([request(k) for k in range(count)], timeout=1800)  # compiles the passes they meet
            first = len(engine.passes)
            engine.run([request(100 + k) for k in range(count)], timeout=1800)
            decoding = [record.seconds for record in list(engine.passes)[first:] if not record.prompt_rows]
            out[f"pass_ms_{count}_slots"] = round(1e3 * statistics.median(decoding), 2) if decoding else None
    return out


def _seconds(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def markdown(result: dict) -> str:
    lines = [f"# Device check on {result['device']}", "",
             f"`python scripts/device_check.py{' --small' if result['small'] else ''}`, {result['date']}; "
             f"jax {result['jax']}.", "", "| kernel | shape | relative error | passed | kernel ms | reference ms |",
             "|---|---|---|---|---|---|"]
    for row in result["kernels"]:
        reference = row.get("xla_ms", row.get("ragged_dot_ms"))
        lines.append(f"| {row['kernel']} | {row['shape']} | {row['relative_error']:.2e} | {row['passed']} | "
                     f"{row.get('kernel_ms', '—')} | {reference if reference is not None else '—'} |")
    d, e = result["decoding"], result["engine"]
    lines += ["", f"Decoding, {d['layers']} layers with the real layer shapes, {d['dtype']}, batch 1: "
              f"{d['autoregressive_tokens_per_s']:.1f} autoregressive tokens/s; one denoising step of 32 after 256 "
              f"tokens: {d['denoise_step_ms_after_256']:.2f} ms ({d['kernels']}).", "",
              f"The serving engine, {e['layers']} layers, {e['dtype']}, block diffusion at block size 32: "
              f"{e['pass_ms_1_slots']} ms a pass with 1 request, {e['pass_ms_16_slots']} ms with 16.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="small shapes (any machine; CPU runs interpret mode)")
    parser.add_argument("--groups", type=int, default=2, help="layer groups of the decoding model")
    parser.add_argument("--engine-groups", type=int, default=None,
                        help="layer groups of the engine's model (default: 10, Clover's 40 layers, on a device; "
                             "--groups on a CPU)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("--markdown", help="write a Markdown report here")
    args = parser.parse_args(argv)

    import datetime

    import jax

    platform = jax.default_backend()
    interpret = platform == "cpu"
    shapes = SMALL if args.small or interpret else REAL
    kernels = [check_gdn(shapes, interpret, args.repeats)]
    kernels += check_grouped_matmuls(shapes, platform, interpret, args.repeats)
    kernels.append(check_paged_attention(shapes, interpret, args.repeats))
    result = {"device": f"{jax.devices()[0].device_kind} ({platform})", "small": shapes is SMALL,
              "date": datetime.date.today().isoformat(), "jax": jax.__version__, "kernels": kernels,
              "decoding": check_decoding(shapes, args.groups, args.repeats),
              "engine": check_engine(shapes, args.engine_groups or (args.groups if interpret else 10)),
              "all_passed": all(row["passed"] for row in kernels)}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(markdown(result))
    return 0 if result["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
