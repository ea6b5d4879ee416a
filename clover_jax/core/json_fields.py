"""Typed reads of JSON configuration files: where a value of the wrong JSON type becomes an error.

`config.json` and `generation_config.json` are written by many tools and edited by hand. A value
of the wrong JSON type is never coerced — `"false"` is not false, `"96"` is not 96, `true` is not
1, `96.0` is not 96, `NaN` and `Infinity` are not numbers a config may hold — it is a
`ConfigError` naming the file and the field. `null` reads as "absent" (Hugging Face writes it for
unset fields) except inside a list of ids, where it is refused.

Both config readers (`clover_jax.core.config`, `decoding.generation_config`) read their files through
`read_json_object` and `JsonFields`, so each rule lives here once.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from typing import Any, Mapping

_REQUIRED = object()  # a field with no default
_ABSENT = object()  # a field that is absent or null


class ConfigError(ValueError):
    """A configuration file (or value) that cannot describe what clover-jax runs."""


def read_json_object(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object in the file `path`; ConfigError if it is not UTF-8 JSON holding an object."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        raise ConfigError(f"{path} is not valid JSON: {error}") from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise ConfigError(f"{path} is not valid JSON: nested too deeply") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path} must hold a JSON object {{...}}, got {json_type(value)}")
    return value


def json_type(value: Any) -> str:
    """The JSON name of a value's type, as an error message says it ("a list", "a string")."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def show(value: Any) -> str:
    """`value` spelled as JSON (`"96"`, `true`, `null`, `NaN`), shortened to one readable line."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        try:
            text = repr(value)
        except ValueError:  # an integer too long to print
            text = f"a {type(value).__name__} too long to show"
    return text if len(text) <= 80 else text[:77] + "..."


def is_integer(value: Any) -> bool:
    """An integer that is not a boolean (Python's `True` is an `int`)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    """A real number (not a boolean) that is finite as a float (an integer beyond 1e308 is not)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


class JsonFields:
    """Typed, checked reads of the fields of one JSON object.

    source: the file, for messages ("config.json"); prefix: where the object sits in it
    ("text_config."). Each method returns the field's value, or `default` when the field is
    absent or null; a present value of the wrong type raises ConfigError naming the field.
    """

    def __init__(self, values: Mapping[str, Any], source: str, prefix: str = ""):
        self.values = values
        self.source = source
        self.prefix = prefix

    def has(self, name: str) -> bool:
        return self.values.get(name) is not None

    def integer(self, name: str, default: Any = _REQUIRED, minimum: int | None = None) -> Any:
        value = self._get(name, default)
        if value is _ABSENT:
            return default
        if not is_integer(value):
            self.fail(name, "must be an integer", value)
        if minimum is not None and value < minimum:
            self.fail(name, "must be a positive integer" if minimum == 1 else f"must be an integer >= {minimum}",
                      value)
        return value

    def number(self, name: str, default: Any = _REQUIRED, positive: bool = False) -> Any:
        value = self._get(name, default)
        if value is _ABSENT:
            return default
        if not is_finite_number(value):
            self.fail(name, "must be a finite number", value)
        if positive and value <= 0:
            self.fail(name, "must be a number > 0", value)
        return float(value)

    def boolean(self, name: str, default: Any = _REQUIRED) -> Any:
        value = self._get(name, default)
        if value is _ABSENT:
            return default
        if not isinstance(value, bool):
            self.fail(name, "must be true or false", value)
        return value

    def string(self, name: str, default: Any = _REQUIRED) -> Any:
        value = self._get(name, default)
        if value is _ABSENT:
            return default
        if not isinstance(value, str):
            self.fail(name, "must be a string", value)
        return value

    def strings(self, name: str, default: Any = _REQUIRED) -> Any:
        """A list of strings, as a tuple."""
        value = self._get(name, default)
        if value is _ABSENT:
            return default
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            self.fail(name, "must be a list of strings", value)
        return tuple(value)

    def ids(self, name: str) -> tuple[int, ...]:
        """Token ids: an integer or a list of integers (null or absent: none)."""
        value = self._get(name, ())
        if value is _ABSENT:
            return ()
        items = value if isinstance(value, list) else [value]
        if not all(is_integer(item) and item >= 0 for item in items):
            self.fail(name, "must be a token id (an integer >= 0) or a list of them", value)
        return tuple(items)

    def mapping(self, name: str, default: Any = _REQUIRED) -> Any:
        value = self._get(name, default)
        if value is _ABSENT:
            return default
        if not isinstance(value, dict):
            self.fail(name, "must be an object {...}", value)
        return value

    def fail(self, name: str, rule: str, value: Any) -> None:
        raise ConfigError(f"{self.source}: {self.prefix}{name} {rule}, got {show(value)}")

    def _get(self, name: str, default: Any) -> Any:
        """The field's value, or _ABSENT when it is absent or null and has a default."""
        value = self.values.get(name)
        if value is None:
            if default is _REQUIRED:
                raise ConfigError(f"{self.source} lacks the required field {self.prefix}{name}")
            return _ABSENT
        return value
