"""The ground floor of clover_jax: what every other layer reads and nothing here imports from above.

`config` (config.json, `CloverConfig`), `params` (the parameter table: one row per leaf),
`param_layout` (shapes from the table), `state` (the prefix state's layout), `passes` (the pass
interface the decoders are handed), `kernels` (which implementation runs each hot spot),
`quantization` (weight formats), `hub` (checkpoint ids), `json_fields` (typed JSON reading), and
the on-disk caches of compiled programs (`compilation_cache`, `executable_cache`).
"""
