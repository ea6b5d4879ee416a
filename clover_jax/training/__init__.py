"""Training a Clover: block-diffusion fine-tuning and conversion of Qwen3.5/3.6-MoE checkpoints (docs/training.md).

    from clover_jax.training import FinetuneConfig, finetune, block_diffusion_logits

  * `trainer.py`      — `finetune`, the entry point: checks, data, the loop, checkpoints, the written model;
  * `config.py`       — `FinetuneConfig`, every setting, checked when it is made;
  * `block_pass.py`   — the one training pass (clean stream + noisy blocks) and its inspection form;
  * `loss.py`, `masking.py`, `cross_entropy.py` — the objective, its noise, the chunked cross-entropy;
  * `data.py`, `packing.py`, `dataset.py` — JSONL examples, packed rows, the batch order;
  * `step.py`, `checkpointing.py`, `held_out.py` — the optimizer step, Orbax resumption, evaluation;
  * `conversion.py`   — what a Qwen base becomes (mask token, generation config);
  * `lora.py`         — LoRA: the adapted weights, the trainable part, attaching and merging;
    `adapter_io.py` (our adapter layout, loading onto a base), `peft_export.py` (PEFT's layout);
  * `task.py`, `chat_format.py`, `vocabulary.py`, `recipe.py`, `evaluation.py` — the bundled tiny
    models' digit task, tokenizer and recipes, and exact-match scoring with `decoding.generate`.
"""

import importlib

# Imported on first use, so that `clover-jax train --help` (which reads FinetuneConfig's fields) does
# not import JAX.
_EXPORTS = {"FinetuneConfig": "config", "FinetuneResult": "trainer", "finetune": "trainer",
            "block_diffusion_logits": "block_pass"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'clover_jax.training' has no attribute {name!r}")
    return getattr(importlib.import_module(f"clover_jax.training.{_EXPORTS[name]}"), name)
