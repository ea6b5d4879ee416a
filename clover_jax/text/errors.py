"""The errors of the tokenizer and of the chat-template sandbox: each a `ValueError` with a one-line
message, so the CLI and the server report them as they are."""

from __future__ import annotations

from clover_jax.core.json_fields import ConfigError


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or used as asked (missing file, bad JSON, unknown option)."""


class TokenizerConfigError(TokenizerError, ConfigError):
    """tokenizer_config.json (or special_tokens_map.json) with a field of the wrong type."""


class ChatTemplateError(TokenizerError):
    """No chat template, an unknown template name, or a template that fails or exceeds its bounds."""


def one_line(error: BaseException) -> str:
    """An error's message on one line (its type's name when it has none)."""
    return " ".join(str(error).split()) or type(error).__name__
