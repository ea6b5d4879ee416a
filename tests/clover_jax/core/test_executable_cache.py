"""The executable cache across processes: a program stored after its code version changed, while
JAX's own persistent cache still held it, must run when the next process loads it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# One process: a persistent_jit program under code version `argv[1]`; prints its result or the error.
PROGRAM = textwrap.dedent("""
    import sys
    import jax.numpy as jnp
    from clover_jax.core import compilation_cache, executable_cache
    from clover_jax.nn.layers import rms_normalize

    version = executable_cache.code_version() + sys.argv[1]
    executable_cache.code_version = lambda: version
    compilation_cache.enable()
    program = executable_cache.PersistentJit(rms_normalize, ("eps",))
    try:
        print(float(program(jnp.arange(1.0, 9.0).reshape(2, 4), eps=1e-6).sum()))
    except Exception as error:
        print("failed:", error)
""")


def test_a_program_stored_over_a_warm_jax_cache_loads_in_the_next_process(tmp_path):
    env = dict(os.environ, CLOVER_JAX_CACHE_DIR=str(tmp_path / "cache"), JAX_PLATFORMS="cpu",
               PYTHONPATH=REPO_ROOT)
    run = lambda version: subprocess.run([sys.executable, "-c", PROGRAM, version], env=env, text=True,
                                         capture_output=True, timeout=120, cwd=REPO_ROOT).stdout.strip()
    # v1 compiles and fills both caches; v2 misses the executable cache while JAX's cache holds the
    # program, stores it, and the next v2 process loads what was stored (it failed with "Function
    # add_rsqrt_fusion not found" when the stored program came from JAX's cache).
    outputs = [run("v1"), run("v2"), run("v2")]
    assert outputs[0] == outputs[1] == outputs[2], outputs
    assert float(outputs[0]) > 0
    assert len(os.listdir(tmp_path / "cache" / "executables")) == 2


def test_keyword_only_arguments_reach_the_stored_program(tmp_path, monkeypatch):
    # the grammar's step programs take their masks keyword-only; the stored program must get them by name
    import jax.numpy as jnp

    from clover_jax.core import compilation_cache, executable_cache

    monkeypatch.setattr(compilation_cache, "executable_directory", lambda: str(tmp_path))

    def masked_sum(x, scale, *, mask, twice: bool):
        return jnp.sum(jnp.where(mask, x, 0.0)) * scale * (2 if twice else 1)

    program = executable_cache.PersistentJit(masked_sum, ("twice",))
    x, mask = jnp.arange(4.0), jnp.array([True, False, True, True])
    for _ in range(2):  # compiled and stored, then taken from memory
        assert float(program(x, 3.0, mask=mask, twice=True)) == float(masked_sum(x, 3.0, mask=mask, twice=True))
    assert len(os.listdir(tmp_path)) == 1
    fresh = executable_cache.PersistentJit(masked_sum, ("twice",))  # loaded from the file
    assert float(fresh(x, 3.0, mask=~mask, twice=True)) == float(masked_sum(x, 3.0, mask=~mask, twice=True))
    assert fresh.hits == 1
