"""`python -m clover_jax ...` is the `clover-jax` command line (clover_jax/api/cli/)."""

import sys

from clover_jax.api.cli import main

sys.exit(main())
