"""Compiled programs kept on disk, so that a new process skips tracing, lowering and compiling.

JAX's persistent compilation cache (`clover_jax.core.compilation_cache`) saves the XLA compile, but a
new process still traces the Python code and lowers it before it can look the program up: for
the decoding loops that is most of a CLI call's startup (measured on the bundled model: 3.0 s of
a warm start, against 0.6 s to load the executables). `persistent_jit` wraps `jax.jit`: the
first call of a program in a process looks for its serialized executable
(`jax.experimental.serialize_executable`) under `<cache dir>/executables`, and only on a miss
traces, compiles and stores it.

What identifies a program (the file name is a hash of all of it): the function; its static
arguments; the tree structure, shapes, dtypes and shardings of the others; the source of the
packages that build the program (every top-level package of clover-jax's distribution,
`source_packages`), so editing the code never reuses a stale program; the JAX and jaxlib
versions; the platform and device kind; `XLA_FLAGS` and the JAX settings that change numerics.
Calls whose static arguments cannot be named stably (a mesh, a schedule defined inside a
function) run through plain `jax.jit`, as do programs JAX cannot serialize. A file that does not
load is replaced, with a warning.

The cache directory is the user's own (`CLOVER_JAX_CACHE_DIR`): like any pickled executable,
its files must not come from an untrusted source.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import inspect
import logging
import os
import pickle
import tempfile
import types
import weakref
from typing import Any, Callable

import jax
import numpy as np

from clover_jax.core import compilation_cache

logger = logging.getLogger(__name__)

LOADED_PER_FUNCTION = 64  # programs kept in memory per decorated function, least recently used dropped
_INSTANCES: "weakref.WeakSet[PersistentJit]" = weakref.WeakSet()


class NotNameable(Exception):
    """A static argument has no stable description across processes."""


@functools.lru_cache(maxsize=1)
def source_packages() -> tuple[str, ...]:
    """The top-level packages of the distribution that holds this one (clover-jax's, as its
    pyproject.toml lists them): the code a compiled program may come from. Read from the installed
    metadata, so this module names none of the packages above it; without metadata (a bare
    source tree on the path), every package beside this one."""
    import importlib.metadata

    top = __name__.split(".")[0]
    # top_level.txt first: `packages_distributions()` reads every installed distribution's file list
    # (torch's alone is large): 0.1-0.4 s a call, measured, in every process that loads a cached program.
    listed = next((names for names in ((d.read_text("top_level.txt") or "").split()
                                       for d in importlib.metadata.distributions()) if top in names), None)
    owners = None if listed else importlib.metadata.packages_distributions().get(top)
    if listed:
        packages = set(listed)
    elif owners:
        packages = {name for name, distributions in importlib.metadata.packages_distributions().items()
                    if owners[0] in distributions}
    else:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        packages = {name for name in os.listdir(root) if os.path.isfile(os.path.join(root, name, "__init__.py"))}
    return tuple(sorted(packages))


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """A hash of everything a compiled program depends on besides its arguments."""
    digest = hashlib.sha256()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above clover_jax/core/
    for package in source_packages():
        for folder, _, files in sorted(os.walk(os.path.join(root, package))):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    digest.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as handle:
                        digest.update(handle.read())
    device = jax.devices()[0]
    import jaxlib

    digest.update(repr((jax.__version__, jaxlib.__version__, device.platform, device.device_kind,
                        os.environ.get("XLA_FLAGS", ""), jax.config.jax_enable_x64,
                        jax.config.jax_default_matmul_precision)).encode())
    return digest.hexdigest()


def describe(value: Any) -> str:
    """A description of a static argument that is the same in every process, or NotNameable."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, np.dtype):
        return f"dtype:{value.name}"
    if isinstance(value, type):
        try:
            return f"dtype:{np.dtype(value).name}"
        except TypeError:
            raise NotNameable(value.__qualname__) from None
    if isinstance(value, (types.FunctionType, functools.partial)):
        return _function_name(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # NamedTuple
        return type(value).__qualname__ + describe(tuple(value))
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(describe(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ",".join(f"{describe(k)}:{describe(v)}" for k, v in sorted(value.items(), key=repr)) + "}"
    if dataclasses.is_dataclass(value):
        fields = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)
                  if f.name not in ("parent", "name")]  # Flax modules' bookkeeping fields
        return type(value).__module__ + "." + type(value).__qualname__ + describe(dict(fields))
    raise NotNameable(type(value).__name__)


def _function_name(function) -> str:
    if isinstance(function, functools.partial):
        return ("partial(" + _function_name(function.func) + describe(function.args)
                + describe(function.keywords) + ")")
    module, name = getattr(function, "__module__", ""), getattr(function, "__qualname__", "")
    if module.split(".")[0] not in source_packages() or "<" in name:
        raise NotNameable(f"{module}.{name}")  # a user's function: its code is not in the hash
    return f"{module}.{name}"


def _abstract(leaf) -> str:
    shape, dtype = np.shape(leaf), getattr(leaf, "dtype", None)
    dtype = np.asarray(leaf).dtype if dtype is None else dtype
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None and len(sharding.device_set) > 1:
        raise NotNameable("a sharded argument")
    weak = getattr(leaf, "weak_type", False)
    return f"{shape}{dtype}{'w' if weak else ''}"


class PersistentJit:
    """`jax.jit(fn, static_argnames=..., donate_argnames=...)` whose programs persist on disk."""

    def __init__(self, fn: Callable, static_argnames: tuple[str, ...] = (), donate_argnames: tuple[str, ...] = ()):
        self.fn = fn
        self.jitted = jax.jit(fn, static_argnames=static_argnames, donate_argnames=donate_argnames)
        self.parameters = tuple(inspect.signature(fn).parameters)
        self.keyword_only = frozenset(name for name, parameter in inspect.signature(fn).parameters.items()
                                      if parameter.kind is inspect.Parameter.KEYWORD_ONLY)
        self.static = frozenset(static_argnames)
        # Programs in use, most recent last. Bounded: every live XLA:CPU executable holds memory
        # mappings, and a process has a limited number of them (vm.max_map_count).
        self.loaded: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self.hits = self.stores = 0
        # Signatures of argument objects seen before, by identity (the model, its parameters):
        # describing them again on every call would cost more than the call's own host work.
        self._signatures: collections.OrderedDict[int, tuple[Any, str]] = collections.OrderedDict()
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        directory = compilation_cache.executable_directory()
        if directory is None:
            return self.jitted(*args, **kwargs)
        named = dict(zip(self.parameters, args, strict=False), **kwargs)
        dynamic, dynamic_keywords = self._split(named, lambda name: name not in self.static)
        try:
            key = tuple(self._signature(named[name], name in self.static) for name in self.parameters
                        if name in named)
        except NotNameable:
            return self.jitted(*args, **kwargs)
        compiled = self.loaded.get(key)
        if compiled is None:
            compiled = self._load_or_compile(directory, key, named)
            self.loaded[key] = compiled
            if len(self.loaded) > LOADED_PER_FUNCTION:
                self.loaded.popitem(last=False)
        else:
            self.loaded.move_to_end(key)
        if compiled is False:  # JAX cannot serialize this program
            return self.jitted(*args, **kwargs)
        return compiled(*dynamic, **dynamic_keywords)

    def _split(self, named: dict, keep: Callable[[str], bool]) -> tuple[tuple, dict]:
        """The given arguments `keep` selects, as (positional ones, keyword-only ones by name)."""
        given = [name for name in self.parameters if name in named and keep(name)]
        return (tuple(named[name] for name in given if name not in self.keyword_only),
                {name: named[name] for name in given if name in self.keyword_only})

    def _signature(self, value: Any, static: bool) -> str:
        """describe(value) for a static argument, else its tree structure, shapes, dtypes and shardings;
        remembered for objects that come back (a model's parameters, its module)."""
        remembered = self._signatures.get(id(value))
        if remembered is not None and remembered[0] is value:
            self._signatures.move_to_end(id(value))
            return remembered[1]
        if static:
            signature = describe(value)
        else:
            leaves, tree = jax.tree_util.tree_flatten(value)
            signature = str(tree) + ";" + ",".join(_abstract(leaf) for leaf in leaves)
        if isinstance(value, (dict, tuple)) or dataclasses.is_dataclass(value):
            self._signatures[id(value)] = (value, signature)
            if len(self._signatures) > 64:
                self._signatures.popitem(last=False)
        return signature

    def _load_or_compile(self, directory: str, key: tuple, named: dict):
        digest = hashlib.sha256(repr((self.fn.__module__, self.fn.__qualname__, code_version(), key)).encode())
        path = os.path.join(directory, f"{self.fn.__name__}-{digest.hexdigest()[:40]}.pkl")
        from jax.experimental import serialize_executable

        if os.path.isfile(path):
            try:
                with open(path, "rb") as handle:
                    payload, in_tree, out_tree = pickle.load(handle)
                self.hits += 1
                return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
            except Exception as error:  # a damaged or foreign file: compile again and replace it
                logger.warning("compiled program %s did not load (%s); compiling it again", path, error)
        with _without_jax_cache():
            positional, keywords = self._split(named, lambda name: True)
            compiled = self.jitted.lower(*positional, **keywords).compile()
        try:
            serialized = serialize_executable.serialize(compiled)
        except (ValueError, NotImplementedError) as error:
            logger.debug("%s: not serializable (%s); kept in memory only", self.fn.__name__, error)
            return False
        _write_atomically(path, pickle.dumps(serialized))
        self.stores += 1
        return compiled

    def clear(self) -> None:
        """Drop this function's programs from memory (they stay on disk), as `jax.clear_caches` does for jit."""
        self.loaded.clear()
        self._signatures.clear()

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)

    def _cache_size(self) -> int:
        """Programs this process holds (loaded or compiled), as `jax.jit`'s `_cache_size`."""
        return len([c for c in self.loaded.values() if c is not False]) + self.jitted._cache_size()


