"""What a constrained output must be: `Constraint`, checked before anything compiles.

A constraint is one of four kinds, each given as its source text:

  * ``json_schema``: a JSON schema (a dict, or its JSON text), within what llguidance compiles
    (draft 2020-12's structural keywords; docs/structured_outputs.md lists the subset);
  * ``json_object``: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``);
  * ``regex``: a regular expression the whole answer matches (Rust `regex` syntax, anchored);
  * ``lark``: a Lark grammar (llguidance's dialect, ``start`` the answer).

`Constraint.of` takes a `Constraint`, or a dict with exactly one of those keys, as
`generate(..., constraint=...)` and `GenerationConfig(constraint=...)` accept it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from clover_jax.core.errors import INVALID_TYPE, INVALID_VALUE, FieldError

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "lark")
# block diffusion's rules for commits past an undecided position (decoding.constraints.commit_rule):
# "witness" commits them when this step's candidates fill the gap validly; "frontier" never does
GAP_RULES = ("witness", "frontier")

# The largest grammar source accepted (a schema's JSON text, a regex, a Lark grammar): far beyond any
# tool schema, small enough that a request cannot make the host build an arbitrarily large grammar.
MAX_SOURCE_CHARS = 1 << 20


@dataclasses.dataclass(frozen=True)
class Constraint:
    """kind: one of `CONSTRAINT_KINDS`; source: the schema's JSON text, the regular
    expression or the Lark grammar ("" for json_object); field: the argument that gave it, named
    in errors (the server passes "response_format.json_schema.schema", "tools[0].function.parameters")."""

    kind: str
    source: str = ""
    field: str = "constraint"

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:
            raise FieldError(self.field, f"a constraint's kind must be one of {CONSTRAINT_KINDS}, got {self.kind!r}")
        if not isinstance(self.source, str):
            raise FieldError(self.field, f"a constraint's source must be a string, got {type(self.source).__name__}",
                             code=INVALID_TYPE)
        if len(self.source) > MAX_SOURCE_CHARS:
            raise FieldError(self.field, f"the {self.kind} is {len(self.source):,} characters; at most "
                                         f"{MAX_SOURCE_CHARS:,} are accepted")
        if self.kind != "json_object" and not self.source.strip():
            raise FieldError(self.field, f"the {self.kind} is empty")

    # ------------------------------------------------------------------ construction
    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str, *, field: str = "constraint") -> "Constraint":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise FieldError(field, f"the JSON schema is not JSON: {error}") from None
        if not isinstance(schema, Mapping):
            raise FieldError(field, f"a JSON schema must be an object, got {type(schema).__name__}",
                             code=INVALID_TYPE)
        return cls("json_schema", json.dumps(schema), field)  # key order kept: properties are written in it

    @classmethod
    def json_object(cls, *, field: str = "constraint") -> "Constraint":
        return cls("json_object", "", field)

    @classmethod
    def regex(cls, pattern: str, *, field: str = "constraint") -> "Constraint":
        return cls("regex", pattern, field)

    @classmethod
    def lark(cls, grammar: str, *, field: str = "constraint") -> "Constraint":
        return cls("lark", grammar, field)

    @classmethod
    def of(cls, value: "Constraint | Mapping[str, Any] | None", *, field: str = "constraint") -> "Constraint | None":
        """`value` as a Constraint: itself, None, or a dict with one key of `CONSTRAINT_KINDS`
        (``{"regex": "[0-9]+"}``, ``{"json_schema": {...}}``, ``{"json_object": True}``)."""
        if value is None or isinstance(value, Constraint):
            return value
        if not isinstance(value, Mapping):
            raise FieldError(field, "a constraint is a Constraint or a dict with one of the keys "
                                    f"{CONSTRAINT_KINDS}, got {type(value).__name__}", code=INVALID_TYPE)
        kinds = [key for key in value if key in CONSTRAINT_KINDS]
        unknown = sorted(set(value) - set(CONSTRAINT_KINDS))
        if unknown or len(kinds) != 1:
            raise FieldError(field, f"a constraint dict has exactly one of the keys {CONSTRAINT_KINDS}, got "
                                    f"{sorted(value)}", code=INVALID_VALUE)
        kind = kinds[0]
        if kind == "json_schema":
            return cls.json_schema(value[kind], field=field)
        if kind == "json_object":
            if value[kind] is not True:
                raise FieldError(field, f"json_object takes True, got {value[kind]!r}")
            return cls.json_object(field=field)
        return cls(kind, value[kind], field)

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema (json_schema), else None."""
        return json.loads(self.source) if self.kind == "json_schema" else None
