"""Parameter paths in nested-dict pytrees: a key path's names, and reading or replacing the leaf at
a path. The parameter table (`params`) names leaves by `Path`; LoRA adapters, the sharding of a
train step, the checkpoint writer and the optimizer's masks all walk trees by it."""

from __future__ import annotations

from typing import Any, Sequence

Path = tuple[str, ...]


def key_names(key_path: Sequence[Any]) -> Path:
    """A `jax.tree_util` key path as names: a dict key's key, a named tuple field's name, else the
    key's own text (a sequence index, "[0]")."""
    return tuple(str(getattr(key, "key", getattr(key, "name", key))) for key in key_path)


def get(tree: dict, path: Path) -> Any:
    """The leaf (or subtree) of the nested dict `tree` at `path`."""
    for key in path:
        tree = tree[key]
    return tree


def put(tree: dict, path: Path, value: Any) -> dict:
    """A copy of the nested dict `tree` with `value` at `path` (only the dicts on the path are copied)."""
    if not path:
        return value
    return {**tree, path[0]: put(tree.get(path[0], {}), path[1:], value)}
