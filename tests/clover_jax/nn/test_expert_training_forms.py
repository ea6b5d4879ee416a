"""Routed experts in training: the grouped form (two grouped matmuls with their backward pass,
interpreted here) gives the loss and gradients of the expert loop with its written-out backward —
for the tokens, the router's combine weights, the expert stacks and the experts' LoRA factors,
over float, int8 and int4 bases — and the training choice takes it on GPU and TPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax.core.kernels import KernelChoice
from clover_jax.nn.expert_dispatch import grouped_expert_mlp, routed_expert_mlp
from clover_jax.nn.expert_lora import ExpertAdapters, adapted_expert_mlp

HIDDEN, INTERMEDIATE, RANK = 32, 16, 4
GROUPED = KernelChoice(moe="pallas").for_training().expert_rule(False)  # CPU: the Pallas kernels, interpreted


def case(num_tokens, num_experts, top_k, seed):
    rng = np.random.RandomState(seed)
    tokens = jnp.asarray(rng.randn(num_tokens, HIDDEN), jnp.float32)
    expert_ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(num_tokens)])
    weights = rng.dirichlet(np.ones(top_k), num_tokens).astype(np.float32)
    gate_up = jnp.asarray(rng.randn(num_experts, 2 * INTERMEDIATE, HIDDEN) / 4, jnp.float32)
    down = jnp.asarray(rng.randn(num_experts, HIDDEN, INTERMEDIATE) / 3, jnp.float32)
    cotangent = jnp.asarray(rng.randn(num_tokens, HIDDEN), jnp.float32)
    return tokens, jnp.asarray(expert_ids, jnp.int32), jnp.asarray(weights), gate_up, down, cotangent


def assert_close(actual, expected, rtol=1e-5):
    expected = np.asarray(expected, np.float64)
    np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=0,
                               atol=rtol * (float(np.max(np.abs(expected))) or 1.0))


def value_and_grads(mlp, tokens, expert_ids, weights, gate_up, down, cotangent, argnums=(0, 1, 2, 3)):
    loss = lambda tokens, weights, gate_up, down: jnp.sum(mlp(tokens, expert_ids, weights, gate_up, down) * cotangent)
    return jax.jit(jax.value_and_grad(loss, argnums))(tokens, weights, gate_up, down)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, held", [
    (40, 6, 2, 6),     # partial row tiles, every expert used
    (5, 16, 3, 12),    # more experts than pairs, most groups empty; pairs of experts 12..15 dropped (a shard's view)
])
def test_grouped_experts_have_the_loops_loss_and_gradients(num_tokens, num_experts, top_k, held):
    tokens, ids, weights, gate_up, down, cotangent = case(num_tokens, num_experts, top_k, seed=num_tokens)
    ids = jnp.where(ids < held, ids, held)
    gate_up, down = gate_up[:held], down[:held]
    grouped = functools.partial(grouped_expert_mlp, platform="cpu", kernel=GROUPED.grouped_kernel,
                                interpret=GROUPED.interpret)
    loop = functools.partial(routed_expert_mlp, strategy="loop")
    (value, grads), (expected, expected_grads) = (value_and_grads(mlp, tokens, ids, weights, gate_up, down, cotangent)
                                                  for mlp in (grouped, loop))
    assert_close(value, expected)
    for got, want in zip(grads, expected_grads, strict=True):  # tokens, router combine weights, gate_up, down
        assert_close(got, want)


def adapters(num_experts, seed):
    rng = np.random.RandomState(seed)
    factor = lambda *shape: jnp.asarray(rng.randn(*shape) / np.sqrt(shape[-1]), jnp.float32)
    return ExpertAdapters(factor(num_experts, RANK, HIDDEN), factor(num_experts, RANK, 2 * INTERMEDIATE),
                          factor(num_experts, RANK, INTERMEDIATE), factor(num_experts, RANK, HIDDEN))


def test_lora_experts_through_the_grouped_kernels_equal_ragged_dot_over_the_dequantised_base(small_clover_checkpoint):
    """A QLoRA int4 base (read per tile in the forward and in d rows; int8 and float bases are the
    same kernels: tests/pallas_kernels/test_grouped_matmul_backward.py) with float32 factors, the
    grouped form run per device on a mesh (`shard_map`, as on an accelerator mesh; one device here)."""
    from clover_jax.core.config import CloverConfig
    from clover_jax.core.quantization import QuantSpec, quantize
    from clover_jax.nn.moe import expert_parallel_mlp
    from clover_jax.parallel.sharding import MeshSharding, make_mesh

    tokens, ids, weights, gate_up, down, cotangent = case(30, 8, 2, seed=4)
    gate_up, down = (quantize(np.asarray(w), QuantSpec(4, group_size=8)) for w in (gate_up, down))
    factors = adapters(8, seed=1)
    mesh = MeshSharding(make_mesh(devices=jax.devices()[:1]), CloverConfig.from_pretrained(small_clover_checkpoint))
    rule = KernelChoice(moe="pallas").for_training().expert_rule(True, expert_devices=1, on_mesh=True)
    assert rule.kernel == "grouped" and rule.per_device

    def grouped(tokens, weights, factors):
        return expert_parallel_mlp(rule, mesh, tokens, ids, weights, gate_up, down, factors)

    def ragged(tokens, weights, factors):
        return adapted_expert_mlp(tokens, ids, weights, gate_up, down, factors)

    (value, grads), (expected, expected_grads) = (
        jax.jit(jax.value_and_grad(lambda *args, mlp=mlp: jnp.sum(mlp(*args) * cotangent), (0, 1, 2)))(
            tokens, weights, factors) for mlp in (grouped, ragged))
    assert_close(value, expected)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        assert_close(got, want)  # tokens, router combine weights, each expert's four LoRA factors


def test_lora_experts_in_bfloat16_keep_float32_factor_gradients_within_bfloat16_rounding():
    """A bfloat16 pass (the rows enter the adapters' A in bfloat16, the rank-r products in float32)
    against the same pass in float32: outputs and every gradient within bfloat16's rounding, the
    factors' gradients float32."""
    tokens, ids, weights, gate_up, down, cotangent = case(40, 6, 2, seed=7)
    factors = adapters(6, seed=2)

    def run(dtype):
        loss = lambda tokens, factors: jnp.sum(adapted_expert_mlp(
            tokens.astype(dtype), ids, weights.astype(dtype), gate_up.astype(dtype), down.astype(dtype), factors,
            GROUPED).astype(jnp.float32) * cotangent)
        return jax.jit(jax.value_and_grad(loss, (0, 1)))(tokens, factors)

    (value, grads), (expected, expected_grads) = run(jnp.bfloat16), run(jnp.float32)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(grads[1]))
    assert_close(value, expected, rtol=2e-2)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        assert_close(got, want, rtol=3e-2)


