"""Huge inputs do not stall the gateway: while 8 MB prompts, a prompt just under the character
limit (tokenized off the event loop), 200,000 empty messages and a 20,000-line batch file are
processed, `/health` keeps answering and another tenant's stream completes. A real `sluice serve`
(broker, worker, SQLite). The /health latency is printed (a figure for the notes), not asserted:
first with everything at once, then for each huge input alone (so each figure has one cause)."""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from sluice.broker import free_port

from .test_serve import Serve, serve_env  # noqa: F401  (serve_env: the fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_BODY = 16 * 2**20
BIG_PROMPT = "lorem ipsum dolor sit amet " * (8 * 2**20 // 27)
UNDER_LIMIT = "word " * (1_048_000 // 5)
CHAT = {"model": "demo", "max_tokens": 16, "temperature": 0, "stream": True}
EMPTY_MESSAGES = {**CHAT, "messages": [{"role": "user", "content": ""}] * 200_000}


def _rss_peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _tenant_key(serve: Serve, name: str) -> str:
    tenant = serve.admin("POST", "/admin/tenants", json={"name": name}).json()
    return serve.admin("POST", f"/admin/tenants/{tenant['id']}/keys", json={"name": "t"}).json()["key"]


def _batch_file(lines: int, *, bad_last: bool) -> bytes:
    rows = [{"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "demo", "max_tokens": 4,
                      "messages": [{"role": "user", "content": f"translate line {i}"}]}}
            for i in range(lines)]
    if bad_last:
        rows[-1] = {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "demo", "max_tokens": 0, "messages": []}}
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


