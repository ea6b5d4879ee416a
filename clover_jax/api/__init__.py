"""The entry points: the `clover-jax` command (`cli`), the OpenAI-compatible server (`serving`),
`clover_jax.plan` (`plan`, `train_plan`) and compiling for a target (`compile`), the lm-eval model
(`lm_eval_model`), schedule sweeps on named tasks (`research_tasks`) and where a command puts the
weights (`placement`). The only modules that join loading, the model, decoding and training."""
