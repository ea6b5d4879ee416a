"""The training pass and its gradient are the same whichever kernel runs the GDN rule: the Pallas
kernel with block states (interpreted here, as the CPU has no Pallas compiler) against the XLA rule."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from clover_jax.core.streams import make_streams
from clover_jax.training.block_pass import stream_pass, training_module
from tests.conftest import MASK_ID
from tests.training.test_loss import B, model, packed_rows  # noqa: F401  (the module-scoped fixture)


def test_the_pallas_gdn_rule_gives_the_xla_rules_pass_and_gradient(model):  # noqa: F811
    rows = packed_rows()
    rng = np.random.RandomState(4)
    blocks = np.asarray(rows.block_index)
    targets = np.asarray(rows.clean_ids).reshape(2, -1, B)[np.arange(2)[:, None], np.minimum(blocks, 5)]
    noisy = jnp.asarray(np.where(rng.rand(*targets.shape) < 0.5, MASK_ID, targets), jnp.int32)
    streams = make_streams(rows.segment, rows.block_index, B)
    xla = training_module(model.module)
    pallas = xla.clone(kernels=dataclasses.replace(xla.kernels, gdn="pallas"))
    assert [m.kernels.block_states_rule(B).kernel for m in (xla, pallas)] == ["chunked", "pallas"]

    def objective(module):
        """A weighted sum of both streams' final hidden states: every row's cotangent differs."""
        def value(params):
            hidden = stream_pass(module, params, rows.clean_ids, noisy, streams, block_size=B, coreset=True,
                                 coreset_top_p=jnp.float32(0.9)).hidden
            return jnp.sum(hidden * jnp.cos(jnp.arange(hidden.size, dtype=jnp.float32).reshape(hidden.shape)))
        return value

    assert "pallas_call" in str(jax.make_jaxpr(objective(pallas))(model.params))  # the kernel runs
    value, grads = jax.jit(jax.value_and_grad(objective(pallas)))(model.params)
    expected, expected_grads = jax.jit(jax.value_and_grad(objective(xla)))(model.params)
    np.testing.assert_allclose(float(value), float(expected), rtol=1e-5)
    scale = max(float(jnp.max(jnp.abs(leaf))) for leaf in jax.tree.leaves(expected_grads))
    differences = jax.tree.leaves(jax.tree_util.tree_map(lambda a, b: float(jnp.max(jnp.abs(a - b))), grads,
                                                         expected_grads))
    assert max(differences) / scale < 1e-5, max(differences) / scale


def test_the_training_gdn_rule_takes_the_kernel_where_the_blocks_fit_its_chunks():
    from clover_jax.core.kernels import GDNRule, choose_kernels

    tpu, gpu, cpu = (choose_kernels("auto", platform) for platform in ("tpu", "gpu", "cpu"))
    assert [tpu.block_states_rule(size) for size in (4, 32, 64, 128)] == [
        GDNRule("pallas", 4, False), GDNRule("pallas", 32, False), GDNRule("pallas", 64, False),
        GDNRule("pallas", 64, False)]
    assert gpu.block_states_rule(32) == GDNRule("pallas", 32, False)
    # a block of 48 ends inside a 64-row chunk: the XLA rule, one chunk per block
    assert tpu.block_states_rule(48) == GDNRule("chunked", 48, False)
    assert cpu.block_states_rule(32) == GDNRule("chunked", 32, True)
    assert choose_kernels("pallas", "cpu").block_states_rule(32) == GDNRule("pallas", 32, True)
