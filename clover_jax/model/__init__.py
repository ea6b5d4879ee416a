"""`CloverModel` (`clover_model`): a loaded checkpoint and the named passes it runs — what `generate`
takes, what the trainer trains and what the server serves. Joins loading (`weights`), the Flax
model (`clover_jax.nn`) and adapter merging (`clover_jax.adapters`); imports nothing above them."""
