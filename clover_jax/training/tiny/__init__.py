"""The bundled tiny models' own training: the digit-sorting task they learn (`sort_digits`), its
chat template (`chat_format`) and tokenizer (`vocabulary`), the recipes that make
`clover_jax/bundled/tiny-clover` and `tiny-qwen-base` (`recipe`), and exact-match scoring of a
checkpoint on the task with `decoding.generate` (`scoring`). Uses the trainer; nothing in the
trainer uses it."""
