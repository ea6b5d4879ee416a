"""The error a bad argument raises: a `ValueError` that carries the argument's name and a code.

Callers that must report *which* input was wrong — the HTTP server naming the request field, the
command line naming the flag — read `field` and `code`, never the message, so a message can be
reworded without changing an API. `field` is the name as the Python API spells it.
"""

from __future__ import annotations

# What kind of problem; the server sends it as OpenAI's `code`.
INVALID_VALUE = "invalid_value"        # a value outside what the field allows
INVALID_TYPE = "invalid_type"          # a value of the wrong type
UNKNOWN_FIELD = "unknown_field"        # a field that does not exist
MISSING_FIELD = "missing_field"        # a required field left out
CONTEXT_LENGTH = "context_length_exceeded"  # more positions than the model's context
UNSUPPORTED = "unsupported_value"      # a value that is valid elsewhere but not in this combination

CODES = (INVALID_VALUE, INVALID_TYPE, UNKNOWN_FIELD, MISSING_FIELD, CONTEXT_LENGTH, UNSUPPORTED)


class FieldError(ValueError):
    """`field` (the argument's name) was given a value that cannot be used; `code` is one of `CODES`."""

    def __init__(self, field: str, message: str, *, code: str = INVALID_VALUE):
        if code not in CODES:
            raise ValueError(f"unknown error code {code!r}; one of {CODES}")
        super().__init__(message)
        self.field = field
        self.code = code
