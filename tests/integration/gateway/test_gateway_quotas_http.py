"""Quotas through real HTTP: RPM bursts, TPM refund on disconnect, daily budget, concurrency, PATCH;
with the counters in this process and in Redis (the shared ledger gives the same answers)."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.integration

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module", params=["in-process", "redis"])
def shared_mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def wait_for(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def body(**extra):
    return {"model": "demo", "messages": CHAT, "max_tokens": 4, **extra}


def test_burst_over_rpm_gets_usable_retry_after(gateway) -> None:
    _, key = gateway.tenant(quotas={"requests_per_minute": 3})
    with gateway.client(key) as client:
        answers = [client.post("/v1/chat/completions", json=body()) for _ in range(5)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429, 429]
    limited = answers[3]
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(limited.headers["retry-after"]) <= 60
    assert limited.headers["x-ratelimit-remaining-requests"] == "0"
    assert answers[0].headers["x-ratelimit-limit-requests"] == "3"
    assert answers[0].headers["x-ratelimit-remaining-requests"] == "2"


def test_tpm_reservation_refunded_on_client_disconnect(gateway) -> None:
    tenant, key = gateway.tenant(quotas={"tokens_per_minute": 5000})
    request = body(max_tokens=3000, ignore_eos=True, stream=True)
    with gateway.client(key) as client:
        # Opted out of the disconnect grace (docs/streams.md): the disconnect aborts at once.
        abort = {"x-sluice-disconnect": "abort"}
        with client.stream("POST", "/v1/chat/completions", json=request, headers=abort) as stream:
            assert stream.status_code == 200
            reserved_remaining = int(stream.headers["x-ratelimit-remaining-tokens"])
            assert reserved_remaining <= 5000 - 3000  # prompt + max_tokens reserved before the first byte
            lines = stream.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert all(line.startswith(("id: ", "data: ")) or line == "" for line in got)
        # the connection is closed here, long before 3000 tokens

        def remaining() -> int:
            value = int(client.get("/v1/models").headers["x-ratelimit-remaining-tokens"])
            return value if value > reserved_remaining + 1000 else 0

        wait_for(remaining, "the reservation to be settled to the generated tokens")
    with gateway.admin() as admin:

        def usage_row():
            rows = admin.get("/admin/usage", params={"tenant_id": tenant["id"]}).json()["data"]
            return rows[0] if rows else None

        row = wait_for(usage_row, "usage of the aborted request")
        assert 0 < row["completion_tokens"] < 3000 and row["requests"] == 1
        wait_for(
            lambda: admin.get("/admin/workers").json()["workers"][0]["num_running"] == 0,
            "the engine to drop the aborted request",
        )


def test_daily_budget_is_insufficient_quota(gateway) -> None:
    _, key = gateway.tenant(quotas={"tokens_per_day": 100})
    with gateway.client(key) as client:
        first = client.post("/v1/chat/completions", json=body(max_tokens=10, ignore_eos=True))
        assert first.status_code == 200
        used = first.json()["usage"]["total_tokens"]
        allowed = 100 // used
        answers = [
            client.post("/v1/chat/completions", json=body(max_tokens=10, ignore_eos=True))
            for _ in range(allowed)
        ]
    statuses = [a.status_code for a in answers]
    assert statuses[: allowed - 1] == [200] * (allowed - 1) and statuses[-1] == 429
    denied = answers[-1]
    assert denied.json()["error"]["code"] == "insufficient_quota"
    assert denied.headers["x-should-retry"] == "false"


def test_concurrency_cap_counts_open_streams(gateway) -> None:
    _, key = gateway.tenant(quotas={"max_concurrent": 1})
    with gateway.client(key) as client:
        with client.stream(
            "POST",
            "/v1/chat/completions",
            json=body(max_tokens=3000, ignore_eos=True, stream=True),
            headers={"x-sluice-disconnect": "abort"},  # the slot is released at the disconnect, no grace
        ) as stream:
            lines = (line for line in stream.iter_lines() if not line.startswith("id: "))
            first = [next(lines) for _ in range(3)]  # role chunk, blank, first content chunk
            assert '"content"' in first[2] and "error" not in first[2], first
            second = client.post("/v1/chat/completions", json=body())
            assert second.status_code == 429, (second.text, [next(lines) for _ in range(4)])
            assert "concurrent" in second.json()["error"]["message"]
        wait_for(
            lambda: client.post("/v1/chat/completions", json=body()).status_code == 200,
            "the slot to be released after the stream closed",
        )


def test_quota_patch_applies_to_next_request(gateway) -> None:
    tenant, key = gateway.tenant(quotas={"requests_per_minute": 1, "max_output_tokens": 5})
    with gateway.client(key) as client, gateway.admin() as admin:
        assert client.post("/v1/chat/completions", json=body()).status_code == 200
        assert client.post("/v1/chat/completions", json=body()).status_code == 429
        too_long = client.post("/v1/chat/completions", json=body(max_tokens=6))
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
        assert too_long.headers["x-ratelimit-limit-requests"] == "1"  # rate headers on errors too
        patched = admin.patch(
            f"/admin/tenants/{tenant['id']}/quotas",
            json={"requests_per_minute": None, "max_output_tokens": 50},
        )
        assert patched.status_code == 200 and patched.json()["requests_per_minute"] is None
        assert client.post("/v1/chat/completions", json=body(max_tokens=6)).status_code == 200
        quotas = admin.get(f"/admin/tenants/{tenant['id']}/quotas").json()
        assert quotas["max_output_tokens"] == 50 and quotas["requests_per_minute"] is None


def test_non_streaming_disconnect_aborts_and_settles(gateway) -> None:
    import httpx

    tenant, key = gateway.tenant(quotas={"tokens_per_minute": 5000})
    with gateway.client(key) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", json=body(max_tokens=3000, ignore_eos=True), timeout=0.5)
        wait_for(
            lambda: int(client.get("/v1/models").headers["x-ratelimit-remaining-tokens"]) > 3000,
            "the reservation to be settled after the client left",
        )
    with gateway.admin() as admin:

        def usage_row():
            rows = admin.get("/admin/usage", params={"tenant_id": tenant["id"]}).json()["data"]
            return rows[0] if rows else None

        assert wait_for(usage_row, "usage of the abandoned request")["completion_tokens"] < 3000
