"""JAX's persistent compilation cache, on by default for clover-jax.

Compiling a decoder takes seconds to minutes; with the cache a new process (a second CLI call,
a restarted notebook) loads the compiled programs from disk instead. `enable()` is called when a
model is created and before `generate` compiles anything, and does nothing after its first call.

* `CLOVER_JAX_CACHE_DIR` sets the directory (default: `$XDG_CACHE_HOME/clover-jax`, i.e.
  `~/.cache/clover-jax`; XLA's cache in `xla/`, `clover_jax.core.executable_cache`'s programs in
  `executables/`, the trainer's tokenised data in `training-data/`); set it to an empty string to
  turn them off.
* A cache the user configured for JAX (`jax_compilation_cache_dir` / `JAX_COMPILATION_CACHE_DIR`)
  is left as it is, with its own thresholds.
* Otherwise every program is cached, however quickly it compiled: JAX's default threshold (one
  second of compile time) would leave out the many small programs a CLI call starts with.

None of the decoding programs holds a host callback (streaming is driven from the host between
compiled calls), so all of them can be served from the cache.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

ENV = "CLOVER_JAX_CACHE_DIR"
_state: dict[str, str | None] = {}


def default_directory() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "clover-jax")


def _subdirectory(name: str, unwritable: str) -> str | None:
    """`name` under the cache directory, created; None when caching is off or it cannot be created
    (logged: `unwritable`, with the directory and the error)."""
    root = os.environ.get(ENV, default_directory()) or None
    if root is None:
        return None
    directory = os.path.join(root, name)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as error:
        logger.warning(unwritable, directory, error)
        return None
    return directory


def data_directory() -> str | None:
    """Where `clover_jax.training` keeps tokenised training data (None: off)."""
    if "training-data" not in _state:
        _state["training-data"] = _subdirectory("training-data", "tokenised training data is not kept: cannot "
                                                                 "create %s (%s)")
    return _state["training-data"]


def executable_directory() -> str | None:
    """Where `clover_jax.core.executable_cache` keeps compiled programs (None: off)."""
    if "executables" not in _state:
        _state["executables"] = _subdirectory("executables", "compiled programs are not kept: cannot create %s (%s)")
    return _state["executables"]


def enable() -> str | None:
    """Turn the persistent cache on (once per process); returns its directory, or None when off."""
    if "xla" in _state:
        return _state["xla"]
    import jax

    configured = jax.config.jax_compilation_cache_dir
    if configured:
        directory = configured
        logger.debug("JAX's compilation cache is already configured at %s; left as it is", configured)
    else:
        directory = _subdirectory("xla", f"compilation cache off: cannot create %s (%s); set {ENV} to a writable "
                                         "directory or to an empty string")
        if directory is not None:
            jax.config.update("jax_compilation_cache_dir", directory)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
            # A program compiled before this point made JAX settle on "no cache"; look again.
            from jax.experimental.compilation_cache import compilation_cache

            compilation_cache.reset_cache()
            logger.debug("persistent compilation cache at %s", directory)
    _state["xla"] = directory
    return directory
