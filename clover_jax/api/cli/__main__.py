"""`python -m clover_jax.api.cli ...`: the `clover-jax` command line."""

import sys

from clover_jax.api.cli.main import main

sys.exit(main())
