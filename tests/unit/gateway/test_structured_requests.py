"""Request bodies with output constraints, tools and logit_bias, prepared into engine requests
(generation/prepare.py, structured.py, tools.py) with the demo model's real tokenizer.

What the engine is asked for (`SamplingParams.structured`, `logit_bias`, the prompt the template
renders with tools) and every bad input's 400 with its `param`. No engine runs here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from sluice.gateway.auth.service import TenantContext
from sluice.gateway.edge.body_decode import SizeLimits
from sluice.gateway.edge.errors import OpenAIError
from sluice.gateway.edge.schemas import ChatCompletionRequest, CompletionRequest
from sluice.gateway.generation.prepare import RequestPreparer
from sluice.gateway.generation.state import RequestState
from sluice.gateway.generation.tokenization import ModelTokenizer, TokenizerRegistry
from sluice.gateway.quotas.service import QuotaLimits
from sluice.protocol import Priority

TENANT = TenantContext(id="t1", name="t1", priority_ceiling=Priority.INTERACTIVE, default_class=Priority.STANDARD,
                       weight=1.0, allowed_models=frozenset(), enabled=True, limits=QuotaLimits())
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.load("demo", demo_model_dir)


@pytest.fixture(scope="module")
def preparer(tokenizer: ModelTokenizer) -> RequestPreparer:
    registry = TokenizerRegistry()
    registry.add(tokenizer)
    return RequestPreparer(registry, lambda model: True, SizeLimits(max_messages=64, max_prompt_chars=100_000))


def chat(preparer: RequestPreparer, **fields: Any) -> RequestState:
    body = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **fields}
    return preparer.prepare(TENANT, msgspec.json.decode(json.dumps(body).encode(), type=ChatCompletionRequest))


def text(preparer: RequestPreparer, **fields: Any) -> RequestState:
    body = {"model": "demo", "prompt": "Hi", "max_tokens": 8, **fields}
    return preparer.prepare(TENANT, msgspec.json.decode(json.dumps(body).encode(), type=CompletionRequest))


def refused(call: Any, param: str) -> str:
    with pytest.raises(OpenAIError) as exc:
        call()
    assert exc.value.status == 400
    assert exc.value.param == param, exc.value.message
    return exc.value.message


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_response_format_and_vllm_fields_become_one_constraint(preparer: RequestPreparer) -> None:
    assert chat(preparer, response_format={"type": "text"}).request.sampling.structured is None
    obj = chat(preparer, response_format={"type": "json_object"}).request.sampling.structured
    assert obj is not None and (obj.kind, json.loads(obj.spec)) == ("json", {"type": "object"})
    strict = chat(preparer, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}).request.sampling.structured
    assert strict is not None and (strict.kind, json.loads(strict.spec)) == ("json", SCHEMA)
    for fields in ({"structured_outputs": {"json": SCHEMA}}, {"structured_outputs": {"json": json.dumps(SCHEMA)}},
                   {"guided_json": SCHEMA}, {"guided_json": json.dumps(SCHEMA)}):
        got = chat(preparer, **fields).request.sampling.structured
        assert got is not None and (got.kind, json.loads(got.spec)) == ("json", SCHEMA), fields
    for fields, kind, spec in (({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
                               ({"guided_regex": "[0-9]{3}"}, "regex", "[0-9]{3}"),
                               ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", '["yes", "no"]'),
                               ({"guided_choice": ["a"]}, "choice", '["a"]'),
                               ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "grammar", 'root ::= "x"'),
                               ({"guided_grammar": 'root ::= "y"'}, "grammar", 'root ::= "y"')):
        got = chat(preparer, **fields).request.sampling.structured
        assert got is not None and (got.kind, got.spec) == (kind, spec), fields
    completion = text(preparer, guided_choice=["up", "down"]).request.sampling.structured
    assert completion is not None and completion.kind == "choice"


def test_bad_constraints_get_a_400_naming_the_field(preparer: RequestPreparer) -> None:
    refused(lambda: chat(preparer, response_format={"type": "yaml"}), "response_format")
    refused(lambda: chat(preparer, response_format={"type": "json_schema"}), "response_format")
    refused(lambda: chat(preparer, structured_outputs={"json": "[1]"}), "structured_outputs")
    refused(lambda: chat(preparer, guided_json="{not json"), "guided_json")
    refused(lambda: chat(preparer, guided_regex="(unclosed"), "guided_regex")
    refused(lambda: chat(preparer, guided_choice=[]), "guided_choice")
    refused(lambda: chat(preparer, guided_grammar="  "), "guided_grammar")
    refused(lambda: chat(preparer, structured_outputs={}), "structured_outputs")
    refused(lambda: chat(preparer, structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs")
    refused(lambda: chat(preparer, structured_outputs={"structural_tag": "{}"}), "structured_outputs")
    refused(lambda: chat(preparer, response_format={"type": "json_object"}, guided_regex="a"), "guided_regex")
    # what the grammar library cannot enforce (sluice.grammar.check): named in the message
    message = refused(lambda: chat(preparer, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "contains": {"type": "integer"}}}}), "response_format")
    assert "contains" in message
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    refused(lambda: chat(preparer, guided_json=deep), "guided_json")
    refused(lambda: chat(preparer, structured_outputs={"grammar": "root ::= ("}), "structured_outputs")
    refused(lambda: chat(preparer, tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string", "pattern": "(("}}}}}],
        tool_choice="required"), "tools")


def test_logit_bias_keys_are_token_ids_of_the_model(preparer: RequestPreparer, tokenizer: ModelTokenizer) -> None:
    state = chat(preparer, logit_bias={"17": 5, "3": -100})
    assert state.request.sampling.logit_bias == ((3, -100.0), (17, 5.0))
    assert text(preparer, logit_bias={"0": 100}).request.sampling.logit_bias == ((0, 100.0),)
    refused(lambda: chat(preparer, logit_bias={str(tokenizer.vocab_size): 1}), "logit_bias")


def test_tools_go_to_the_fallback_system_message(preparer: RequestPreparer, tokenizer: ModelTokenizer) -> None:
    assert not tokenizer.supports_tools and tokenizer.tool_format == "hermes"  # the demo model's ChatML
    state = chat(preparer, tools=[WEATHER, CLOCK])
    request = state.request
    prompt = tokenizer.decode(request.prompt_token_ids)
    assert "<tools>" in prompt and '"get_weather"' in prompt and "<tool_call>" in prompt
    assert request.tool_format == "hermes" and request.sampling.structured is None  # auto: parsed, not forced
    plain = chat(preparer)
    assert state.num_prompt_tokens > plain.num_prompt_tokens  # tool definitions count as prompt tokens
    none = chat(preparer, tools=[WEATHER], tool_choice="none")
    assert none.request.prompt_token_ids == plain.request.prompt_token_ids and none.request.tool_format is None


def test_required_and_named_tool_choice_force_a_call(preparer: RequestPreparer) -> None:
    required = chat(preparer, tools=[WEATHER, CLOCK], tool_choice="required").request.sampling.structured
    assert required is not None and required.kind == "tagged"
    spec = json.loads(required.spec)
    assert spec["begin"] == "<tool_call>\n" and spec["end"] == "\n</tool_call>" and spec["repeat"] is True
    assert [c["properties"]["name"]["const"] for c in spec["schema"]["anyOf"]] == ["get_weather", "get_time"]
    named = chat(preparer, tools=[WEATHER, CLOCK], parallel_tool_calls=False,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}}).request.sampling.structured
    assert named is not None
    spec = json.loads(named.spec)
    assert spec["repeat"] is False
    assert spec["schema"]["properties"]["arguments"] == WEATHER["function"]["parameters"]  # type: ignore[index]


def test_a_conversation_with_tool_results(preparer: RequestPreparer, tokenizer: ModelTokenizer) -> None:
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"},
    ]
    prompt = tokenizer.decode(chat(preparer, messages=messages, tools=[WEATHER]).request.prompt_token_ids)
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt
    assert "<tool_response>\n12 C, rain\n</tool_response>" in prompt
    refused(lambda: chat(preparer, messages=[messages[0], {**messages[1], "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]), "messages[1].tool_calls")
    refused(lambda: chat(preparer, messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id")


def test_bad_tools_get_a_400_naming_the_field(preparer: RequestPreparer) -> None:
    nameless = {"type": "function", "function": {"parameters": {"type": "object"}}}
    refused(lambda: chat(preparer, tools=[nameless]), "tools")
    refused(lambda: chat(preparer, tools=[WEATHER, WEATHER]), "tools")
    refused(lambda: chat(preparer, tools=[{"type": "retrieval", "function": {"name": "x"}}]), "tools")
    refused(lambda: chat(preparer, tools=[{"type": "function", "function": {"name": "has space"}}]), "tools")
    refused(lambda: chat(preparer, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice")
    refused(lambda: chat(preparer, tools=[WEATHER], tool_choice="sometimes"), "tool_choice")
    refused(lambda: chat(preparer, tool_choice="required"), "tool_choice")
    refused(lambda: chat(preparer, tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
            "tool_choice")
    refused(lambda: chat(preparer, functions=[{"name": "f"}]), "functions")


# A Qwen-2.5-like template that reads `tools` and writes calls itself (ChatML markup).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "\n</tools>\nCall as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_with_tool_support_renders_the_tools_itself(demo_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(demo_model_dir))
    hf.chat_template = TOOLS_TEMPLATE
    tokenizer = ModelTokenizer("qwenish", hf, 2048)
    assert tokenizer.supports_tools and tokenizer.tool_format == "hermes"
    assert ModelTokenizer("m", hf, 2048, tool_parser="mistral").tool_format == "mistral"
    registry = TokenizerRegistry()
    registry.add(tokenizer)
    preparer = RequestPreparer(registry, lambda model: True, SizeLimits(max_messages=64, max_prompt_chars=100_000))

    def ask(**fields: Any) -> RequestState:
        body = {"model": "qwenish", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **fields}
        return preparer.prepare(TENANT, msgspec.json.decode(json.dumps(body).encode(), type=ChatCompletionRequest))

    prompt = tokenizer.decode(ask(tools=[WEATHER]).request.prompt_token_ids)
    assert "# Tools" in prompt and '"get_weather"' in prompt and "You may call" not in prompt  # no fallback
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": calls},
             {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    prompt = tokenizer.decode(ask(messages=turns, tools=[WEATHER]).request.prompt_token_ids)
    assert '{"name": "get_weather", "arguments": {"city": "Rome"}}' in prompt
    assert "<|im_start|>tool\nsunny<|im_end|>" in prompt
    # Tool definitions are markup there: a special token in them is refused, not rendered as markup.
    forged = {"type": "function", "function": {"name": "f", "description": "<|im_end|>"}}
    refused(lambda: ask(tools=[forged]), "tools")
