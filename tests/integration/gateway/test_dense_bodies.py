"""A dense body (one that may hold more JSON values than `body_decode.DENSE_VALUES`) is judged in the
helper process; its 400 is the same error object, with the same `param` and `code`, as the one
for the same body decoded inline, and a dense body that is valid is served as usual."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluice.gateway.edge.body_decode import DENSE_VALUES, is_dense

pytestmark = pytest.mark.integration

CHAT = {"model": "demo", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
PADDING = [0] * (DENSE_VALUES + 1_000)  # an unknown field: ignored, so it changes nothing but density
DEEP = "deep-json"  # replaced by 2,000 nested arrays when encoded (json.dumps cannot nest that deep)

BAD_CHATS: list[dict[str, Any]] = [
    {**CHAT, "max_tokens": 0},
    {**CHAT, "top_k": 2**63},
    {**CHAT, "temperature": "0.5"},
    {**CHAT, "stop": ["s"] * 17},
    {**CHAT, "messages": []},
    {**CHAT, "messages": [{"role": "user", "content": 5}]},
    {**CHAT, "messages": [{"role": "user", "content": "x"}] * 3_000},  # over gateway.max_messages
    {**CHAT, "tool_choice": {"deep": DEEP}},
    {key: value for key, value in CHAT.items() if key != "model"},
]


def _encode(body: Any) -> bytes:
    return json.dumps(body).replace(f'"{DEEP}"', "[" * 2_000 + "]" * 2_000).encode()


def _post(client: Any, path: str, body: Any) -> tuple[int, Any]:
    answer = client.post(path, content=_encode(body), headers={"content-type": "application/json"})
    return answer.status_code, answer.json()


@pytest.mark.parametrize("body", BAD_CHATS, ids=lambda b: next(iter(set(b) ^ set(CHAT)), "") or "changed")
def test_a_dense_body_gets_the_same_400_as_the_inline_one(gateway: Any, body: dict[str, Any]) -> None:
    padded = {**body, "pad": PADDING}
    assert not is_dense(_encode(body)) and is_dense(_encode(padded))
    _, key = gateway.tenant()
    with gateway.client(key) as client:
        inline = _post(client, "/v1/chat/completions", body)
        dense = _post(client, "/v1/chat/completions", padded)
    assert inline[0] == 400 and inline == dense


def test_a_dense_valid_body_is_served_and_bad_json_is_a_400(gateway: Any) -> None:
    _, key = gateway.tenant()
    with gateway.client(key) as client:
        status, answer = _post(client, "/v1/chat/completions", {**CHAT, "pad": PADDING})
        assert status == 200 and answer["choices"][0]["message"]["content"] is not None
        broken = client.post("/v1/chat/completions", content=_encode({**CHAT, "pad": PADDING})[:-1],
                             headers={"content-type": "application/json"})
    assert broken.status_code == 400
    assert broken.json()["error"]["message"].startswith("The request body is not valid JSON")


def test_a_dense_admin_body_names_its_field(gateway: Any) -> None:
    with gateway.admin() as client:
        inline = _post(client, "/admin/tenants", {"name": 5})
        dense = _post(client, "/admin/tenants", {"name": 5, "pad": PADDING})
    assert inline[0] == 400 and inline[1]["error"]["param"] == "name" and inline == dense
