"""The chunk length of the chunked gated delta rule, stated once: the Pallas kernel's tile
(`gdn_chunk`), the plain-JAX chunked rule's default and largest chunk (`clover_jax.nn.gated_delta`,
`clover_jax.core.kernels`) and the memory estimate's (`clover_jax.parallel.memory`). Plain Python,
so that reading it never imports Pallas."""

CHUNK_SIZE = 64
