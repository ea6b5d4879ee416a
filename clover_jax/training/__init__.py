"""Training a Clover: block-diffusion fine-tuning and conversion of Qwen3.5/3.6-MoE checkpoints (docs/training.md).

    from clover_jax.training import FinetuneConfig, finetune, block_diffusion_logits

  * `finetune.py`     — the entry point: checks, data, the loop, checkpoints, the written model;
  * `config.py`       — `FinetuneConfig`, every setting, checked when it is made;
  * `block_pass.py`   — the one training pass (clean stream + noisy blocks) and its inspection form;
  * `loss.py`, `masking.py`, `cross_entropy.py` — the objective, its noise, the chunked cross-entropy;
  * `data.py`, `packing.py`, `dataset.py` — JSONL examples, packed rows, the batch order;
  * `step.py`, `checkpointing.py`, `held_out.py` — the optimizer step, Orbax resumption, evaluation;
  * `conversion.py`   — what a Qwen base becomes (mask token, generation config);
  * `task.py`, `chat_format.py`, `vocabulary.py`, `recipe.py`, `evaluation.py` — the bundled tiny
    models' digit task, tokenizer and recipes, and exact-match scoring with `decoding.generate`.
"""

from clover_jax.training.block_pass import block_diffusion_logits
from clover_jax.training.config import FinetuneConfig
from clover_jax.training.finetune import FinetuneResult, finetune

__all__ = ["FinetuneConfig", "FinetuneResult", "block_diffusion_logits", "finetune"]
