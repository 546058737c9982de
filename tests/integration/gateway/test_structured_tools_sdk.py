"""Structured outputs and tool calling with the official `openai` SDK against `sluice serve` (a real
gateway process, the embedded broker, a real worker process, the demo model: random weights, so
only the engine's grammar can make an answer valid).

Tests marked `needs_grammar` need the engine's constrained decoding (issue #31's engine side; they
first check that it is applied); the others hold with the gateway alone: every bad input gets a
400 naming its `param` and the next request is served, and a conversation with a tool result goes
on.
"""

from __future__ import annotations

import enum
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from structured_cases import CLOCK, WEATHER, check_call

from sluice_lab.experiments.stack import Stack, start_stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# Tests that need the engine to enforce the grammar ask for this fixture (below).
needs_grammar = pytest.mark.usefixtures("engine_enforces_grammar")

CONFIG = Path(__file__).resolve().parents[3] / "config"
ASK = [{"role": "user", "content": "Order two green widgets for Ada."}]


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Item(BaseModel):
    name: str = Field(max_length=10)
    color: Color
    count: int | None = None


class Order(BaseModel):
    customer: str = Field(max_length=12)
    items: list[Item] = Field(max_length=2)
    note: str | None = Field(default=None, max_length=12)


@pytest.fixture(scope="module")
def stack(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with start_stack(CONFIG, tmp_path_factory.mktemp("structured"), demo_model_dir) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    key = stack.create_tenant_key(f"structured-{secrets.token_hex(3)}", ceiling="interactive",
                                  default_class="standard")
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def engine_enforces_grammar(client: openai.OpenAI, stack: Stack) -> None:
    """The engine applies grammar masks: with one allowed choice, a random-weight model's answer is
    that choice only when the mask is applied (a clear first failure when the engine stops)."""
    probe = client.chat.completions.create(model=stack.model, messages=ASK, max_tokens=8, seed=3,
                                           extra_body={"guided_choice": ["sluice"]})
    assert probe.choices[0].message.content == "sluice", "the engine does not enforce structured outputs"


def refused(call: Any, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        call()
    assert exc.value.status_code == 400
    assert exc.value.body["param"] == param, exc.value.body


def test_bad_input_gets_a_400_naming_the_param_and_the_next_request_is_served(
        client: openai.OpenAI, stack: Stack) -> None:
    def create(**fields: Any) -> Any:
        return lambda: client.chat.completions.create(model=stack.model, messages=ASK, max_tokens=4, **fields)

    nameless = {"type": "function", "function": {"parameters": {"type": "object"}}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
         "response_format.json_schema.schema"),
        ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}}, "structured_outputs"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice"),
        ({"tools": [nameless]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"n": 9}, "n"),  # above gateway.max_n (8)
        ({"n": 2, "stream": True, "extra_headers": {"Idempotency-Key": "n2"}}, "n"),  # not resumable
        ({"logit_bias": {"99999999": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias[...]"),  # the edge names the entry
    ]
    for fields, param in cases:
        refused(create(**fields), param)
        answer = client.chat.completions.create(model=stack.model, messages=ASK, max_tokens=2)
        assert answer.choices[0].finish_reason in ("stop", "length")


def test_a_conversation_with_a_tool_result_goes_on(client: openai.OpenAI, stack: Stack) -> None:
    plain = client.chat.completions.create(model=stack.model, messages=ASK, max_tokens=3, temperature=0)
    with_tools = client.chat.completions.create(model=stack.model, messages=ASK, max_tokens=3, temperature=0,
                                                tools=[WEATHER, CLOCK])
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tool definitions count
    turns = [*ASK,
             {"role": "assistant", "content": None, "tool_calls": [{
                 "id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "12 C and rain"}]
    answer = client.chat.completions.create(model=stack.model, messages=turns, max_tokens=4, tools=[WEATHER])
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.usage.prompt_tokens > with_tools.usage.prompt_tokens - 60


def test_n_choices_are_seeded_requests_with_usage_summed(client: openai.OpenAI, stack: Stack) -> None:
    answer = client.chat.completions.create(model=stack.model, messages=ASK, max_tokens=6, n=3, seed=40,
                                            extra_body={"ignore_eos": True})
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert answer.usage.completion_tokens == 18
    single = client.chat.completions.create(model=stack.model, messages=ASK, max_tokens=6, seed=41,
                                            extra_body={"ignore_eos": True})
    assert answer.choices[1].message.content == single.choices[0].message.content  # choice i: seed + i
    assert answer.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once
    texts = client.completions.create(model=stack.model, prompt="Once", max_tokens=4, n=2, temperature=0)
    assert len(texts.choices) == 2 and texts.choices[0].text == texts.choices[1].text  # greedy: equal


def test_n_choices_stream_interleaved_each_with_its_finish_and_usage_at_the_end(
        client: openai.OpenAI, stack: Stack) -> None:
    ask: dict[str, Any] = dict(model=stack.model, messages=ASK, max_tokens=6, seed=40, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(n=3, **ask)
    chunks = list(client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **ask))
    texts, roles, finishes = ["", "", ""], [0, 0, 0], [None, None, None]
    for chunk in chunks[:-1]:
        assert chunk.id == chunks[0].id and chunk.usage is None and len(chunk.choices) == 1
        choice = chunk.choices[0]
        assert finishes[choice.index] is None  # nothing of a choice after its finish
        roles[choice.index] += choice.delta.role == "assistant"
        texts[choice.index] += choice.delta.content or ""
        finishes[choice.index] = choice.finish_reason
    assert roles == [1, 1, 1] and finishes == ["length"] * 3
    assert texts == [c.message.content for c in whole.choices]  # choice i: seed + i, streamed or not
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # prompt once, completions summed
    assert whole.usage.completion_tokens == 18
    streamed = list(client.completions.create(model=stack.model, prompt="Once", max_tokens=4, n=2, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices[0].index == 0) == \
        "".join(c.choices[0].text for c in streamed if c.choices[0].index == 1)  # greedy: equal


@needs_grammar
def test_the_sdk_stream_helper_assembles_n_choices(client: openai.OpenAI, stack: Stack) -> None:
    # Constrained so that every choice stops (the helper refuses an answer cut at max_tokens).
    ask: dict[str, Any] = dict(model=stack.model, messages=ASK, max_tokens=8, n=3, seed=5,
                               extra_body={"guided_choice": ["alpha", "beta", "gamma", "delta"]})
    whole = client.chat.completions.create(**ask)
    with client.chat.completions.stream(**ask) as events:
        final = events.get_final_completion()
    assert [(c.index, c.message.content, c.finish_reason) for c in final.choices] == \
        [(c.index, c.message.content, "stop") for c in whole.choices]


def test_n_choices_bill_the_request_and_its_prompt_once(stack: Stack) -> None:
    limit = 1_000_000
    key = stack.create_tenant_key(f"n-usage-{secrets.token_hex(3)}", ceiling="interactive", default_class="standard",
                                  quotas={"tokens_per_minute": limit})
    own = openai.OpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0, timeout=300)
    ask: dict[str, Any] = dict(model=stack.model, messages=ASK, max_tokens=5, seed=7, extra_body={"ignore_eos": True})
    whole = own.chat.completions.create(n=3, **ask)
    last = list(own.chat.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **ask))[-1]
    prompt = whole.usage.prompt_tokens + last.usage.prompt_tokens
    assert whole.usage.prompt_tokens == last.usage.prompt_tokens and last.usage.completion_tokens == 10
    used = prompt + 15 + 10
    headers = own.models.with_raw_response.list().headers
    assert int(headers["x-ratelimit-remaining-tokens"]) == limit - used  # the token quota: prompt once
    auth = {"Authorization": f"Bearer {key}"}
    deadline = time.monotonic() + 30
    while True:  # usage records are written behind (within gateway's flush interval)
        rows = httpx.get(f"{stack.base_url}/v1/usage", headers=auth, timeout=30).json()["data"]
        if (rows and rows[0]["completion_tokens"] == 25) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [(r["prompt_tokens"], r["completion_tokens"], r["requests"]) for r in rows] == [(prompt, 25, 2)]


@needs_grammar
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parse_with_a_nested_pydantic_model(client: openai.OpenAI, stack: Stack, stream: bool) -> None:
    for seed in range(20):
        if stream:
            with client.chat.completions.stream(model=stack.model, messages=ASK, response_format=Order,
                                                max_tokens=400, seed=seed) as events:
                completion = events.get_final_completion()
        else:
            completion = client.chat.completions.parse(model=stack.model, messages=ASK, response_format=Order,
                                                       max_tokens=400, seed=seed)
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop", message.content
        assert isinstance(message.parsed, Order)


@needs_grammar
def test_json_object_regex_and_choice(client: openai.OpenAI, stack: Stack) -> None:
    obj = client.chat.completions.create(model=stack.model, messages=ASK, max_tokens=200, seed=1,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    choice = client.chat.completions.create(model=stack.model, messages=ASK, max_tokens=10,
                                            extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no")
    regex = client.completions.create(model=stack.model, prompt="Code:", max_tokens=10,
                                      extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    text = regex.choices[0].text
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()


@needs_grammar
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_validate_whole_and_streamed(client: openai.OpenAI, stack: Stack,
                                                       tool_choice: Any) -> None:
    for seed in range(5):
        answer = client.chat.completions.create(model=stack.model, messages=ASK, max_tokens=200, seed=seed,
                                                tools=[WEATHER, CLOCK], tool_choice=tool_choice,
                                                parallel_tool_calls=False)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call.function.name, call.function.arguments, tool_choice)
        with client.chat.completions.stream(model=stack.model, messages=ASK, max_tokens=200, seed=seed,
                                            tools=[WEATHER, CLOCK], tool_choice=tool_choice,
                                            parallel_tool_calls=False) as events:
            final = events.get_final_completion()
        streamed = final.choices[0]
        assert streamed.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []] == \
            [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


@needs_grammar
def test_logit_bias_steers_greedy_output(client: openai.OpenAI, stack: Stack) -> None:
    answer = client.completions.create(model=stack.model, prompt="Hello", max_tokens=4, temperature=0,
                                       logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    expected = httpx.post(f"{stack.base_url}/detokenize", json={"model": stack.model, "tokens": [42] * 4},
                          headers={"Authorization": f"Bearer {client.api_key}"}, timeout=30)
    assert answer.choices[0].text == expected.json()["prompt"]


def _run_batch(client: openai.OpenAI, bodies: list[dict[str, Any]]) -> Any:
    lines = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n" for i, body in enumerate(bodies))
    uploaded = client.files.create(file=("lines.jsonl", lines.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    deadline = time.monotonic() + 240
    while batch.status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, "the batch did not end in time"
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    return batch


def _results(client: openai.OpenAI, batch: Any) -> dict[str, Any]:
    text = client.files.content(batch.output_file_id).text
    return {row["custom_id"]: row["response"]["body"] for row in map(json.loads, text.splitlines()) if row}


def test_batch_lines_take_constraints_tools_and_logit_bias(client: openai.OpenAI, stack: Stack) -> None:
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    base = {"model": stack.model, "max_tokens": 4}
    batch = _run_batch(client, [
        {**base, "messages": turns, "tools": [WEATHER, CLOCK]},
        {**base, "messages": ASK, "logit_bias": {"7": 3}},
        {**base, "messages": ASK, "response_format": {"type": "json_object"}},
        {**base, "messages": ASK, "guided_choice": ["yes", "no"]},
    ])
    assert batch.status == "completed" and batch.request_counts.completed == 4
    refused_batch = _run_batch(client, [{**base, "messages": ASK, "n": 2}])
    assert refused_batch.status == "failed"
    assert refused_batch.errors.data[0].param == "n"


@needs_grammar
def test_batch_line_with_a_forced_tool_call(client: openai.OpenAI, stack: Stack) -> None:
    batch = _run_batch(client, [{"model": stack.model, "max_tokens": 200, "messages": ASK, "tools": [WEATHER, CLOCK],
                                 "tool_choice": "required", "parallel_tool_calls": False}])
    body = _results(client, batch)["line-0"]
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    for call in choice["message"]["tool_calls"]:
        check_call(call["function"]["name"], call["function"]["arguments"], "required")
