"""Tool calling on the way in: `tools`, `tool_choice`, `parallel_tool_calls`, and a conversation's
tool turns, as the chat template takes them.

- The tools go to the model's chat template (`apply_chat_template(tools=...)`) when the template
  uses them. A template without tool support (SmolLM2's, the demo model's) gets the documented
  fallback instead (`fallback_messages`): a system message listing the tools as JSON and asking
  for calls in the Hermes format `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; an
  earlier assistant turn's calls are written the same way into its content and a `tool` turn
  becomes a user turn `<tool_response>...</tool_response>` (what Qwen's own template does).
- `tool_choice: "none"`: the tools are not shown to the model at all (so it cannot call them);
  `"auto"` (the default with tools): the model may call; the answer's text is parsed
  (generation/tool_parsers.py); `"required"` or a named function: the engine's grammar forces one
  call (or more, with `parallel_tool_calls`) in the model family's format (`call_constraint`).
- The call format follows the template (`tool_format`), overridable per model in models.toml
  (`tool_parser`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal, get_args

from sluice.gateway.edge.errors import bad_request
from sluice.gateway.edge.schemas import ChatCompletionRequest, NamedToolChoice
from sluice.protocol import StructuredOutput

ToolFormat = Literal["hermes", "llama3_json", "mistral"]
TOOL_FORMATS: tuple[str, ...] = get_args(ToolFormat)
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
# What the fallback system message says (docs/api.md quotes it).
FALLBACK_INSTRUCTIONS = (
    "You may call one or more functions to help with the user's request. The functions are listed as "
    "JSON below, between <tools> and </tools>.\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object with its name and arguments between <tool_call> and "
    "</tool_call>, one per call:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>"
)


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A chat request's tools as the template and the grammar take them."""

    tools: list[dict[str, Any]]  # OpenAI's shape: {"type": "function", "function": {...}}
    choice: Literal["auto", "required"] | str  # or the name of the one function it must call
    parallel: bool

    @property
    def forced(self) -> bool:
        return self.choice != "auto"


def tool_request(body: ChatCompletionRequest) -> ToolRequest | None:
    """The request's tools, or None when the model is not to see any (no tools, or choice "none")."""
    for name in ("functions", "function_call"):
        if getattr(body, name) is not None:
            raise bad_request(f"{name} (the legacy function calling) is not supported: use tools and tool_choice.",
                              name)
    choice = body.tool_choice
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise bad_request(f"tool_choice {choice!r} is not valid: expected none, auto, required or "
                          '{"type": "function", "function": {"name": ...}}.', "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.type != "function":
        raise bad_request(f"tool_choice type {choice.type!r} is not supported: only 'function' is.", "tool_choice")
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice requires tools: there is no function to call.", "tool_choice")
        return None
    names: set[str] = set()
    tools: list[dict[str, Any]] = []
    for i, tool in enumerate(body.tools):
        function = tool.function
        if tool.type != "function":
            raise bad_request(f"tools[{i}].type {tool.type!r} is not supported: only 'function' is.", "tools")
        if not function.name:
            raise bad_request(f"tools[{i}].function.name is missing: every tool needs a name.", "tools")
        if not _NAME.match(function.name):
            raise bad_request(f"tools[{i}].function.name {function.name!r} must be 1 to 64 letters, digits, "
                              "underscores or dashes.", "tools")
        if function.name in names:
            raise bad_request(f"tools[{i}].function.name {function.name!r} is given twice: tool names must be "
                              "unique.", "tools")
        names.add(function.name)
        spec: dict[str, Any] = {"name": function.name}
        if function.description is not None:
            spec["description"] = function.description
        spec["parameters"] = function.parameters if function.parameters is not None else {"type": "object",
                                                                                          "properties": {}}
        tools.append({"type": "function", "function": spec})
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not in tools.",
                              "tool_choice")
        chosen: str = choice.function.name
    else:
        chosen = choice or "auto"
    return ToolRequest(tools=tools, choice=chosen, parallel=body.parallel_tool_calls is not False)


def tool_format(template: str, override: str | None = None) -> ToolFormat:
    """The call format a model writes: models.toml's `tool_parser`, else what its template shows."""
    if override is not None:
        if override not in TOOL_FORMATS:
            raise ValueError(f"tool_parser must be one of {', '.join(TOOL_FORMATS)}, got {override!r}")
        return override  # type: ignore[return-value]
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template or "tools" not in template:
        return "hermes"  # Hermes and Qwen, and the fallback for templates without tool support
    if "<|eot_id|>" in template or "<|python_tag|>" in template:
        return "llama3_json"
    return "hermes"


def template_supports_tools(template: str) -> bool:
    """Whether a chat template reads `tools` (otherwise the fallback system message describes them)."""
    return re.search(r"\btools\b", template) is not None


def call_constraint(tools: ToolRequest, fmt: ToolFormat) -> StructuredOutput:
    """The grammar that makes `required` / a named function a call, in the family's format: a
    `tagged` output whose JSON is {"name": <one of the allowed>, "arguments": <its parameters>}."""
    allowed = [t["function"] for t in tools.tools if tools.choice in ("required", t["function"]["name"])]
    calls = [{"type": "object",
              "properties": {"name": {"const": f["name"]},
                             ("parameters" if fmt == "llama3_json" else "arguments"): f["parameters"]},
              "required": ["name", "parameters" if fmt == "llama3_json" else "arguments"]}
             for f in allowed]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if fmt == "mistral":
        array: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
        if not tools.parallel:
            array["maxItems"] = 1
        spec = {"begin": "[TOOL_CALLS]", "schema": array, "end": "", "repeat": False}
    elif fmt == "llama3_json":
        spec = {"begin": "", "schema": call, "end": "", "repeat": False}
    else:
        spec = {"begin": "<tool_call>\n", "schema": call, "end": "\n</tool_call>", "repeat": tools.parallel}
    return StructuredOutput(kind="tagged", spec=json.dumps(spec, separators=(",", ":"), ensure_ascii=False))


def template_tool_calls(calls: list[Any], index: int) -> list[dict[str, Any]]:
    """An assistant turn's calls as templates take them: arguments as an object (HF's convention)."""
    out = []
    for call in calls:
        try:
            arguments = json.loads(call.function.arguments) if call.function.arguments else {}
        except ValueError:
            raise bad_request(f"messages[{index}].tool_calls: the arguments of {call.function.name!r} are not "
                              "valid JSON.", f"messages[{index}].tool_calls") from None
        out.append({"id": call.id, "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments}})
    return out


def fallback_messages(messages: list[dict[str, Any]], tools: ToolRequest | None) -> list[dict[str, Any]]:
    """The conversation for a template without tool support: tools in a system message, calls and
    results as text (module docstring)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message["content"]
        if message.get("tool_calls"):
            calls = "\n".join(f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']}, ensure_ascii=False)}\n</tool_call>"  # noqa: E501
                              for c in message["tool_calls"])
            out.append({"role": role, "content": f"{content}\n{calls}" if content else calls})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools is not None:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.tools)
        instructions = FALLBACK_INSTRUCTIONS.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{instructions}"}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out
