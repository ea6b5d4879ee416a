"""Devices: logical axes and mesh placement (`sharding`), the memory a request needs (`memory`),
and which weight format and mesh fit given devices (`planner`, `clover_jax.plan`). Imports only
`clover_jax.core`."""
