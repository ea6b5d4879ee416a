"""One switch, impl="auto" | "pallas" | "xla", and the model gives the same logits either way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from clover_jax import CloverModel
from clover_jax.core import kernels
from clover_jax.core.kernels import ExpertRule, GDNRule, KernelChoice, choose_kernels
from clover_jax.nn.expert_dispatch import grouped_expert_mlp, routed_expert_mlp
from tests.conftest import MASK_ID, token_ids


def test_auto_takes_kernels_on_accelerators_and_xla_on_cpu():
    assert choose_kernels("auto", "cpu") == KernelChoice("online_softmax", "xla", "xla", "cpu")
    assert choose_kernels("auto", "cuda") == KernelChoice("dot_product_attention", "pallas", "pallas", "gpu",
                                                          pages="pallas")
    assert choose_kernels("auto", "tpu") == KernelChoice("online_softmax", "pallas", "pallas", "tpu", pages="pallas")
    assert choose_kernels("xla", "tpu") == KernelChoice("online_softmax", "xla", "xla", "tpu")
    assert choose_kernels("pallas", "cpu") == KernelChoice("dot_product_attention", "pallas", "pallas", "cpu",
                                                           pages="pallas")
    assert choose_kernels("pallas", "cpu").interpret and not choose_kernels("auto", "tpu").interpret
    # CPU runs the layer groups unrolled over separate parameter arrays; accelerators scan them.
    from clover_jax.nn.model import layer_loop_for

    assert [layer_loop_for(p) for p in ("cpu", "gpu", "tpu")] == ["unrolled", "scan", "scan"]
    with pytest.raises(ValueError, match="impl='triton' is not one of"):
        choose_kernels("triton")


def test_cpu_runs_each_expert_from_its_own_buffer_sharing_the_stack(clover):
    """On CPU a layer's routed-expert stacks of large experts run as tuples of per-expert arrays (a
    single row reads its experts in place), views of the stacked buffer rather than copies;
    `params` restacks them. Experts under `PER_EXPERT_MIN_BYTES` (this model's) stay stacked."""
    from clover_jax.nn.expert_dispatch import per_expert
    from clover_jax.nn.run_layout import PER_EXPERT_MIN_BYTES, stack_groups, unstack_groups

    config = clover.config
    mlp = clover.run_params["groups"][0]["layer_0"]["mlp"]
    expert_bytes = sum(mlp[name][0].nbytes for name in ("experts_gate_up_proj", "experts_down_proj"))
    assert expert_bytes < PER_EXPERT_MIN_BYTES and not per_expert(mlp["experts_gate_up_proj"])
    canonical = clover.params
    for min_bytes in (expert_bytes, expert_bytes + 1):
        split = unstack_groups(canonical, per_expert_min_bytes=min_bytes)["groups"][0]["layer_0"]["mlp"]
        for name in ("experts_gate_up_proj", "experts_down_proj"):
            experts = split[name]
            assert per_expert(experts) == (min_bytes == expert_bytes)
            if not per_expert(experts):
                continue
            assert len(experts) == config.num_experts
            stride = experts[0].size * experts[0].dtype.itemsize
            first = experts[0].unsafe_buffer_pointer()
            assert [expert.unsafe_buffer_pointer() - first for expert in experts] == [
                e * stride for e in range(len(experts))]
    gate_up = canonical["groups"]["layer_0"]["mlp"]["experts_gate_up_proj"]
    assert gate_up.shape == (config.num_groups, config.num_experts, 2 * config.moe_intermediate_size,
                             config.hidden_size)
    split = unstack_groups(canonical, per_expert_min_bytes=0)
    jax.tree_util.tree_map(np.testing.assert_array_equal, stack_groups(split), canonical)
    # the model gives the same logits from either layout: a 6-row causal pass, then one row
    ids = token_ids(1, 7, config.vocab_size)

    @jax.jit
    def two_passes(params):
        first = clover.passes.causal(params, ids[:, :6], clover.passes.new_state(1, 8))
        return first.logits, clover.passes.causal(params, ids[:, 6:], first.state).logits

    for expected, got in zip(two_passes(clover.run_params), two_passes(split), strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=1e-6)


def test_platforms_have_one_vocabulary_and_gpu_lowering_names_mean_gpu():
    from pallas_kernels import platforms

    assert kernels.PLATFORMS is platforms.PLATFORMS and kernels.platform_name is platforms.platform_name
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


def test_each_hot_spot_is_resolved_once_into_the_rule_that_runs():
    cpu, tpu, gpu = choose_kernels("auto", "cpu"), choose_kernels("auto", "tpu"), choose_kernels("auto", "gpu")
    # GDN: one row runs token by token; the XLA rule chunks by the pass's rows, the Pallas kernel by 64
    assert cpu.gdn_rule(1) == GDNRule("recurrent", 1, True)
    assert [cpu.gdn_rule(rows).chunk_size for rows in (2, 16, 17, 32, 33, 2048)] == [16, 16, 32, 32, 64, 64]
    assert cpu.gdn_rule(16) == GDNRule("chunked", 16, True)
    assert tpu.gdn_rule(16) == GDNRule("pallas", 64, False)
    assert KernelChoice(gdn_chunk=8).gdn_rule(100) == GDNRule("chunked", 8, True)
    assert KernelChoice("online_softmax", "pallas", "pallas", "tpu", gdn_chunk=128).gdn_rule(16).chunk_size == 128
    # routed experts: XLA tiles on CPU; grouped matmuls elsewhere, megablox for float weights on TPU
    assert cpu.expert_rule(False) == ExpertRule("tiled", None, "cpu", False, False)
    assert cpu.expert_rule(False, expert_devices=8, on_mesh=True).per_device
    assert not cpu.expert_rule(False, expert_devices=1, on_mesh=True).per_device
    assert tpu.expert_rule(False) == ExpertRule("grouped", "megablox", "tpu", False, False)
    assert tpu.expert_rule(True).grouped_kernel == "pallas"  # megablox takes float weights only
    assert gpu.expert_rule(False) == ExpertRule("grouped", "pallas", "gpu", False, False)
    assert choose_kernels("pallas", "cpu").expert_rule(False) == ExpertRule("grouped", "pallas", "cpu", True, False)
    # the tiled form's strategy: the loop unless asked (training asks for the differentiable "dense")
    assert cpu.expert_rule(False).strategy == "auto"
    assert KernelChoice(expert_strategy="dense").expert_rule(False).strategy == "dense"
    with pytest.raises(ValueError, match="expert_strategy='fast'"):
        KernelChoice(expert_strategy="fast")
    # a Pallas custom call on a mesh runs per device, whatever the expert axis
    assert tpu.expert_rule(False, expert_devices=1, on_mesh=True).per_device


def test_the_rollback_reruns_the_gdn_rule_with_the_chunk_of_the_recording_pass(monkeypatch):
    from clover_jax.core.state import GDNRecord
    from clover_jax.nn import rollback

    chunks = []
    monkeypatch.setattr(rollback, "chunked_gated_delta_rule",
                        lambda *args, chunk_size: chunks.append(chunk_size) or (None, args[-1]))
    groups, batch, rows, heads, dim, conv = 1, 1, 24, 2, 4, 3
    record = GDNRecord(window=jnp.zeros((groups, batch, conv + rows, 8)),
                       initial=jnp.zeros((groups, batch, heads, dim, dim)),
                       key=jnp.zeros((groups, batch, rows, heads, dim)),
                       value=jnp.zeros((groups, batch, rows, heads, dim)),
                       decay=jnp.zeros((groups, batch, rows, heads)), beta=jnp.zeros((groups, batch, rows, heads)))
    for choice, expected in ((KernelChoice(), 32), (KernelChoice(gdn_chunk=8), 8),
                             (KernelChoice("online_softmax", "pallas", "pallas", "tpu"), 64)):
        rollback._restored(record, jnp.asarray([5]), choice)
        assert chunks[-1] == expected


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
    np.testing.assert_allclose(grouped_expert_mlp(x, ids, weights, gate_up, down, platform="cpu", kernel="pallas",
                                                  interpret=True), expected,
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
