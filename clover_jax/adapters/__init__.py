"""LoRA adapters: which weights get them (`targets`), their parameters, attaching them to a pass
and merging them into the base (`lora`), a converted base's grown vocabulary (`vocabulary`), our
adapter directory (`adapter_io`) and PEFT's layout of it (`peft_export`). Below the trainer, which
makes adapters, and the model loader, which merges them: imports `clover_jax.core`, `clover_jax.nn`
(the pass's names for attached factors) and `weights` (the config writer)."""
