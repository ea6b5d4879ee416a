"""Training a Clover: block-diffusion fine-tuning and conversion of Qwen3.5/3.6-MoE checkpoints (docs/training.md).

    from clover_jax.training import FinetuneConfig, finetune, block_diffusion_logits

Layered as the data flows, each module importing only those above it in this list:

  * `config.py`        — `FinetuneConfig`: every setting, checked when it is made, with its flag's help;
  * `examples.py`, `example_cache.py` — JSONL lines read into tokenised examples (kept on disk);
  * `packing.py`       — examples packed into rows of clean tokens;
  * `batches.py`       — `TrainRows`, the normalisers and the next-token rule, the batch order;
  * `masking.py`, `cross_entropy.py`, `train_sharding.py` — the noise, the chunked cross-entropy,
    where every array of a step lives on the mesh;
  * `block_pass.py`    — the one training pass (clean stream + noisy blocks) and its inspection form;
  * `loss.py`          — the objective on that pass;
  * `state.py`, `step.py` — the train state and optimizer; `StepProgram.of(config)` and the one jitted step;
  * `faults.py`, `held_out.py`, `checkpointing.py` — the test seam for fault injection, evaluation on
    held-out rows, Orbax resumption;
  * `conversion.py`, `outputs.py` — what a Qwen base becomes; what a run writes;
  * `loop.py`, `trainer.py` — the loop; `finetune`, which sets a run up and runs it;
  * `abstract_step.py` — the step with abstract arguments, for compiling it for a target;
  * `tiny/`            — the bundled tiny models' task, tokenizer, recipes and scoring.

LoRA itself (the spec, attaching and merging, adapter files) is `clover_jax.adapters`.
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
