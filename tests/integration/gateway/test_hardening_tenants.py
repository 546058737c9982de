"""Issue #36, "a tenant must not be able to slow the others": /tokenize is held to the /v1 limits
and metered (item 1); the quotas are checked before a large prompt is tokenized, a large prompt
refused once tokenized still counts, and the tokenizer threads are shared fairly (item 2).

Real gateway over HTTP (uvicorn), the demo model (context 4096) on the in-process engine, SQLite;
and Redis for the quota counters where `$SLUICE_TEST_REDIS_URL` is set.
"""

from __future__ import annotations

import asyncio
import random
import string
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.integration

MAX_PROMPT_CHARS = 200_000


@pytest.fixture(scope="module", params=["in-process", "redis"])
def shared_mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def gateway_options() -> dict[str, Any]:
    return {"max_body_bytes": 4 * 2**20, "max_prompt_chars": MAX_PROMPT_CHARS}


def _words(chars: int, seed: int = 0) -> str:
    """Varied text (a repeated word would tokenize into few long tokens)."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < chars:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


def test_tokenize_has_the_v1_size_limits(gateway: Any) -> None:
    _, key = gateway.tenant()
    with gateway.client(key) as client:
        over = client.post("/tokenize", json={"model": "demo", "prompt": "a" * (MAX_PROMPT_CHARS + 1)})
        assert over.status_code == 400, over.text
        assert over.json()["error"]["param"] == "prompt"
        assert over.json()["error"]["code"] == "string_above_max_length"
        chat = client.post("/tokenize", json={"model": "demo", "messages": [
            {"role": "user", "content": "a" * (MAX_PROMPT_CHARS // 2 + 1)}] * 2})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages", chat.text
        many = client.post("/tokenize", json={"model": "demo", "messages": [{"role": "user", "content": "x"}] * 2049})
        assert many.status_code == 400 and many.json()["error"]["code"] == "array_above_max_length", many.text
        long_ids = client.post("/detokenize", json={"model": "demo", "tokens": [5] * 4097})
        assert long_ids.status_code == 400 and long_ids.json()["error"]["param"] == "tokens", long_ids.text
        fine = client.post("/tokenize", json={"model": "demo", "prompt": _words(MAX_PROMPT_CHARS)})
        assert fine.status_code == 200 and fine.json()["count"] > 4096, fine.text


def test_tokenize_counts_against_requests_per_minute(gateway: Any) -> None:
    _, key = gateway.tenant(quotas={"requests_per_minute": 2, "tokens_per_day": 1})
    with gateway.client(key) as client:
        for _ in range(2):
            assert client.post("/tokenize", json={"model": "demo", "prompt": "hello"}).status_code == 200
        third = client.post("/tokenize", json={"model": "demo", "prompt": "hello"})
        assert third.status_code == 429, third.text
        assert third.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(third.headers["retry-after"]) >= 1
        assert client.post("/detokenize", json={"model": "demo", "tokens": [5]}).status_code == 429


async def test_a_large_tokenize_leaves_the_event_loop_free(gateway: Any) -> None:
    """/health is answered while a large /tokenize is still being tokenized (an ordering, not a time)."""
    _, key = gateway.tenant()
    prompt = _words(MAX_PROMPT_CHARS, seed=1)
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=120,
                                 headers={"authorization": f"Bearer {key}"}) as client:
        big = [asyncio.ensure_future(client.post("/tokenize", json={"model": "demo", "prompt": prompt[:-1] + str(i)}))
               for i in range(4)]
        await asyncio.sleep(0.05)
        health = await client.get("/health")
        assert health.status_code == 200
        # Tokenized on the event loop, the first large prompt was answered before /health was read.
        assert not any(task.done() for task in big)
        assert all(r.status_code == 200 for r in await asyncio.gather(*big))


def test_a_refused_large_prompt_still_counts_and_the_rest_get_429(gateway: Any) -> None:
    """A tenant limited to 1 request/min: its first large prompt is tokenized and found over the
    context (400) and counts; the next ones are refused with 429 before any tokenizing."""
    _, key = gateway.tenant(quotas={"requests_per_minute": 1})
    too_long = _words(60_000, seed=2)  # ~15,000 tokens: over the demo model's 4096, found by tokenizing
    with gateway.client(key) as client:
        first = client.post("/v1/completions", json={"model": "demo", "prompt": too_long, "max_tokens": 1})
        assert first.status_code == 400 and first.json()["error"]["code"] == "context_length_exceeded", first.text
        for _ in range(3):
            again = client.post("/v1/completions", json={"model": "demo", "prompt": too_long, "max_tokens": 1})
            assert again.status_code == 429, again.text
            assert again.json()["error"]["code"] == "rate_limit_exceeded"
        # A prompt certainly over the context (by its characters alone) is refused without tokenizing.
    _, other = gateway.tenant()
    with gateway.client(other) as client:
        huge = client.post("/v1/chat/completions", json={"model": "demo", "max_tokens": 1, "messages": [
            {"role": "user", "content": "y" * MAX_PROMPT_CHARS}]})
        assert huge.status_code == 400 and huge.json()["error"]["param"] == "messages", huge.text
        assert "certainly" in huge.json()["error"]["message"]


async def test_tokenizer_threads_are_shared_fairly(gateway: Any) -> None:
    """One tenant floods large prompts; another tenant's large prompt is tokenized after at most
    one of the flooder's, not after all of them (an ordering of completions, not a time)."""
    _, flooder = gateway.tenant()
    _, victim = gateway.tenant()
    done: list[str] = []

    async def post(client: httpx.AsyncClient, who: str, seed: int) -> None:
        answer = await client.post("/tokenize", json={"model": "demo", "prompt": _words(MAX_PROMPT_CHARS, seed)})
        assert answer.status_code == 200, answer.text
        done.append(who)

    async with (httpx.AsyncClient(base_url=gateway.base_url, timeout=300,
                                  headers={"authorization": f"Bearer {flooder}"}) as flood,
                httpx.AsyncClient(base_url=gateway.base_url, timeout=300,
                                  headers={"authorization": f"Bearer {victim}"}) as calm):
        floods = [asyncio.ensure_future(post(flood, "flooder", 10 + i)) for i in range(8)]
        await asyncio.sleep(0.2)
        await post(calm, "victim", 99)
        await asyncio.gather(*floods)
    assert done.index("victim") <= 3, done  # with one shared queue it came after all eight
