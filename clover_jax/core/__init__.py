"""The lowest layer of `clover_jax`: what the model is made of, described without tracing it.

`params` holds the parameter table (one row per leaf: shape, logical axes, checkpoint names,
defaults, quantisability) from which the layout, sharding, checkpoint names, quantisation and
parameter counts are derived.
"""
