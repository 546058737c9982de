"""Huge inputs do not stall the gateway: while 8 MB prompts, a prompt just under the character
limit (tokenized off the event loop), 200,000 empty messages and a 20,000-line batch file are
processed, `/health` keeps answering and another tenant's stream completes. A real `sluice serve`
(broker, worker, SQLite). The /health latency is printed (a figure for the notes), not asserted."""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest

from sluice.broker import free_port

from .test_serve import Serve, serve_env  # noqa: F401  (serve_env: the fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_BODY = 16 * 2**20


def _rss_peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _tenant_key(serve: Serve, name: str) -> str:
    tenant = serve.admin("POST", "/admin/tenants", json={"name": name}).json()
    return serve.admin("POST", f"/admin/tenants/{tenant['id']}/keys", json={"name": "t"}).json()["key"]


def test_health_answers_and_others_are_served_during_huge_inputs(
        tmp_path: Path, serve_env: dict[str, str]) -> None:  # noqa: F811 (the fixture imported above)
    env = dict(serve_env, SLUICE_GATEWAY_MAX_BODY_BYTES=str(MAX_BODY))
    serve = Serve(tmp_path, env, free_port())
    try:
        serve.wait_ready()
        flood, victim = _tenant_key(serve, "flood"), _tenant_key(serve, "victim")
        rss_before = _rss_peak_mb(serve.process.pid)
        latencies: list[float] = []
        health_errors: list[str] = []
        stop = threading.Event()

        def probe() -> None:
            with httpx.Client(base_url=serve.base, timeout=60) as client:
                while not stop.is_set():
                    start = time.perf_counter()
                    try:
                        status = client.get("/health").status_code
                    except httpx.HTTPError as exc:
                        health_errors.append(repr(exc))
                        continue
                    latencies.append(time.perf_counter() - start)
                    if status != 200:
                        health_errors.append(str(status))
                    time.sleep(0.02)

        results: dict[str, httpx.Response] = {}

        def post(name: str, path: str, key: str, **kwargs: object) -> None:
            with httpx.Client(base_url=serve.base, timeout=300,
                              headers={"authorization": f"Bearer {key}"}) as client:
                results[name] = client.post(path, **kwargs)  # type: ignore[arg-type]

        big = "lorem ipsum dolor sit amet " * (8 * 2**20 // 27)
        under_limit = "word " * (1_048_000 // 5)
        batch_lines = [json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions",
                                   "body": {"model": "demo", "max_tokens": 4,
                                            "messages": [{"role": "user", "content": f"translate line {i}"}]}})
                       for i in range(19_999)]
        batch_lines.append(json.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                                       "body": {"model": "demo", "max_tokens": 0, "messages": []}}))
        batch_file = ("\n".join(batch_lines) + "\n").encode()

        def batch() -> None:
            with httpx.Client(base_url=serve.base, timeout=300,
                              headers={"authorization": f"Bearer {flood}"}) as client:
                uploaded = client.post("/v1/files", files={"file": ("big.jsonl", batch_file)},
                                       data={"purpose": "batch"})
                results["upload"] = uploaded
                if uploaded.status_code == 200:
                    results["batch"] = client.post("/v1/batches", json={
                        "input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions",
                        "completion_window": "24h"})

        chat = {"model": "demo", "max_tokens": 16, "temperature": 0, "stream": True}
        jobs = [threading.Thread(target=post, args=(f"8mb-{i}", "/v1/completions", flood),
                                 kwargs={"json": {"model": "demo", "prompt": big, "max_tokens": 4}})
                for i in range(3)]
        jobs += [
            threading.Thread(target=post, args=("under-limit", "/v1/chat/completions", flood), kwargs={
                "json": {**chat, "stream": False, "messages": [{"role": "user", "content": under_limit}]}}),
            threading.Thread(target=post, args=("200k-messages", "/v1/chat/completions", flood), kwargs={
                "json": {**chat, "messages": [{"role": "user", "content": ""}] * 200_000}}),
            threading.Thread(target=batch),
        ]
        prober = threading.Thread(target=probe)
        prober.start()
        time.sleep(0.5)
        for job in jobs:
            job.start()
        time.sleep(0.2)
        post("victim", "/v1/chat/completions", victim,
             json={**chat, "messages": [{"role": "user", "content": "hello there"}]})
        for job in jobs:
            job.join(300)
        stop.set()
        prober.join(60)

        assert results["victim"].status_code == 200 and "data: [DONE]" in results["victim"].text
        for i in range(3):
            assert results[f"8mb-{i}"].status_code == 400
            assert results[f"8mb-{i}"].json()["error"]["code"] == "string_above_max_length"
        assert results["under-limit"].json()["error"]["code"] == "context_length_exceeded"
        assert results["200k-messages"].json()["error"]["code"] == "array_above_max_length"
        # The whole file is validated (off the loop) at upload; its invalid last line refuses it: nothing runs.
        assert results["upload"].status_code == 400 and results["upload"].json()["error"]["param"] == "file"
        assert "batch" not in results
        assert not health_errors and len(latencies) > 10
        ordered = sorted(latencies)
        print(f"\n/health during huge inputs: {len(ordered)} probes, p50 {statistics.median(ordered) * 1000:.1f} ms, "
              f"p99 {ordered[int(len(ordered) * 0.99) - 1] * 1000:.1f} ms, max {ordered[-1] * 1000:.1f} ms; "
              f"gateway peak RSS {rss_before:.0f} MB before, {_rss_peak_mb(serve.process.pid):.0f} MB after")
    finally:
        serve.stop()
