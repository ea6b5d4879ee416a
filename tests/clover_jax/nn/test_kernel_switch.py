"""One switch, impl="auto" | "pallas" | "xla", and the model gives the same logits either way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax import CloverModel
from clover_jax.core import kernels
from clover_jax.nn.expert_dispatch import grouped_expert_mlp, routed_expert_mlp
from clover_jax.core.kernels import KernelChoice, choose_kernels
from tests.conftest import MASK_ID, token_ids


def test_auto_takes_kernels_on_accelerators_and_xla_on_cpu():
    # CPU runs the layer groups unrolled over separate parameter arrays; accelerators scan them.
    assert choose_kernels("auto", "cpu") == KernelChoice("online_softmax", "xla", "xla", "cpu", "unrolled")
    assert choose_kernels("auto", "cuda") == KernelChoice("dot_product_attention", "pallas", "pallas", "gpu", "scan")
    assert choose_kernels("auto", "tpu") == KernelChoice("online_softmax", "pallas", "pallas", "tpu", "scan")
    assert choose_kernels("xla", "tpu") == KernelChoice("online_softmax", "xla", "xla", "tpu", "scan")
    assert choose_kernels("pallas", "cpu") == KernelChoice("dot_product_attention", "pallas", "pallas", "cpu", "unrolled")
    assert choose_kernels("pallas", "cpu").interpret
    with pytest.raises(ValueError, match="impl='triton' is not one of"):
        choose_kernels("triton")


def test_platforms_have_one_vocabulary_and_gpu_lowering_names_mean_gpu():
    from pallas_kernels import platforms

    assert kernels.PLATFORMS == platforms.PLATFORMS
    for name in ("cpu", "gpu", "tpu", "cuda", "rocm"):
        assert kernels.platform_name(name) == platforms.platform_name(name)
    assert choose_kernels("auto", "rocm").platform == "gpu" and choose_kernels("auto", "gpu").platform == "gpu"
    assert KernelChoice(platform="cuda") == KernelChoice(platform="gpu")
    for unknown in (lambda: choose_kernels("auto", "metal"), lambda: KernelChoice(platform="metal"),
                    lambda: platforms.platform_name("metal")):
        with pytest.raises(ValueError, match="unknown platform 'metal'"):
            unknown()


def test_the_attention_choice_is_named_for_what_it_selects():
    # impl="pallas" forces the Pallas kernels; attention has none and takes jax.nn.dot_product_attention
    assert choose_kernels("pallas", "tpu").attention == "dot_product_attention"
    assert choose_kernels("auto", "tpu").attention == "online_softmax"
    for earlier in ("splash", "online", "fused"):  # the earlier names went with version 0.1.0
        with pytest.raises(ValueError, match=f"KernelChoice.attention='{earlier}' is not one of"):
            KernelChoice(earlier)


def test_grouped_matmul_experts_equal_the_tiled_scan_including_dropped_pairs():
    rng = np.random.RandomState(0)
    tokens, hidden, intermediate, experts, top_k = 13, 16, 8, 6, 2
    x = jnp.asarray(rng.randn(tokens, hidden), jnp.float32)
    ids = jnp.asarray(rng.randint(0, experts + 2, (tokens, top_k)))  # ids >= 6 are held elsewhere
    weights = jnp.asarray(rng.rand(tokens, top_k), jnp.float32)
    gate_up = jnp.asarray(rng.randn(experts, 2 * intermediate, hidden) / 4, jnp.float32)
    down = jnp.asarray(rng.randn(experts, hidden, intermediate) / 4, jnp.float32)
    expected = routed_expert_mlp(x, ids, weights, gate_up, down)
    here = np.asarray(ids) < experts
    manual = sum(np.where(here[:, k, None], np.asarray(weights)[:, k, None] * np.stack([
        np.asarray(down[e]) @ (np.asarray(jax.nn.silu(gate_up[e, :intermediate] @ x[t])) * np.asarray(
            gate_up[e, intermediate:] @ x[t])) if e < experts else np.zeros(hidden)
        for t, e in enumerate(np.asarray(ids)[:, k])]), 0) for k in range(top_k))
    np.testing.assert_allclose(expected, manual, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(grouped_expert_mlp(x, ids, weights, gate_up, down, "cpu"), expected,
                               atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def pallas_model(clover):
    return CloverModel(clover.config, clover.params, clover.dtype, clover.path, impl="pallas")


def test_pallas_impl_gives_the_xla_logits(clover, pallas_model):
    assert pallas_model.kernels.gdn == "pallas" and pallas_model.kernels.moe == "pallas"
    ids = token_ids(2, 70, clover.config.vocab_size, seed=4)  # a chunk of 64 and a partial one
    # The GDN kernel matches its oracle to ~1e-6 (tests/pallas_kernels); 8 layers amplify that a little.
    np.testing.assert_allclose(pallas_model.forward(ids), clover.forward(ids), atol=5e-4, rtol=1e-4)
    prefix, block = ids[:, :37], np.where(np.arange(8) % 3 == 0, MASK_ID, ids[:, 37:45])
    np.testing.assert_allclose(pallas_model.denoise_logits(prefix, block), clover.denoise_logits(prefix, block),
                               atol=5e-4, rtol=1e-4)
