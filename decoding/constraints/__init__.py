"""Constrained decoding: a grammar that every mode's output keeps to (docs/structured_outputs.md).

`Constraint` says what the output must be (a JSON schema, any JSON object, a regular expression or
a Lark grammar); `compile_constraint` turns it, against a checkpoint's tokenizer, into a
`GrammarMatcher` (llguidance) that tracks one sequence's committed tokens on the host and gives the
tokens allowed next. `decoding.constraints.commit_rule` decides which of a denoising step's commits a
grammar lets stand; `decoding.constraints.drivers` runs `generate`'s three modes under it.
"""

from decoding.constraints.matcher import GrammarMatcher, compile_constraint, matcher_for
from decoding.constraints.spec import CONSTRAINT_KINDS, Constraint

__all__ = ["CONSTRAINT_KINDS", "Constraint", "GrammarMatcher", "compile_constraint", "matcher_for"]
