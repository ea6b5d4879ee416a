"""`clover-jax`: generate text with a checkpoint, or describe one, from the command line.

    clover-jax generate "sort 3 1 4 1 5"                     # the bundled tiny model (it sorts digits)
    clover-jax generate --show-steps --schedule fixed_k "sort 9 2 7 4"
    clover-jax generate --mode self_speculative --show-steps "sort 9 2 7 4"   # drafts and accepted runs
    clover-jax generate --model org/name --revision main "What is diffusion?"   # a Hub id
    clover-jax generate --model DIR --dtype bfloat16 --json "What is diffusion?"
    clover-jax info DIR
    clover-jax serve --model DIR --port 8000                 # an OpenAI-compatible server (docs/serving.md)

`--model` is a checkpoint directory or a Hugging Face Hub id (`clover_jax.core.hub`: only the files
clover-jax reads are downloaded, into the Hub cache; `HF_HUB_OFFLINE=1` works from the cache).
Every field of `decoding.GenerationConfig` is a flag of `generate` (`--block-size`,
`--threshold`, `--presence-penalty`, ...; booleans as `--do-sample` / `--no-do-sample`), built
from the dataclass so that none is forgotten; a flag left out keeps the checkpoint's
`generation_config.json` value. Errors are one line on stderr with a non-zero exit
status (2 for bad flags or input, 1 for everything else), never a traceback. Heavy imports (jax,
the model) happen after the arguments, the model's config and tokenizer and the prompt have been
checked. Ctrl-C at any moment — importing, downloading, loading, compiling, decoding, streaming —
ends the command at once with one line and exit status 130 (`ExitOnInterrupt`).
"""

from __future__ import annotations

from clover_jax.api.cli.common import BUNDLED_MODEL, CliError, UsageError
from clover_jax.api.cli.flags import flag_name, generation_overrides
from clover_jax.api.cli.info import format_info
from clover_jax.api.cli.main import main
from clover_jax.api.cli.parser import build_parser
from clover_jax.api.cli.render import (
           MASK_GLYPH,
           StreamPrinter as _StreamPrinter,  # noqa: F401 (its name before the split)
           render_rounds,
           render_steps,
)

__all__ = ["BUNDLED_MODEL", "CliError", "MASK_GLYPH", "UsageError", "build_parser", "flag_name", "format_info",
           "generation_overrides", "main", "render_rounds", "render_steps"]
