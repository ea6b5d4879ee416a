"""Train a bundled tiny model (digit sorting) from its seeds and write it as a HF checkpoint.

    python scripts/train_tiny_clover.py            # the tiny Clover -> clover_jax/bundled/tiny-clover/
    python scripts/train_tiny_clover.py --base     # the autoregressive base -> clover_jax/bundled/tiny-qwen-base/
    python scripts/train_tiny_clover.py --editing  # token editing -> clover_jax/bundled/tiny-clover-editing/
    python scripts/train_tiny_clover.py --out /tmp/tiny --steps 200 --checkpoint-dir /tmp/tiny-ckpt

The recipes (model size, data, block sizes, decoding controls) are `clover_jax.training.tiny.recipe`;
the flags here only override the run's length, seeds and destination. Orbax checkpoints of the
train state go to --checkpoint-dir (a rerun resumes from the latest). Prints the training
summary (seconds, final metrics) as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from clover_jax.training.tiny.recipe import (  # noqa: E402
    BASE_DIR,
    BASE_RECIPE,
    BUNDLED_DIR,
    EDITING,
    EDITING_CONTROL,
    EDITING_DIR,
    Recipe,
    train_tiny_base,
    train_tiny_clover,
    train_tiny_editing,
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", action="store_true", help="the autoregressive base (next-token loss only)")
    parser.add_argument("--editing", action="store_true",
                        help="the token-editing variant (the shipped tiny Clover fine-tuned further)")
    parser.add_argument("--editing-control", action="store_true",
                        help="the editing variant's run without token editing (the comparison; needs --out)")
    parser.add_argument("--out", default=None, help="checkpoint directory to write (default: the bundled one)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--learning-rate", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None, help="data and noise seed")
    parser.add_argument("--model-seed", type=int, default=None, help="parameter initialisation seed")
    parser.add_argument("--checkpoint-dir", default=None, help="Orbax checkpoints of the train state (resumable)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax logs every file it writes at INFO

    recipe = BASE_RECIPE if args.base else Recipe()
    changes = {name: value for name, value in (("steps", args.steps), ("batch_size", args.batch_size),
                                               ("learning_rate", args.learning_rate), ("seed", args.seed),
                                               ("checkpoint_dir", args.checkpoint_dir)) if value is not None}
    if args.editing or args.editing_control:
        if args.editing_control and not args.out:
            parser.error("--editing-control writes no bundled model: name its --out directory")
        config = dataclasses.replace(EDITING_CONTROL if args.editing_control else EDITING, **changes)
        summary = train_tiny_editing(args.out or EDITING_DIR, config=config, progress=not args.no_progress)
        summary.pop("history")
        print(json.dumps(summary, indent=2))
        return 0
    recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, **changes))
    if args.model_seed is not None:
        recipe = dataclasses.replace(recipe, model_seed=args.model_seed)
    if args.base:
        summary = train_tiny_base(args.out or BASE_DIR, recipe, progress=not args.no_progress)
    else:
        summary = train_tiny_clover(args.out or BUNDLED_DIR, recipe, recipe.train.checkpoint_dir,
                                    progress=not args.no_progress)
    summary.pop("history")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
