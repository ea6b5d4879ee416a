"""`main`: parse, run the command, and turn every failure into one line and an exit status."""

from __future__ import annotations

import logging
import os
import sys
from typing import Sequence

from clover_jax.api.cli.common import INTERRUPTED_STATUS, CliError, UsageError, one_line
from clover_jax.api.cli.flags import explain
from clover_jax.api.cli.interrupt import ExitOnInterrupt
from clover_jax.api.cli.parser import build_parser


def main(argv: Sequence[str] | None = None) -> int:
    prog = "clover-jax"
    with ExitOnInterrupt(prog):
        try:
            parser = build_parser()
            args = parser.parse_args(argv)
            logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
            return args.run(args) or 0
        except UsageError as error:
            sub = f"{prog} {args.command}"
            print(f"{sub}: error: {one_line(error)} (see {sub} --help)", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # only where ExitOnInterrupt could not take over SIGINT
            print(f"{prog}: interrupted", file=sys.stderr)
            return INTERRUPTED_STATUS
        except BrokenPipeError:  # `clover-jax ... | head`: the reader left; say nothing more
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
        except (CliError, ValueError, OSError) as error:  # ConfigError, TokenizerError, generate's checks
            print(f"{prog}: error: {explain(error)}", file=sys.stderr)
            return 1
        except Exception as error:  # a bug: still one line, the traceback with --verbose
            if logging.getLogger().isEnabledFor(logging.INFO):
                raise
            print(f"{prog}: internal error: {type(error).__name__}: {one_line(error)} (run with -v for the "
                  "traceback)", file=sys.stderr)
            return 1
