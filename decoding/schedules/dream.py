"""Dream's denoising schedule (Ye et al., 2025, `DreamLM/Dream` generation_utils.py), per block.

With t = linspace(1, eps, steps + 1), block step i (0-based) fills int(n · (1 - t[i+1]/t[i]))
of the n masked positions — every remaining one at i = steps - 1 — chosen by a score, the
highest first. A step may fill nothing.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from decoding.schedules.view import StepView, top

ALGORITHMS = ("maskgit_plus", "topk_margin", "entropy", "origin")  # `alg`, passed as an index into this
MASKGIT_PLUS, TOPK_MARGIN, ENTROPY, ORIGIN = range(len(ALGORITHMS))


def transfer_fraction(step: jax.Array, steps: jax.Array, eps: jax.Array) -> jax.Array:
    """float32 []: 1 - t[step+1]/t[step] for t = linspace(1, eps, steps + 1); 1 from the last step on.

    With d = (1 - eps)/steps, t[i] = 1 - i·d, so 1 - t[i+1]/t[i] = d / (1 - i·d): one division,
    no cancellation, and `steps` may be traced."""
    d = (1.0 - eps) / steps
    return jnp.where(step >= steps - 1, 1.0, d / (1.0 - step * d))


def uniforms(key: jax.Array, size: int) -> jax.Array:
    """float32 [size] in (0, 1): the step's random draws (for `origin` and for `alg_temp > 0`)."""
    return jax.random.uniform(key, (size,), jnp.float32, minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)


def dream(view: StepView, params: Mapping[str, jax.Array]) -> jax.Array:
    """Dream: `alg` picks the score — maskgit_plus: confidence p; topk_margin: top-1 minus top-2
    probability; entropy: Σ p log p (minus the entropy) — and the count of fills follows the
    linspace schedule of `steps` per block with `eps`. With `alg_temp > 0` the positions are drawn
    without replacement with probabilities ∝ softmax(score / alg_temp) (as Gumbel-top-k: the
    highest score / alg_temp + g, g = -log(-log u) for the step's uniforms u). `origin`: each
    masked position independently with probability 1 - t[i+1]/t[i] (u < that probability).

    Random draws are `uniforms(view.key, block)`, so they are fixed by the step's key."""
    masked = ~view.decided
    alg, steps, eps, temperature = params["alg"], params["steps"], params["eps"], params["alg_temp"]
    fraction = transfer_fraction(view.step, steps, eps)
    count = jnp.floor(jnp.sum(masked) * fraction).astype(jnp.int32)
    score = jnp.stack([view.confidence, view.margin, -view.entropy, jnp.zeros_like(view.confidence)])[alg]
    u = uniforms(view.key, masked.shape[0])
    sampled = temperature > 0
    gumbel = -jnp.log(-jnp.log(u))
    ranked = jnp.where(sampled, score / jnp.where(sampled, temperature, 1.0) + gumbel, score)
    by_score = top(ranked, masked, count)
    by_chance = masked & (u < fraction)
    return view.decided | jnp.where(alg == ORIGIN, by_chance, by_score)
