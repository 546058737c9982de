"""Garbage in → a 4xx OpenAI error object, never a 500, while another client keeps being served."""

from __future__ import annotations

import threading

import httpx
import pytest

pytestmark = pytest.mark.integration

CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

BAD_BODIES: list[tuple[bytes, int]] = [
    (b"{broken", 400),
    (b"", 400),
    (b"[]", 400),
    (b"null", 400),
    (b'"a string"', 400),
    (b'{"model": "demo"}', 400),  # messages missing
    (b'{"model": 5, "messages": []}', 400),
    (b'{"model": "demo", "messages": "hi"}', 400),
    (b'{"model": "demo", "messages": [{"role": "user", "content": 5}]}', 400),
    (b'{"model": "demo", "messages": [{"content": "hi"}]}', 400),
    (b'{"model": "demo", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400),
    (b'{"model": "demo", "messages": []}', 400),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}', 400),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}', 400),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}', 400),
    (
        b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], '
        b'"max_tokens": 99999999999999999999999}',
        400,
    ),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}', 400),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "top_p": -0.1}', 400),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}', 400),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "3"}', 400),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "stream": 0}', 400),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}', 400),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "seed": 1e30}', 400),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "stop": 5}', 400),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "stop": [""]}', 400),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "service_tier": "gold"}', 400),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "n": 9}', 400),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}', 400),
    (b'{"model": "unknown-model", "messages": [{"role": "user", "content": "hi"}]}', 404),
    (b'{"model": "demo", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),  # invalid UTF-8
]


def _is_error_object(response: httpx.Response) -> bool:
    error = response.json().get("error")
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)


def test_garbage_never_500_while_others_are_served(gateway) -> None:
    _, key = gateway.tenant()
    _, steady_key = gateway.tenant()
    served: list[int] = []
    stop = threading.Event()

    def steady() -> None:
        with gateway.client(steady_key) as client:
            while not stop.is_set():
                served.append(client.post("/v1/chat/completions", json=CHAT).status_code)

    worker = threading.Thread(target=steady)
    worker.start()
    try:
        with gateway.client(key) as client:
            for raw, expected in BAD_BODIES:
                answer = client.post(
                    "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
                )
                assert answer.status_code == expected, (raw, answer.text)
                assert _is_error_object(answer), (raw, answer.text)
            long_stop = {**CHAT, "stop": [f"s{i}" for i in range(10_000)]}
            assert client.post("/v1/chat/completions", json=long_stop).status_code == 400
            huge = client.post(
                "/v1/chat/completions",
                content=b'{"model": "demo", "x": "' + b"a" * 400_000 + b'"}',
                headers={"content-type": "application/json"},
            )
            assert huge.status_code == 413 and _is_error_object(huge)
            long_prompt = {**CHAT, "messages": [{"role": "user", "content": "word " * 5000}]}
            too_long = client.post("/v1/chat/completions", json=long_prompt)
            assert (
                too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
            )
            listed = client.post("/v1/completions", json={"model": "demo", "prompt": ["a", "b"]})
            assert listed.status_code == 400 and "not supported" in listed.json()["error"]["message"]
            bad_ids = client.post("/v1/completions", json={"model": "demo", "prompt": [1, -5]})
            assert bad_ids.status_code == 400
            unknown_fields = client.post(
                "/v1/chat/completions",
                json={**CHAT, "tools": None, "foo": {"bar": 1}, "parallel_tool_calls": False},
            )
            assert unknown_fields.status_code == 200
            for headers in (
                {"authorization": b"Bearer \xff\xfe"},
                {"authorization": "Bearer"},
                {"authorization": "Bearer " + "x" * 8000},
                {"content-length": "abc"},
            ):
                with httpx.Client(base_url=gateway.base_url) as raw_client:
                    try:
                        odd = raw_client.post("/v1/chat/completions", json=CHAT, headers=headers)
                    except httpx.HTTPError:
                        continue  # the client refused to send it; nothing reached the server
                    assert 400 <= odd.status_code < 500, (headers, odd.text)
            assert client.get("/v1/chat/completions").status_code == 405
            assert _is_error_object(client.get("/v1/nothing-here"))
            assert client.get("/v1/nothing-here").status_code == 404
            assert client.post(
                "/v1/chat/completions", json=CHAT, headers={"content-type": "text/plain"}
            ).status_code in (200, 400, 415)
    finally:
        stop.set()
        worker.join()
    assert served and set(served) == {200}
