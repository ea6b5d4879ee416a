"""Where the tiny models that ship with the package live: the tiny Clover (4 layers, 8 experts, a
128-token vocabulary, trained to sort digits) and the autoregressive base it can be made from."""

from __future__ import annotations

from pathlib import Path

BUNDLED = Path(__file__).resolve().parent.parent / "bundled"


def bundled_model_path() -> Path:
    """The tiny Clover that ships with the package (4 layers, 8 experts, a 128-token vocabulary,
    trained to sort digits): a complete checkpoint directory — config, weights, tokenizer and chat
    template — that `CloverModel`, `GenerationConfig` and `Tokenizer` load like any other."""
    return BUNDLED / "tiny-clover"


def bundled_editing_path() -> Path:
    """The tiny Clover fine-tuned further with LLaDA2.1's token-editing objective (same architecture,
    tokenizer and task): the model `joint_threshold`'s edits of decided positions are trained for."""
    return BUNDLED / "tiny-clover-editing"


def bundled_base_path() -> Path:
    """The tiny Clover's autoregressive base (`qwen3_5_moe_text`: no mask token, no block-mode
    tensors), which `clover-jax train` converts into a Clover (`make demo-train`)."""
    return BUNDLED / "tiny-qwen-base"
