"""One command-line flag per `FinetuneConfig` field, for `clover-jax train` and `clover-jax plan
--task train` alike: the same names (kebab case), the same defaults (the dataclass's), and each
field's help and closed set of values as the field declares them (`training.config._setting`).

A value is read when the config is built (`values_from_flags`: a bad number is a `FieldError`
naming its flag); a value outside a closed set is refused by argparse itself, naming the choices.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from clover_jax.core.errors import FieldError


def _fields():
    from clover_jax.training.config import FinetuneConfig  # light: no JAX

    hints = typing.get_type_hints(FinetuneConfig)
    return [(field, hints[field.name]) for field in dataclasses.fields(FinetuneConfig)]


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_finetune_flags(parser, *, skip: tuple[str, ...] = ()) -> None:
    """A flag for every `FinetuneConfig` field but those in `skip`, on `parser` (or an argument group)."""
    for field, kind in _fields():
        if field.name in skip:
            continue
        help_text = f"{field.metadata['help']} (default: {_shown(field.default)})"
        choices = field.metadata.get("choices")
        if kind is bool:
            parser.add_argument(flag_name(field.name), dest=field.name, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
        elif choices and "tuple" in str(kind):
            parser.add_argument(flag_name(field.name), dest=field.name, default=None, type=_listed_choices(choices),
                                metavar=",".join(choices), help=help_text)
        elif choices:
            allowed = (*choices, "none") if field.default is None else choices
            parser.add_argument(flag_name(field.name), dest=field.name, default=None, choices=allowed, help=help_text)
        else:
            parser.add_argument(flag_name(field.name), dest=field.name, default=None, metavar=_metavar(kind),
                                help=help_text)


def values_from_flags(args: argparse.Namespace, *, skip: tuple[str, ...] = ()) -> dict:
    """{field: value} for each `FinetuneConfig` flag given on the command line (the rest keep the
    dataclass's defaults) but those in `skip`; FieldError naming a flag whose value cannot be read."""
    values = {}
    for field, kind in _fields():
        raw = None if field.name in skip else getattr(args, field.name, None)
        if raw is not None:
            values[field.name] = _parse(field.name, raw, kind)
    return values


def _shown(default) -> str:
    if default is None:
        return "none"
    if isinstance(default, tuple):
        return ",".join(map(str, default))
    return str(default)


def _listed_choices(choices: tuple[str, ...]):
    """An argparse type: a comma-separated list, each item one of `choices`."""
    def read(text: str) -> str:
        for item in (part.strip() for part in text.split(",")):
            if item and item not in choices:
                raise argparse.ArgumentTypeError(f"invalid choice: {item!r} (choose from {', '.join(choices)})")
        return text

    return read


def _metavar(kind) -> str:
    text = str(kind)
    if "tuple" in text:
        return "A,B,..."
    for name in ("int", "float", "str"):
        if name in text:
            return name.upper()
    return "VALUE"


def _parse(name: str, raw, kind):
    if isinstance(raw, bool):
        return raw
    text = str(kind)
    try:
        if raw.lower() == "none" and "None" in text:
            return None
        if "tuple" in text:
            items = [item.strip() for item in raw.split(",") if item.strip()]
            if "tuple[str" in text:
                return tuple(items)
            if "float" in text.split("tuple")[1]:
                return tuple(float(item) for item in items)
            values = tuple(int(item) for item in items)
            return values[0] if len(values) == 1 and "int |" in text else values
        if "int" in text and "float" not in text:
            return int(raw)
        if "float" in text:
            return float(raw)
        return raw
    except ValueError:
        raise FieldError(name, f"{flag_name(name)}: cannot read {raw!r} as {_metavar(kind).lower()}",
                         code="invalid_type") from None