def persistent_jit(static_argnames: tuple[str, ...] = (), donate_argnames: tuple[str, ...] = ()):
    """Decorator form of `PersistentJit`."""
    def wrap(fn):
        function = PersistentJit(fn, tuple(static_argnames), tuple(donate_argnames))
        _INSTANCES.add(function)
        return function
    return wrap


def clear_caches() -> None:
    """Free every compiled program this process holds, ours and `jax.jit`'s (they stay on disk).

    Each live XLA:CPU executable keeps memory mappings (about 15 for a small program, more for a
    large one); a process that compiles thousands of programs reaches the kernel's limit
    (`vm.max_map_count`, 65530 by default) and XLA aborts when its next compile cannot map memory
    (seen in the test suite's single process, see `tests/conftest.py`)."""
    for function in list(_INSTANCES):
        function.clear()
    jax.clear_caches()


@contextlib.contextmanager
def _without_jax_cache():
    """Compile afresh rather than from JAX's persistent compilation cache, for a program this
    cache will serialize: on XLA:CPU an executable JAX's cache deserialized serializes again
    without its kernels, and the stored program then fails in the next process ("Function
    add_rsqrt_fusion not found"). That happens whenever `code_version` changes (a source edit, an
    upgrade) while JAX's cache still holds the program (`tests/clover_jax/core/test_executable_cache.py`).
    JAX decides once per process whether its cache is used; this sets that decision aside for the
    compile (other threads compiling meanwhile skip JAX's cache too, which costs them only time)."""
    from jax._src import compilation_cache as jax_cache

    mutex = getattr(jax_cache, "_cache_initialized_mutex", None)
    if mutex is None or not hasattr(jax_cache, "_cache_used"):  # another JAX: nothing to set aside
        yield
        return
    with mutex:
        saved = jax_cache._cache_checked, jax_cache._cache_used
        jax_cache._cache_checked, jax_cache._cache_used = True, False
    try:
        yield
    finally:
        with mutex:
            jax_cache._cache_checked, jax_cache._cache_used = saved


def _write_atomically(path: str, data: bytes) -> None:
    try:
        handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except OSError as error:
        logger.warning("could not store a compiled program in %s (%s)", os.path.dirname(path), error)
