"""Structured outputs: what a request's output must match, as a grammar the engine enforces.

Torch-free (the gateway imports it to answer a bad schema with a 400 before a request is queued):
- `spec.py`: `check()` (validation, the documented limits) and `to_grammar()` (each
  `StructuredOutput.kind` converted to llguidance's grammar);
- `compiler.py` (worker side): compiled grammars cached by (kind, spec, tokenizer), compiled off
  the engine loop, and the per-request `Matcher` that follows a request's output tokens.

The library is llguidance (docs/structured-outputs.md says why: measured against xgrammar in
`sluice bench grammar-libs`, and it needs no torch, so the gateway validates with the same code
the worker enforces with).
"""

from sluice.grammar.spec import (
    MAX_CHOICES,
    MAX_SCHEMA_DEPTH,
    MAX_SPEC_CHARS,
    GrammarError,
    check,
    to_grammar,
)

__all__ = ["MAX_CHOICES", "MAX_SCHEMA_DEPTH", "MAX_SPEC_CHARS", "GrammarError", "check", "to_grammar"]
