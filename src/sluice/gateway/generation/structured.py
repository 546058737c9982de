"""What a request's output must match: OpenAI's `response_format` and vLLM's extensions, as one
`StructuredOutput` (protocol.py) for the engine's grammar.

Accepted, with the names their clients send:
- OpenAI `response_format`: `text` (nothing), `json_object` (any JSON object), `json_schema`
  (`json_schema.schema`; `strict` true or false alike: the grammar always enforces the schema);
- vLLM's current `structured_outputs` object: exactly one of `json` (a schema, as an object or as
  JSON text), `regex`, `choice` (a list of strings), `grammar`, `json_object: true`;
- vLLM's older fields `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

At most one of these sources per request (two are a 400 naming the second). What the gateway
checks here is the shape (a schema is a JSON object, a choice list is non-empty strings, a regex
compiles); whether the grammar library can enforce it (unsupported keywords, size and depth limits)
is the grammar module's `check`, run by `RequestPreparer` on the result.
"""

from __future__ import annotations

import json
import re
from typing import Any

from sluice.gateway.edge.errors import bad_request
from sluice.gateway.edge.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    StructuredOutputsParams,
)
from sluice.protocol import StructuredOutput

# `{"type": "object"}` is what OpenAI's json_object promises: some JSON object.
JSON_OBJECT = StructuredOutput(kind="json", spec='{"type": "object"}')
MAX_CHOICES = 1024  # entries of a choice list (each becomes one alternative of the grammar)


def structured_output(body: ChatCompletionRequest | CompletionRequest) -> StructuredOutput | None:
    """The request's constraint on its output, or None; a 400 naming the field for a bad one."""
    found: list[tuple[str, StructuredOutput]] = []
    if isinstance(body, ChatCompletionRequest) and body.response_format is not None:
        fmt = _response_format(body.response_format)
        if fmt is not None:
            found.append(("response_format", fmt))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(body.structured_outputs)))
    if body.guided_json is not None:
        found.append(("guided_json", _json(body.guided_json, "guided_json")))
    if body.guided_regex is not None:
        found.append(("guided_regex", _regex(body.guided_regex, "guided_regex")))
    if body.guided_choice is not None:
        found.append(("guided_choice", _choice(body.guided_choice, "guided_choice")))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", _grammar(body.guided_grammar, "guided_grammar")))
    if len(found) > 1:
        raise bad_request(f"{found[1][0]} cannot be combined with {found[0][0]}: give one output constraint.",
                          found[1][0])
    return found[0][1] if found else None


def _response_format(fmt: ResponseFormat) -> StructuredOutput | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JSON_OBJECT
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad_request("response_format of type json_schema needs a json_schema object.", "response_format")
        schema = fmt.json_schema.schema
        return JSON_OBJECT if schema is None else _json(schema, "response_format")
    raise bad_request(f"response_format type {fmt.type!r} is not supported: expected text, json_object or "
                      "json_schema.", "response_format")


def _structured_outputs(params: StructuredOutputsParams) -> StructuredOutput:
    name = "structured_outputs"
    if params.structural_tag is not None:
        raise bad_request("structured_outputs.structural_tag is not supported: use json, regex, choice, grammar "
                          "or tools.", name)
    given: list[StructuredOutput] = []
    if params.json is not None:
        given.append(_json(params.json, name))
    if params.regex is not None:
        given.append(_regex(params.regex, name))
    if params.choice is not None:
        given.append(_choice(params.choice, name))
    if params.grammar is not None:
        given.append(_grammar(params.grammar, name))
    if params.json_object:
        given.append(JSON_OBJECT)
    if len(given) != 1:
        raise bad_request("structured_outputs must set exactly one of json, regex, choice, grammar or json_object "
                          f"(it sets {len(given)}).", name)
    return given[0]


def _json(schema: str | dict[str, Any] | bool, param: str) -> StructuredOutput:
    """A JSON Schema, given as an object (or `true`) or as JSON text, as compact JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad_request(f"{param}: the JSON schema is not valid JSON ({exc}).", param) from None
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise bad_request(f"{param}: a JSON schema must be a JSON object.", param)
    return StructuredOutput(kind="json", spec=json.dumps(schema, separators=(",", ":"), ensure_ascii=False))


def _regex(pattern: str, param: str) -> StructuredOutput:
    # Python's syntax is close to what the grammar libraries take; their own check refines it.
    try:
        re.compile(pattern)
    except re.error as exc:
        raise bad_request(f"{param}: the regex does not compile ({exc}).", param) from None
    if not pattern:
        raise bad_request(f"{param}: the regex is empty.", param)
    return StructuredOutput(kind="regex", spec=pattern)


def _choice(choices: list[str], param: str) -> StructuredOutput:
    if not choices or len(choices) > MAX_CHOICES:
        raise bad_request(f"{param}: a choice list needs 1 to {MAX_CHOICES} strings.", param)
    if any(not isinstance(c, str) or not c for c in choices):
        raise bad_request(f"{param}: every choice must be a non-empty string.", param)
    return StructuredOutput(kind="choice", spec=json.dumps(choices, ensure_ascii=False))


def _grammar(grammar: str, param: str) -> StructuredOutput:
    if not grammar.strip():
        raise bad_request(f"{param}: the grammar is empty.", param)
    return StructuredOutput(kind="grammar", spec=grammar)
