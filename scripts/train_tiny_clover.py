"""Train the bundled tiny Clover (digit sorting) from its seeds and write it as a HF checkpoint.

    python scripts/train_tiny_clover.py                       # -> clover_jax/bundled/tiny-clover/
    python scripts/train_tiny_clover.py --out /tmp/tiny --steps 200 --checkpoint-dir /tmp/tiny-ckpt

The recipe (model size, data, block sizes, decoding controls) is `clover_jax.training.recipe`;
the flags here only override the run's length, seeds and destination. Orbax checkpoints of the
train state go to --checkpoint-dir (a rerun resumes from the latest). Prints the training
summary (parameters, seconds, final loss) as JSON.
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

from clover_jax.training.recipe import BUNDLED_DIR, Recipe, train_tiny_clover  # noqa: E402


def main(argv=None) -> int:
    defaults = Recipe()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=BUNDLED_DIR, help="checkpoint directory to write (default: the bundled one)")
    parser.add_argument("--steps", type=int, default=defaults.train.steps)
    parser.add_argument("--batch-size", type=int, default=defaults.train.batch_size)
    parser.add_argument("--learning-rate", type=float, default=defaults.train.learning_rate)
    parser.add_argument("--next-token-weight", type=float, default=defaults.train.next_token_weight,
                        help="weight of the next-token loss on the causal pass (0: block diffusion only)")
    parser.add_argument("--seed", type=int, default=defaults.train.seed, help="data and noise seed")
    parser.add_argument("--model-seed", type=int, default=defaults.model_seed, help="parameter initialisation seed")
    parser.add_argument("--checkpoint-dir", default=None, help="Orbax checkpoints of the train state (resumable)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)  # Orbax logs every file it writes at INFO

    train = dataclasses.replace(defaults.train, steps=args.steps, batch_size=args.batch_size,
                                learning_rate=args.learning_rate, next_token_weight=args.next_token_weight,
                                seed=args.seed)
    recipe = dataclasses.replace(defaults, train=train, model_seed=args.model_seed)
    summary = train_tiny_clover(args.out, recipe, args.checkpoint_dir, progress=not args.no_progress)
    summary.pop("history")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
