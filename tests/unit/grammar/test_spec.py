"""The grammar module's validation (what the gateway's 400s say) and conversion, torch-free."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from llguidance import LLMatcher

from sluice.grammar import MAX_CHOICES, MAX_SCHEMA_DEPTH, MAX_SPEC_CHARS, GrammarError, check, to_grammar
from sluice.protocol import StructuredOutput

pytestmark = pytest.mark.unit

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["person", "place", "thing"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "parts": {"type": "array", "maxItems": 2, "items": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
            "required": ["id"], "additionalProperties": False}},
    },
    "required": ["name", "kind", "tags", "parts"],
    "additionalProperties": False,
}


def _check(kind: str, spec: str) -> None:
    check(StructuredOutput(kind=kind, spec=spec), param="the.param")  # type: ignore[arg-type]


def _error(kind: str, spec: str) -> GrammarError:
    with pytest.raises(GrammarError) as info:
        _check(kind, spec)
    assert info.value.param == "the.param"
    return info.value


@pytest.mark.parametrize(("kind", "spec"), [
    ("json", json.dumps(NESTED)),
    ("json", '{"type": "object"}'),
    ("json", "true"),
    ("regex", r"\d{3}-[a-z]+"),
    ("choice", '["yes", "no", "", "a \\"quoted\\" one"]'),
    ("grammar", 'start: "a" | "b" item\nitem: /[0-9]+/'),
    ("grammar", 'root ::= "a" | "b"'),  # GBNF, converted
    ("tagged", json.dumps({"begin": "<tool_call>", "schema": NESTED, "end": "</tool_call>", "repeat": True})),
])
def test_valid_specs_pass(kind: str, spec: str) -> None:
    _check(kind, spec)


@pytest.mark.parametrize(("kind", "spec", "words"), [
    ("json", "{", "not valid JSON"),
    ("json", "[1, 2]", "must be a JSON object"),
    ("json", '{"type": "strin"}', "Invalid type"),
    ("json", '{"type": "array", "contains": {"type": "integer"}}', '"contains"'),
    ("json", '{"properties": {"a": {"$ref": "#/defs/missing"}}}', "does not exist"),
    ("json", '{"type": "string", "pattern": "(("}', "unclosed group"),
    ("regex", "a(", "unclosed group"),
    ("regex", "", "empty"),
    ("choice", "[]", "non-empty array"),
    ("choice", '["a", 1]', "non-empty array"),
    ("choice", "nope", "not valid JSON"),
    ("grammar", "start: missing_rule", "unknown name"),
    ("grammar", "root ::= missing", "not found"),
    ("grammar", "   ", "empty"),
    ("tagged", '{"begin": 1}', "tagged spec must be"),
    ("tagged", '{"begin": "<a>", "end": "</a>", "schema": {"type": "nope"}}', "Invalid type"),
])
def test_bad_specs_name_the_problem(kind: str, spec: str, words: str) -> None:
    assert words in _error(kind, spec).message


def test_unenforceable_keyword_is_named() -> None:
    message = _error("json", '{"type": "object", "dependentSchemas": {}}').message
    assert "cannot enforce" in message and "dependentSchemas" in message


def test_limits() -> None:
    deep = "[" * (MAX_SCHEMA_DEPTH + 5) + "]" * (MAX_SCHEMA_DEPTH + 5)
    assert "nested" in _error("json", '{"x": ' + deep + "}").message
    # Right at the depth limit is fine.
    ok = {"type": "object"}
    for _ in range(MAX_SCHEMA_DEPTH // 2 - 1):
        ok = {"type": "object", "properties": {"a": ok}}
    _check("json", json.dumps(ok))
    assert "characters" in _error("regex", "a" * (MAX_SPEC_CHARS + 1)).message
    assert "at most" in _error("choice", json.dumps([str(i) for i in range(MAX_CHOICES + 1)])).message
    # A hostile document deeper than Python's recursion limit is refused, not crashed on.
    _error("json", '{"a": ' * 100_000 + "1" + "}" * 100_000)


def test_grammars_match_what_they_should() -> None:
    """The converted grammars accept exactly the intended texts (checked by llguidance's own
    matcher on a byte-level test tokenizer-free path: `validate_grammar` plus a parse through lark)."""
    choice = to_grammar(StructuredOutput(kind="choice", spec='["red", "green"]'))
    assert LLMatcher.validate_grammar(choice) == ""
    assert '"red"' in choice and '"green"' in choice
    tagged = to_grammar(StructuredOutput(kind="tagged", spec=json.dumps(
        {"begin": "<f>", "schema": {"type": "object"}, "end": "</f>", "repeat": False})))
    assert "item+" not in tagged and "<f>" in tagged


def test_module_is_torch_free() -> None:
    """The gateway imports it: neither torch nor the worker may come along."""
    code = ("import sys, sluice.grammar; "
            "bad = [m for m in ('torch', 'sluice.workers') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
