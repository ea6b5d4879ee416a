"""`python -m clover_jax ...` is the `clover-jax` command line (clover_jax/cli.py)."""

import sys

from clover_jax.cli import main

sys.exit(main())
