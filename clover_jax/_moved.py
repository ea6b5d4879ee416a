"""Module paths from before clover_jax was layered (`clover_jax.model` is now `clover_jax.nn.model`,
...): importing an old path still works for one release, with a DeprecationWarning naming the new one."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

_LAYERS = {
    "core": ("compilation_cache", "config", "executable_cache", "hub", "json_fields", "kernels", "param_layout",
             "quantization", "state"),
    "parallel": ("memory", "planner", "sharding"),
    "nn": ("attention", "chunked", "coreset", "expert_dispatch", "fused_attention", "gated_delta", "gdn", "layers",
           "model", "moe", "online_attention", "rollback", "rope"),
    "api": ("cli", "clover_model", "tokenization"),
}
MOVED = {f"clover_jax.{name}": f"clover_jax.{layer}.{name}" for layer, names in _LAYERS.items() for name in names}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of the old paths with the module at its new path (one module object, two names)."""

    def __init__(self) -> None:
        self._own_specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}; the old path will be removed in the next release",
                      DeprecationWarning, stacklevel=3)
        module = importlib.import_module(MOVED[spec.name])
        self._own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # The module ran at its new path; the import system has just given it the old path's spec.
        module.__spec__ = self._own_specs.pop(module.__spec__.name)


def install() -> None:
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
