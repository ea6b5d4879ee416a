"""Training a Clover with the joint objective (block diffusion + next token), and the bundled tiny model's recipe.

  * `objective.py`  — masking, the BD3-LM-weighted loss on the real block-mode pass, the joint loss;
  * `next_token.py` — the next-token loss on the causal pass (what autoregressive decoding uses);
  * `batches.py`    — training blocks laid out as `decoding.generate` lays out a request;
  * `trainer.py`    — optax AdamW, the jitted train step, Orbax checkpoints, progress bar;
  * `task.py`       — the digit-sorting task, held-out split and exact scoring;
  * `chat_format.py`, `vocabulary.py` — the Qwen3-style chat template and the task tokenizer;
  * `recipe.py`     — the bundled tiny Clover: config, data, decoding controls, export;
  * `evaluation.py` — exact match and tokens per forward with `decoding.generate`.
"""
