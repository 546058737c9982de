"""Commonly sent OpenAI fields, end to end with the official `openai` SDK against `sluice serve`
(a real gateway process, the embedded broker, a real worker process, the demo model).

Every field is either honoured (the answer shows its effect) or refused with a 400 whose `param`
names it. Also vLLM's `/tokenize` and `/detokenize`, and `usage.prompt_tokens_details`.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from sluice_lab.experiments.stack import Stack, start_stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CONFIG = Path(__file__).resolve().parents[3] / "config"
CHAT = [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}]
# Long enough for two full KV blocks (block size 16), so a repeat hits the prefix cache.
LONG_CHAT = [{"role": "user", "content": "Summarise the following shared instructions for me. " * 6}]


@pytest.fixture(scope="module")
def stack(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with start_stack(CONFIG, tmp_path_factory.mktemp("compat"), demo_model_dir) as running:
        yield running


@pytest.fixture(scope="module")
def key(stack: Stack) -> str:
    return stack.create_tenant_key(f"compat-{secrets.token_hex(3)}", ceiling="interactive", default_class="standard")


@pytest.fixture(scope="module")
def client(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


def refused(call: Any, param: str) -> str:
    """Runs an SDK call that must be refused with a 400 naming `param`; returns the message."""
    with pytest.raises(openai.BadRequestError) as exc:
        call()
    assert exc.value.status_code == 400
    assert exc.value.body["param"] == param, exc.value.body
    assert param in exc.value.body["message"].lower()
    return str(exc.value.body["message"])


def test_cached_prompt_tokens_are_reported(client: openai.OpenAI, stack: Stack) -> None:
    first = client.chat.completions.create(model=stack.model, messages=LONG_CHAT, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens >= 32
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # a fresh tenant's cache is empty
    again = client.chat.completions.create(model=stack.model, messages=LONG_CHAT, max_tokens=2, temperature=0)
    assert 16 <= again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    chunks = list(client.chat.completions.create(
        model=stack.model, messages=LONG_CHAT, max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16
    text = client.completions.create(model=stack.model, prompt="x " * 40, max_tokens=1, temperature=0)
    assert text.usage.prompt_tokens_details.cached_tokens == 0


def test_n_logit_bias_and_user(client: openai.OpenAI, stack: Stack) -> None:
    ok = client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=2, n=1, logit_bias={},
                                        user="end-user-42")
    assert len(ok.choices) == 1
    refused(lambda: client.chat.completions.create(model=stack.model, messages=CHAT, n=9), "n")  # max_n: 8
    refused(lambda: client.completions.create(model=stack.model, prompt="Hi", n=2, stream=True,
                                              extra_headers={"X-Sluice-Resumable": "1"}), "n")  # not resumable
    biased = client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=2, logit_bias={"5": 10})
    assert biased.choices[0].finish_reason in ("stop", "length")
    refused(lambda: client.completions.create(model=stack.model, prompt="Hi", logit_bias={"10000000": -100}),
            "logit_bias")  # not a token id of the model


def test_seed_makes_sampling_repeatable(client: openai.OpenAI, stack: Stack) -> None:
    def sample(seed: int) -> str | None:
        answer = client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=12,
                                                temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
        return answer.choices[0].message.content

    assert sample(7) == sample(7)
    texts = {client.completions.create(model=stack.model, prompt="Once", max_tokens=12, temperature=1.0,
                                       seed=11).choices[0].text for _ in range(2)}
    assert len(texts) == 1


def test_response_format_and_tools(client: openai.OpenAI, stack: Stack) -> None:
    answer = client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=2,
                                            response_format={"type": "text"}, tool_choice="none",
                                            parallel_tool_calls=False)  # no tools: nothing to parallelise
    assert answer.choices[0].message.role == "assistant"
    refused(lambda: client.chat.completions.create(model=stack.model, messages=CHAT,
                                                   response_format={"type": "yaml"}), "response_format")
    refused(lambda: client.chat.completions.create(model=stack.model, messages=CHAT, tool_choice="required"),
            "tool_choice")  # no tools to call
    refused(lambda: client.chat.completions.create(model=stack.model, messages=CHAT,
                                                   functions=[{"name": "f", "parameters": {}}]), "functions")


def test_stop_as_string_or_list(client: openai.OpenAI, stack: Stack) -> None:
    def chat(**extra: Any) -> Any:
        return client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=24, temperature=0,
                                              extra_body={"ignore_eos": True}, **extra).choices[0]

    full = chat().message.content
    assert full and len(full) > 8
    stop = full[4:7]
    before = full[: full.index(stop)]
    for value in (stop, ["never-in-the-output-\u2603", stop]):
        cut = chat(stop=value)
        assert cut.message.content == before and cut.finish_reason == "stop"
    whole = client.completions.create(model=stack.model, prompt="Once upon a time", max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    stop = whole[3:6]
    cut = client.completions.create(model=stack.model, prompt="Once upon a time", max_tokens=24, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == whole[: whole.index(stop)] and cut.finish_reason == "stop"


def test_max_completion_tokens_wins_over_max_tokens(client: openai.OpenAI, stack: Stack) -> None:
    def tokens(**limits: int) -> int:
        answer = client.chat.completions.create(model=stack.model, messages=CHAT, temperature=0,
                                                extra_body={"ignore_eos": True}, **limits)  # type: ignore[call-overload]
        return int(answer.usage.completion_tokens)

    assert tokens(max_tokens=5) == 5
    assert tokens(max_completion_tokens=3) == 3
    assert tokens(max_completion_tokens=3, max_tokens=10) == 3
    refused(lambda: client.chat.completions.create(model=stack.model, messages=CHAT, max_completion_tokens=0),
            "max_completion_tokens")


def test_stream_options_include_usage_in_both_apis(client: openai.OpenAI, stack: Stack) -> None:
    chat = list(client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=4, stream=True,
                                               stream_options={"include_usage": True}))
    assert all(c.usage is None for c in chat[:-1]) and chat[-1].choices == []
    assert chat[-1].usage.completion_tokens >= 1
    text = list(client.completions.create(model=stack.model, prompt="Once", max_tokens=4, stream=True,
                                          stream_options={"include_usage": True}))
    assert all(c.usage is None for c in text[:-1])
    assert text[-1].usage.total_tokens == text[-1].usage.prompt_tokens + text[-1].usage.completion_tokens
    plain = list(client.completions.create(model=stack.model, prompt="Once", max_tokens=4, stream=True))
    assert all(c.usage is None for c in plain)
    refused(lambda: client.chat.completions.create(model=stack.model, messages=CHAT,
                                                   stream_options={"include_usage": True}), "stream_options")


def test_logprobs_in_both_apis(client: openai.OpenAI, stack: Stack) -> None:
    chat = client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=4, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy: the best
    text = client.completions.create(model=stack.model, prompt="Once", max_tokens=4, temperature=0, logprobs=2)
    logprobs = text.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == text.usage.completion_tokens
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    refused(lambda: client.chat.completions.create(model=stack.model, messages=CHAT, logprobs=True,
                                                   top_logprobs=21), "top_logprobs")
    refused(lambda: client.chat.completions.create(model=stack.model, messages=CHAT, top_logprobs=2),
            "top_logprobs")
    refused(lambda: client.completions.create(model=stack.model, prompt="Once", logprobs=21), "logprobs")


def test_tokenize_and_detokenize(client: openai.OpenAI, stack: Stack, key: str) -> None:
    auth = {"authorization": f"Bearer {key}"}

    def post(path: str, body: dict[str, Any], headers: dict[str, str] = auth) -> httpx.Response:
        return httpx.post(stack.base_url + path, json=body, headers=headers, timeout=60)

    prompt = "Once upon a time"
    answer = post("/tokenize", {"model": stack.model, "prompt": prompt})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    completion = client.completions.create(model=stack.model, prompt=prompt, max_tokens=1)
    assert body["count"] == len(body["tokens"]) == completion.usage.prompt_tokens
    assert body["max_model_len"] == next(m for m in client.models.list().data if m.id == stack.model).max_model_len
    assert body["token_strs"] is None
    chat = post("/tokenize", {"model": stack.model, "messages": CHAT}).json()
    chat_answer = client.chat.completions.create(model=stack.model, messages=CHAT, max_tokens=1)
    assert chat["count"] == chat_answer.usage.prompt_tokens
    without_prompt = post("/tokenize", {"model": stack.model, "messages": CHAT, "add_generation_prompt": False})
    assert without_prompt.json()["count"] < chat["count"]
    plain = post("/tokenize", {"prompt": prompt, "add_special_tokens": False, "return_token_strs": True}).json()
    assert len(plain["token_strs"]) == plain["count"]  # model omitted: the tenant's one model
    back = post("/detokenize", {"model": stack.model, "tokens": plain["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": prompt}

    assert post("/tokenize", {"prompt": prompt}, headers={}).status_code == 401
    assert post("/detokenize", {"tokens": [1]}, headers={"authorization": "Bearer sk-slc-wrong"}).status_code == 401
    missing = post("/tokenize", {"model": "nope", "prompt": prompt})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    for bad, param in (({"model": stack.model, "prompt": prompt, "messages": CHAT}, "prompt"),
                       ({"model": stack.model}, "prompt"),
                       ({"model": stack.model, "messages": CHAT, "continue_final_message": True},
                        "continue_final_message"),
                       ({"model": stack.model, "messages": CHAT, "add_special_tokens": True}, "add_special_tokens")):
        refusal = post("/tokenize", bad)
        assert refusal.status_code == 400 and refusal.json()["error"]["param"] == param, refusal.text
    out_of_vocab = post("/detokenize", {"model": stack.model, "tokens": [10**9]})
    assert out_of_vocab.status_code == 400 and out_of_vocab.json()["error"]["param"] == "tokens"

    tenant = stack.admin("POST", "/tenants", {"name": f"narrow-{secrets.token_hex(3)}",
                                              "allowed_models": ["some-other-model"]})
    other = stack.admin("POST", f"/tenants/{tenant['id']}/keys", {"name": "t"})["key"]
    other_auth = {"authorization": f"Bearer {other}"}
    forbidden = post("/tokenize", {"model": stack.model, "prompt": prompt}, headers=other_auth)
    assert forbidden.status_code == 403 and forbidden.json()["error"]["param"] == "model"
    assert post("/detokenize", {"tokens": [1]}, headers=other_auth).status_code == 404  # no model it may use
