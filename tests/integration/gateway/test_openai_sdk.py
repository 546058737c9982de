"""The official `openai` SDK, unmodified, against the real gateway over HTTP (demo model)."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "Tell me a story."}]


def sdk(gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_models_and_chat(gateway) -> None:
    _, key = gateway.tenant(priority_ceiling="interactive", default_class="standard")
    client = sdk(gateway, key)
    assert [m.id for m in client.models.list()] == ["demo"]

    answer = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=6, temperature=0)
    assert answer.object == "chat.completion" and answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.completion_tokens == 6 or answer.choices[0].finish_reason == "stop"
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert answer.service_tier == "default"  # tenant default class: standard

    again = client.chat.completions.create(
        model="demo", messages=CHAT, max_completion_tokens=6, temperature=0, service_tier="priority"
    )
    assert again.choices[0].message.content == answer.choices[0].message.content  # greedy is deterministic
    assert again.service_tier == "priority"


def test_chat_streaming_with_usage(gateway) -> None:
    _, key = gateway.tenant()
    client = sdk(gateway, key)
    full = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=8, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="demo",
            messages=CHAT,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        full.choices[0].finish_reason
    ]
    plain = list(client.chat.completions.create(model="demo", messages=CHAT, max_tokens=4, stream=True))
    assert all(c.usage is None for c in plain)


def test_completions_stream_and_not(gateway) -> None:
    _, key = gateway.tenant()
    client = sdk(gateway, key)
    whole = client.completions.create(
        model="demo", prompt="Once upon a time", max_tokens=7, temperature=0, logprobs=2
    )
    assert whole.object == "text_completion" and whole.usage.completion_tokens <= 7
    assert len(whole.choices[0].logprobs.tokens) == whole.usage.completion_tokens
    assert all(len(top) <= 2 for top in whole.choices[0].logprobs.top_logprobs)
    streamed = list(
        client.completions.create(
            model="demo", prompt="Once upon a time", max_tokens=7, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    by_ids = client.completions.create(model="demo", prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert by_ids.usage.prompt_tokens == 4
    chat_lp = client.chat.completions.create(
        model="demo", messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=3
    )
    assert len(chat_lp.choices[0].logprobs.content) == chat_lp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 for t in chat_lp.choices[0].logprobs.content)


def test_sdk_error_classes(gateway) -> None:
    _, key = gateway.tenant(allowed_models=["demo"], quotas={"requests_per_minute": 1})
    _, other_key = gateway.tenant(allowed_models=["some-other-model"])
    with pytest.raises(openai.AuthenticationError):
        sdk(gateway, "sk-slc-not-a-real-key").chat.completions.create(model="demo", messages=CHAT)
    client = sdk(gateway, key)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="demo", messages=CHAT, temperature=5)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=CHAT, n=9)  # above gateway.max_n
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=CHAT)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.PermissionDeniedError):
        sdk(gateway, other_key).chat.completions.create(model="demo", messages=CHAT, max_tokens=2)
    client.chat.completions.create(model="demo", messages=CHAT, max_tokens=2)
    with pytest.raises(openai.RateLimitError) as limited:
        client.chat.completions.create(model="demo", messages=CHAT, max_tokens=2)
    assert 1 <= int(limited.value.response.headers["retry-after"]) <= 60
    assert limited.value.response.headers["x-ratelimit-limit-requests"] == "1"