class HealthProbe:
    """GETs /health every 20 ms on its own connection; `latencies` in seconds, `errors` as text."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=60) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                try:
                    status = client.get("/health").status_code
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    continue
                self.latencies.append(time.perf_counter() - start)
                if status != 200:
                    self.errors.append(str(status))
                time.sleep(0.02)

    @contextmanager
    def running(self) -> Iterator[HealthProbe]:
        self._thread.start()
        time.sleep(0.3)  # a few probes before the load starts
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(60)

    def summary(self) -> str:
        ordered = sorted(self.latencies)
        return (f"{len(ordered)} probes, p50 {statistics.median(ordered) * 1000:.1f} ms, "
                f"p99 {ordered[max(int(len(ordered) * 0.99) - 1, 0)] * 1000:.1f} ms, "
                f"max {ordered[-1] * 1000:.1f} ms")


def _probed(serve: Serve, label: str, load: Callable[[], None]) -> None:
    """Runs `load` while probing /health; asserts /health always answered and prints the figures."""
    probe = HealthProbe(serve.base)
    with probe.running():
        load()
    assert not probe.errors and len(probe.latencies) > 3, probe.errors
    print(f"\n/health during {label}: {probe.summary()}")


def _client(serve: Serve, key: str) -> httpx.Client:
    return httpx.Client(base_url=serve.base, timeout=300, headers={"authorization": f"Bearer {key}"})


def test_health_answers_and_others_are_served_during_huge_inputs(
        tmp_path: Path, serve_env: dict[str, str]) -> None:  # noqa: F811 (the fixture imported above)
    serve = Serve(tmp_path, dict(serve_env, SLUICE_GATEWAY_MAX_BODY_BYTES=str(MAX_BODY)), free_port())
    try:
        serve.wait_ready()
        flood, victim = _tenant_key(serve, "flood"), _tenant_key(serve, "victim")
        rss_before = _rss_peak_mb(serve.process.pid)
        results: dict[str, httpx.Response] = {}
        batch_file = _batch_file(20_000, bad_last=True)

        def post(name: str, path: str, key: str, **kwargs: object) -> None:
            with _client(serve, key) as client:
                results[name] = client.post(path, **kwargs)  # type: ignore[arg-type]

        def batch() -> None:
            with _client(serve, flood) as client:
                uploaded = client.post("/v1/files", files={"file": ("big.jsonl", batch_file)},
                                       data={"purpose": "batch"})
                results["upload"] = uploaded
                if uploaded.status_code == 200:
                    results["batch"] = client.post("/v1/batches", json={
                        "input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions",
                        "completion_window": "24h"})

        jobs = [threading.Thread(target=post, args=(f"8mb-{i}", "/v1/completions", flood),
                                 kwargs={"json": {"model": "demo", "prompt": BIG_PROMPT, "max_tokens": 4}})
                for i in range(3)]
        jobs += [
            threading.Thread(target=post, args=("under-limit", "/v1/chat/completions", flood), kwargs={
                "json": {**CHAT, "stream": False, "messages": [{"role": "user", "content": UNDER_LIMIT}]}}),
            threading.Thread(target=post, args=("200k-messages", "/v1/chat/completions", flood),
                             kwargs={"json": EMPTY_MESSAGES}),
            threading.Thread(target=batch),
        ]

        def everything() -> None:
            for job in jobs:
                job.start()
            time.sleep(0.2)
            post("victim", "/v1/chat/completions", victim,
                 json={**CHAT, "messages": [{"role": "user", "content": "hello there"}]})
            for job in jobs:
                job.join(300)

        _probed(serve, "huge inputs at once", everything)
        assert results["victim"].status_code == 200 and "data: [DONE]" in results["victim"].text
        for i in range(3):
            assert results[f"8mb-{i}"].status_code == 400
            assert results[f"8mb-{i}"].json()["error"]["code"] == "string_above_max_length"
        assert results["under-limit"].json()["error"]["code"] == "context_length_exceeded"
        assert results["200k-messages"].json()["error"]["code"] == "array_above_max_length"
        # The whole file is validated (off the loop) at upload; its invalid last line refuses it: nothing runs.
        assert results["upload"].status_code == 400 and results["upload"].json()["error"]["param"] == "file"
        assert "batch" not in results
        print(f"gateway peak RSS {rss_before:.0f} MB before, {_rss_peak_mb(serve.process.pid):.0f} MB after")
    finally:
        serve.stop()


def test_health_answers_during_each_huge_input_alone(
        tmp_path: Path, serve_env: dict[str, str]) -> None:  # noqa: F811 (the fixture imported above)
    """One cause per figure: 200,000 empty messages, an 8 MB prompt, a 20,000-line upload, and
    creating (enqueuing) a batch of 20,000 valid lines."""
    serve = Serve(tmp_path, dict(serve_env, SLUICE_GATEWAY_MAX_BODY_BYTES=str(MAX_BODY)), free_port())
    try:
        serve.wait_ready()
        client = _client(serve, _tenant_key(serve, "flood"))
        answers: dict[str, httpx.Response] = {}

        def send(name: str, *args: object, **kwargs: object) -> Callable[[], None]:
            def load() -> None:
                answers[name] = client.post(*args, **kwargs)  # type: ignore[arg-type]
            return load

        _probed(serve, "200,000 empty messages", send("messages", "/v1/chat/completions", json=EMPTY_MESSAGES))
        assert answers["messages"].status_code == 400
        assert answers["messages"].json()["error"]["param"] == "messages"
        _probed(serve, "an 8 MB prompt", send("prompt", "/v1/completions",
                                              json={"model": "demo", "prompt": BIG_PROMPT, "max_tokens": 4}))
        assert answers["prompt"].json()["error"]["code"] == "string_above_max_length"
        _probed(serve, "a 20,000-line upload", send("upload", "/v1/files", data={"purpose": "batch"},
                                                    files={"file": ("big.jsonl", _batch_file(20_000, bad_last=False))}))
        assert answers["upload"].status_code == 200, answers["upload"].text
        _probed(serve, "creating a 20,000-line batch", send("batch", "/v1/batches", json={
            "input_file_id": answers["upload"].json()["id"], "endpoint": "/v1/chat/completions",
            "completion_window": "24h"}))
        batch = answers["batch"].json()
        assert answers["batch"].status_code == 200 and batch["request_counts"]["total"] == 20_000, batch
        assert client.post(f"/v1/batches/{batch['id']}/cancel").status_code == 200
        client.close()
    finally:
        serve.stop()
