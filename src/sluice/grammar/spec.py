"""Validation and conversion of a `StructuredOutput` to llguidance's grammar. No torch.

`check()` is what the gateway calls to answer a bad spec with a 400 naming the request's field;
`to_grammar()` is what the worker compiles. Both run the same conversion, so a spec the gateway
accepted never fails to compile in the worker for a reason the gateway could have seen (only the
compile time limit, which depends on the tokenizer, is left to the worker).

Limits (documented in docs/structured-outputs.md):
- a spec of at most `MAX_SPEC_CHARS` characters (`sluice.protocol.MAX_STRUCTURED_SPEC_CHARS`);
- a JSON Schema nested at most `MAX_SCHEMA_DEPTH` levels (objects and arrays of the schema
  document itself; deeper documents are refused before llguidance walks them recursively);
- at most `MAX_CHOICES` choices;
- llguidance's own `LIMITS` on the compiled grammar (its size, the lexer's states and fuel).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from llguidance import LLMatcher, LLParserLimits
from llguidance.gbnf_to_lark import gbnf_to_lark

from sluice.protocol import MAX_STRUCTURED_SPEC_CHARS, StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

MAX_SPEC_CHARS = MAX_STRUCTURED_SPEC_CHARS
MAX_SCHEMA_DEPTH = 32
MAX_CHOICES = 1024

# llguidance's defaults, named here so the gateway's check and the worker's compile bound the same
# things: grammar symbols, lexer states, and the work one mask step may do.
LIMITS = LLParserLimits(max_grammar_size=500_000, max_lexer_states=250_000)

# JSON is generated without free whitespace: a model (a random one above all) could otherwise
# emit spaces forever inside an object. The separators are OpenAI's and Python's json.dumps'.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A structured-output spec the engine cannot enforce; `param` is the request field to name in
    the 400 (the caller's, e.g. "response_format.json_schema.schema")."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def check(structured: StructuredOutput, *, param: str) -> None:
    """Raise `GrammarError(param, message)` unless the engine can enforce `structured`: a spec that
    is not valid JSON / JSON Schema, a keyword llguidance cannot enforce (named), a regex or grammar
    that does not compile, or one over the limits above."""
    grammar = to_grammar(structured, param=param)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None, limits=LIMITS)
    if is_error:
        raise GrammarError(param, _describe(structured.kind, messages[0] if messages else "invalid"))


def to_grammar(structured: StructuredOutput, *, param: str = "structured") -> str:
    """llguidance's grammar text for `structured` (not yet validated: `check` does that, and the
    worker's compile reports the same errors). Raises `GrammarError` for a malformed spec."""
    spec = structured.spec
    if len(spec) > MAX_SPEC_CHARS:
        raise GrammarError(param, f"the {structured.kind} spec has {len(spec)} characters; "
                                  f"at most {MAX_SPEC_CHARS} are accepted")
    match structured.kind:
        case "json":
            return _json_grammar(_schema(spec, param), param)
        case "regex":
            if not spec:
                raise GrammarError(param, "the regex is empty")
            return LLMatcher.grammar_from_regex(spec)
        case "choice":
            return LLMatcher.grammar_from_lark(_choice_lark(spec, param))
        case "grammar":
            return LLMatcher.grammar_from_lark(_lark(spec, param))
        case "tagged":
            return LLMatcher.grammar_from_lark(_tagged_lark(spec, param))
    raise GrammarError(param, f"unknown structured output kind {structured.kind!r}")


def _describe(kind: str, message: str) -> str:
    first = message.strip()
    what = {"json": "JSON Schema", "regex": "regex", "choice": "choice list", "grammar": "grammar",
            "tagged": "tagged schema"}.get(kind, kind)
    if first.startswith("Unimplemented keys"):
        return f"the {what} uses keywords structured outputs cannot enforce: {first.split(':', 1)[1].strip()}"
    return f"the {what} is not valid: {first}"


def _schema(text: str, param: str) -> dict[str, Any] | bool:
    try:
        schema = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise GrammarError(param, f"the JSON Schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError(param, "the JSON Schema must be a JSON object (or true/false)")
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarError(param, f"the JSON Schema is nested {depth} levels deep; "
                                  f"at most {MAX_SCHEMA_DEPTH} are accepted")
    return schema


def _depth(document: Any) -> int:
    """Nesting depth of a parsed JSON document, without recursion (the document may be hostile)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, level)
            if level > MAX_SCHEMA_DEPTH:
                return level  # enough to refuse it
            stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _json_grammar(schema: dict[str, Any] | bool, param: str) -> str:
    if schema is False:
        raise GrammarError(param, "the JSON Schema `false` matches no value")
    try:
        return LLMatcher.grammar_from_json_schema({} if schema is True else schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise GrammarError(param, f"the JSON Schema is not valid: {exc}") from None


def _literal(text: str) -> str:
    """A Lark string literal matching `text` exactly (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _choice_lark(spec: str, param: str) -> str:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise GrammarError(param, f"the choice list is not valid JSON: {exc}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError(param, "the choice list must be a non-empty array of strings")
    if len(choices) > MAX_CHOICES:
        raise GrammarError(param, f"the choice list has {len(choices)} entries; at most {MAX_CHOICES} are accepted")
    return "start: " + " | ".join(_literal(c) for c in dict.fromkeys(choices))


def _lark(spec: str, param: str) -> str:
    """A grammar in Lark syntax (llguidance's), or in GBNF (llama.cpp's, which vLLM's xgrammar
    backend takes): a `::=` rule marks GBNF, converted to Lark."""
    if not spec.strip():
        raise GrammarError(param, "the grammar is empty")
    if "::=" in spec:
        try:
            return gbnf_to_lark(spec)
        except Exception as exc:  # the converter raises plain exceptions of several types
            raise GrammarError(param, f"the GBNF grammar is not valid: {exc}") from None
    return spec


def _tagged_lark(spec: str, param: str) -> str:
    """`begin`, one JSON value matching `schema`, `end`; repeated one or more times when `repeat`."""
    try:
        tagged = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise GrammarError(param, f"the tagged spec is not valid JSON: {exc}") from None
    if not isinstance(tagged, dict) or not isinstance(tagged.get("begin"), str) \
            or not isinstance(tagged.get("end"), str) or not isinstance(tagged.get("repeat", False), bool):
        raise GrammarError(param, 'the tagged spec must be {"begin": str, "schema": {...}, "end": str, '
                                  '"repeat": bool}')
    schema = _schema(json.dumps(tagged.get("schema", True)), param)
    # The JSON compiler's options ride in the schema ("x-guidance"): Lark's %json takes no others.
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": JSON_OPTIONS}
    parts = [_literal(tagged["begin"]) if tagged["begin"] else "", f"%json {json.dumps(schema)}",
             _literal(tagged["end"]) if tagged["end"] else ""]
    item = " ".join(p for p in parts if p)
    return f"start: item{'+' if tagged.get('repeat') else ''}\nitem: {item}\n"
