"""Issue #31's acceptance on the real model (SmolLM2-135M-Instruct) through the official `openai`
SDK against a gateway over HTTP, under each scheduling policy with speculation on and off:

- `chat.completions.parse` with a nested pydantic model (lists of objects, enums, optional fields)
  returns a parsed object for each of 20 sampled requests, 10 whole and 10 streamed (the SDK's
  stream helper); the schema bounds strings and arrays so an answer fits in max_tokens;
- `tool_choice: "required"` and a named function give calls whose arguments validate against the
  tool's schema, whole and assembled by the SDK's stream helper (the same calls); a conversation
  with the tool's result goes on.

All requests of a configuration (36) are sent at once, so the engine runs orders and tool calls,
whole and streamed, in the same steps (one batch, where each check had its own: the module's
time is mostly the longest answer's decode, paid once per configuration).
"""

from __future__ import annotations

import concurrent.futures
import enum
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import BaseModel, Field
from structured_cases import CLOCK, WEATHER, check_call

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(3600)]

SAMPLES = 10  # whole, and as many streamed: 20 sampled requests per configuration
CONFIGS = [(policy, speculation) for policy in ("chunked", "prefill_first", "static") for speculation in (0, 4)]
ENGINE = {"max_num_seqs": 48, "kv_cache_bytes": 384 * 2**20, "max_num_batched_tokens": 512}
ORDER_ASK = [{"role": "system", "content": "Answer with the order as JSON."},
             {"role": "user", "content": "Ada Lovelace orders two green widgets and one red gear, as a gift."}]
TOOL_ASK = [{"role": "user", "content": "What is the weather in Oslo right now?"}]
TOOL_CHOICES: dict[str, Any] = {"required": "required", "named": {"type": "function", "function": {"name": "get_time"}}}
TOOL_SEEDS = range(4)  # whole, and as many streamed, per tool choice


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Line(BaseModel):
    product: str = Field(max_length=12)
    color: Color
    quantity: int = Field(ge=1, le=20)
    gift: bool | None = None


class Order(BaseModel):
    customer: str = Field(max_length=12)
    lines: list[Line] = Field(min_length=1, max_length=2)
    note: str | None = Field(default=None, max_length=16)


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{p}-spec{s}" for p, s in CONFIGS])
def client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path,
           open_gateway: Any) -> Iterator[openai.OpenAI]:
    policy, speculation = request.param
    options = {**ENGINE, "policy": policy, "num_speculative_tokens": speculation}
    # No request deadline to speak of: on a loaded 2-core machine 40 constrained requests under
    # `static` batching took over the default 600 s; the test is about the answers, not the time.
    # The engine gets every request of the configuration at once: with the dispatcher's default
    # (2 queued at a worker) a `static` batch held 2-3 of them and ran a dozen batches in a row.
    with open_gateway(tmp_path_factory.mktemp("real-structured"), {"smollm2": real_model_dir}, options,
                      gateway_options={"request_timeout_s": 7200.0},
                      dispatch_options={"max_worker_waiting": ENGINE["max_num_seqs"]}) as gateway:
        _, key = gateway.tenant(priority_ceiling="interactive", default_class="standard")
        yield openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0, timeout=7200)


def _all_at_once(calls: dict[str, list[Callable[[], Any]]]) -> dict[str, list[Any]]:
    """Each group's calls, all groups at once; their answers by group, in order."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=sum(map(len, calls.values()))) as pool:
        futures = {group: [pool.submit(call) for call in group_calls] for group, group_calls in calls.items()}
        return {group: [f.result() for f in group_futures] for group, group_futures in futures.items()}


def _streamed(client: openai.OpenAI, seed: int, ask: dict[str, Any]) -> Any:
    with client.chat.completions.stream(seed=seed, **ask) as events:
        return events.get_final_completion()


def _parse_ask() -> dict[str, Any]:
    return dict(model="smollm2", messages=ORDER_ASK, response_format=Order, max_tokens=160, temperature=1.0)


def _tool_ask(tool_choice: Any) -> dict[str, Any]:
    return dict(model="smollm2", messages=TOOL_ASK, tools=[WEATHER, CLOCK], tool_choice=tool_choice, max_tokens=120,
                parallel_tool_calls=False)


@pytest.fixture(scope="module")
def answers(client: openai.OpenAI) -> dict[str, list[Any]]:
    """Every request of the configuration, sent at once (parsed orders, then each tool choice's
    calls), so JSON-schema and tool grammars are applied in the same steps; whole answers first,
    then as many streamed with the same seeds."""
    parse = _parse_ask()
    calls: dict[str, list[Callable[[], Any]]] = {
        "parse": [lambda s=s: client.chat.completions.parse(seed=s, **parse) for s in range(SAMPLES)] +
                 [lambda s=s: _streamed(client, s, parse) for s in range(SAMPLES)]}
    for name, tool_choice in TOOL_CHOICES.items():
        ask = _tool_ask(tool_choice)
        calls[name] = ([lambda s=s, ask=ask: client.chat.completions.create(seed=s, **ask) for s in TOOL_SEEDS] +
                       [lambda s=s, ask=ask: _streamed(client, s, ask) for s in TOOL_SEEDS])
    return _all_at_once(calls)


def test_parse_returns_a_nested_object_for_every_sampled_request(answers: dict[str, list[Any]]) -> None:
    completions = answers["parse"]
    for completion in completions:
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Order), choice.message.content
    assert len({c.choices[0].message.content for c in completions[:SAMPLES]}) > 1  # sampled, not one answer


@pytest.mark.parametrize("tool_choice", list(TOOL_CHOICES))
def test_forced_tool_calls_validate_whole_and_streamed(client: openai.OpenAI, answers: dict[str, list[Any]],
                                                      tool_choice: str) -> None:
    results = answers[tool_choice]
    wholes, streams = results[:len(TOOL_SEEDS)], results[len(TOOL_SEEDS):]
    for answer, final in zip(wholes, streams, strict=True):
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message.content
        for call in choice.message.tool_calls:
            check_call(call.function.name, call.function.arguments, TOOL_CHOICES[tool_choice])
        assert final.choices[0].finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls or []] == \
            [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]  # seeded: the same calls
    # The conversation goes on with the first call's result (greedy: the model answers in words).
    call = wholes[0].choices[0].message.tool_calls[0]
    turns = [*TOOL_ASK,
             {"role": "assistant", "content": None, "tool_calls": [{
                 "id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
             {"role": "tool", "tool_call_id": call.id, "content": "12 C and rain"}]
    answer = client.chat.completions.create(model="smollm2", messages=turns, tools=[WEATHER, CLOCK], max_tokens=24,
                                            temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls
    assert answer.usage.prompt_tokens > wholes[0].usage.prompt_tokens  # the call and its result are in the prompt