def test_lora_experts_in_chunks_of_rows_equal_the_whole_pass():
    """A training pass's routed experts a chunk of rows at a time (`ExpertRule.chunk_rows`, each
    chunk recomputed in the backward pass): 37 rows in chunks of at most 16 (three of 13, two rows
    of padding routed nowhere) give the output and every gradient of one pass over all rows."""
    from clover_jax.core.kernels import TRAIN_EXPERT_CHUNK_ROWS

    tokens, ids, weights, gate_up, down, cotangent = case(37, 6, 2, seed=9)
    factors = adapters(6, seed=3)
    whole = KernelChoice(expert_chunk_rows=0).for_training().expert_rule(False)
    chunked = KernelChoice(expert_chunk_rows=16).for_training().expert_rule(False)
    assert whole.chunk_rows is None and chunked.chunk_rows == 16
    assert KernelChoice().for_training().expert_rule(False).chunk_rows == TRAIN_EXPERT_CHUNK_ROWS

    def run(rule):
        loss = lambda tokens, weights, factors: jnp.sum(
            adapted_expert_mlp(tokens, ids, weights, gate_up, down, factors, rule) * cotangent)
        return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(tokens, weights, factors)

    (value, grads), (expected, expected_grads) = run(chunked), run(whole)
    assert_close(value, expected)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        assert_close(got, want)  # tokens, router combine weights, each expert's four LoRA factors


def test_training_takes_the_grouped_experts_on_accelerators_and_the_loop_on_cpu():
    from clover_jax.core.kernels import choose_kernels

    for impl in ("xla", "auto", "pallas"):
        for platform, kernel in (("tpu", "megablox"), ("gpu", "pallas")):
            rule = choose_kernels(impl, platform).for_training().expert_rule(False)
            assert (rule.kernel, rule.grouped_kernel) == ("grouped", kernel), (impl, platform)
            assert choose_kernels(impl, platform).for_training().expert_rule(True).grouped_kernel == "pallas"
    on_cpu = choose_kernels("auto", "cpu").for_training().expert_rule(False)
    assert (on_cpu.kernel, on_cpu.strategy) == ("tiled", "loop")
    assert choose_kernels("pallas", "cpu").for_training().expert_rule(False) == GROUPED
    assert GROUPED.kernel == "grouped" and GROUPED.interpret


def test_a_training_pass_with_grouped_experts_has_the_loss_and_gradients_of_the_loop(small_clover_checkpoint):
    from clover_jax import CloverModel
    from clover_jax.core.streams import make_streams
    from clover_jax.training.block_pass import stream_pass, training_module

    clover = CloverModel.from_pretrained(small_clover_checkpoint, progress=False)  # one GDN and one attention layer
    block, length = 4, 8
    rng = np.random.RandomState(0)
    vocab = clover.config.vocab_size
    clean = jnp.asarray(rng.randint(0, vocab - 1, (2, length)), jnp.int32)
    noisy = jnp.asarray(rng.randint(0, vocab - 1, (2, length // block, block)), jnp.int32)
    blocks = jnp.broadcast_to(jnp.arange(length // block), (2, length // block))
    streams = make_streams(jnp.ones((2, length), jnp.int32), blocks, block)

    def loss(params, module):
        out = stream_pass(module, params, clean, noisy, streams, block_size=block, coreset=True,
                          coreset_top_p=jnp.float32(0.9))
        return jnp.mean(jnp.square(out.hidden.astype(jnp.float32)))

    grouped = training_module(clover.module.clone(kernels=KernelChoice(moe="pallas")))
    loop = training_module(clover.module)
    assert grouped.kernels.moe == "pallas" and loop.kernels.moe == "xla"
    (value, grads), (expected, expected_grads) = (
        jax.jit(jax.value_and_grad(functools.partial(loss, module=module)))(clover.params)
        for module in (grouped, loop))
    np.testing.assert_allclose(float(value), float(expected), rtol=1e-5)
    scale = max(float(jnp.max(jnp.abs(leaf))) for leaf in jax.tree.leaves(expected_grads))
    worst = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), grads, expected_grads)))
    assert worst / scale < 1e-5
