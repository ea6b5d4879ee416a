"""The model: Flax modules and the array math they use. Norms and projections (`layers`), RoPE,
gated attention (`attention`, `online_attention`, `fused_attention`), Gated DeltaNet with its
block mode (`gdn`, `gated_delta`), routed experts (`moe`, `expert_dispatch`, `coreset`), the layer
stack and its pass interface implementation (`model`), chunked prefill (`chunked`) and rollback of
a causal pass (`rollback`). Imports `clover_jax.core`, `clover_jax.parallel.sharding` and
`pallas_kernels`."""
