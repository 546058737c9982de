"""Tools the structured-output tests of the gateway share (importable as `structured_cases`:
tests/ is on the path): two function tools with bounded arguments, and the check that a call's
arguments validate against its tool's schema."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}}, "required": ["tz"],
    "additionalProperties": False}}}
TOOLS = {tool["function"]["name"]: tool for tool in (WEATHER, CLOCK)}


def check_call(name: str, arguments: str, tool_choice: Any) -> None:
    """The call names a tool of TOOLS (the one `tool_choice` names, when it names one), and its
    arguments validate against that tool's parameters schema."""
    if isinstance(tool_choice, dict):
        assert name == tool_choice["function"]["name"]
    jsonschema.validate(json.loads(arguments), TOOLS[name]["function"]["parameters"])

# A schema whose every answer is long on any model (16 strings of 20 to 24 characters: about 240
# tokens on the demo model), so a test can kill what serves it mid-object; it fits in 480 tokens.
LONG_OBJECT = {"type": "object", "properties": {"lines": {
    "type": "array", "minItems": 16, "maxItems": 16, "items": {"type": "string", "minLength": 20, "maxLength": 24}}},
    "required": ["lines"], "additionalProperties": False}
