"""Logprobs through a kind "vllm" upstream (issue #35): relayed in the OpenAI shape, streamed and not,
and never trusted blindly: a chunk whose logprobs break the contract (gateway/dispatch/links/
upstream_chunks.py) fails its request alone with `generation_failed`.

The upstream is a fake in a thread of the test, answering in vLLM's completions shape under
`return_tokens_as_token_ids`; its faults (a positive logprob, a token named by another id, tokens
without logprobs, more alternatives than asked) are ones a real server cannot be made to send. The
well-formed case is also checked against a real vLLM server in test_upstream_vllm.py, where the
machine has one. Its behaviour is chosen by the request's max_tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest

from .test_serve import Serve
from .test_upstream_hardening import chunk, front_of_fake, sse_events

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GOOD, POSITIVE, WRONG_ID, MISSING, TOO_MANY_ALTERNATIVES = 4, 41, 42, 43, 44
TOKEN_IDS = [5, 6, 7, 8]
TOP = 2


def _logprob(position: int) -> float:
    return -0.25 * (position + 1)


def _logprobs(scenario: int, asked: int, position: int, token_id: int) -> dict[str, Any] | None:
    """vLLM's completions logprobs of one token: the chosen one first, then `asked` alternatives."""
    if scenario == MISSING:
        return None
    chosen = 0.5 if scenario == POSITIVE else _logprob(position)
    named = token_id + 1 if scenario == WRONG_ID else token_id
    top = {f"token_id:{named}": chosen}
    for rank in range(asked + (3 if scenario == TOO_MANY_ALTERNATIVES else 0)):
        top[f"token_id:{100 + rank}"] = _logprob(position) - 0.5 - rank  # every alternative below the chosen
    return {"tokens": [f"token_id:{named}"], "token_logprobs": [chosen], "top_logprobs": [top], "text_offset": [0]}


class _VllmLike(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # the link's probes: vLLM's gauges, its model list
        if self.path.endswith("/metrics"):
            self._send(200, "text/plain", b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n")
        else:
            self._send(200, "application/json", json.dumps({"object": "list", "data": [
                {"id": "demo", "object": "model", "max_model_len": 4096}]}).encode())

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if request.get("return_tokens_as_token_ids") is not True or not isinstance(request.get("logprobs"), int):
            message = json.dumps({"error": {"message": "logprobs were not asked for by token id"}}).encode()
            self._send(422, "application/json", message)
            return
        scenario, asked = request["max_tokens"], request["logprobs"]
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes
        for position, token_id in enumerate(TOKEN_IDS):
            finish = "length" if position == len(TOKEN_IDS) - 1 else None
            self.wfile.write(chunk("t", [token_id], finish, logprobs=_logprobs(scenario, asked, position, token_id)))
        usage = {"prompt_tokens": len(request["prompt"]), "completion_tokens": len(TOKEN_IDS)}
        self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path,
          bootstrap_servers: str) -> Iterator[tuple[Serve, str]]:
    yield from front_of_fake(_VllmLike, tmp_path_factory.mktemp("logprobs"), demo_model_dir, bootstrap_servers,
                             kind="vllm")


def _post(front: tuple[Serve, str], path: str, body: dict[str, Any]) -> httpx.Response:
    serve, key = front
    return httpx.post(serve.base + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


def _token_texts(front: tuple[Serve, str]) -> list[str]:
    """Each relayed token's text as the gateway's tokenizer writes it."""
    return [_post(front, "/detokenize", {"model": "demo", "tokens": [token_id]}).json()["prompt"]
            for token_id in TOKEN_IDS]


CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": TOP}
COMPLETION = {"model": "demo", "prompt": "hi", "logprobs": TOP}


def test_vllm_logprobs_reach_the_client_in_the_openai_shape(front: tuple[Serve, str]) -> None:
    texts = _token_texts(front)
    values = [_logprob(position) for position in range(len(TOKEN_IDS))]

    chat = _post(front, "/v1/chat/completions", {**CHAT, "max_tokens": GOOD})
    assert chat.status_code == 200, chat.text
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == texts
    assert [entry["logprob"] for entry in content] == values
    assert [entry["bytes"] for entry in content] == [list(text.encode()) for text in texts]
    # The top TOP by value: the chosen token (vLLM lists it first) and the best alternative.
    assert [[top["logprob"] for top in entry["top_logprobs"]] for entry in content] == [[v, v - 0.5] for v in values]
    assert [entry["top_logprobs"][0]["token"] for entry in content] == texts
    events = sse_events(front, "/v1/chat/completions", {**CHAT, "max_tokens": GOOD})
    streamed = [entry for event in events if isinstance(event, dict) and event.get("choices")
                for entry in (event["choices"][0].get("logprobs") or {}).get("content") or []]
    assert streamed == content

    completion = _post(front, "/v1/completions", {**COMPLETION, "max_tokens": GOOD})
    assert completion.status_code == 200, completion.text
    logprobs = completion.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == texts and logprobs["token_logprobs"] == values
    assert [len(top) for top in logprobs["top_logprobs"]] == [TOP] * len(TOKEN_IDS)
    assert logprobs["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    events = sse_events(front, "/v1/completions", {**COMPLETION, "max_tokens": GOOD})
    pieces = [event["choices"][0]["logprobs"] for event in events
              if isinstance(event, dict) and event.get("choices") and event["choices"][0].get("logprobs")]
    assert [v for piece in pieces for v in piece["token_logprobs"]] == values
    assert [o for piece in pieces for o in piece["text_offset"]] == logprobs["text_offset"]


@pytest.mark.parametrize("scenario", [POSITIVE, WRONG_ID, MISSING, TOO_MANY_ALTERNATIVES])
def test_malformed_logprobs_fail_their_request_alone(front: tuple[Serve, str], scenario: int) -> None:
    whole = _post(front, "/v1/chat/completions", {**CHAT, "max_tokens": scenario})
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "generation_failed", whole.text
    events = sse_events(front, "/v1/completions", {**COMPLETION, "max_tokens": scenario})
    assert isinstance(events[-1], dict) and events[-1]["error"]["code"] == "generation_failed", events[-3:]
    assert not any(isinstance(e, dict) and e.get("choices") and e["choices"][0].get("logprobs") for e in events)
    again = _post(front, "/v1/completions", {**COMPLETION, "max_tokens": GOOD})
    assert again.status_code == 200 and len(again.json()["choices"][0]["logprobs"]["tokens"]) == len(TOKEN_IDS)
