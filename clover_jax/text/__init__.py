"""Text: a checkpoint's tokenizer (`tokenizer`), the one sandbox its chat templates render in
(`chat_templates`), and their errors (`errors`). Read by the entry points, the server and the
trainer alike; imports only `clover_jax.core`."""
