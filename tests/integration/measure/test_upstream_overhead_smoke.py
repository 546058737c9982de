"""`sluice bench gateway-overhead --upstream fake` at tiny sizes, and the fake backend it measures.

The bench's figures depend on the machine, so only the JSON's shape and the fake's answers are
checked (no wall-clock assertions). LiteLLM is never installed for tests: the run points its
virtualenv at a missing directory and checks that the column is reported as skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sluice_lab.experiments.upstream_overhead import request_body
from sluice_lab.loadgen.lean_client import Target, closed_loop, run_loop

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
FAKE = REPO / "src" / "sluice_lab" / "fake_openai.py"
LEVEL_KEYS = ("ttft_p50_s", "ttft_p99_s", "delta_ttft_p50_s", "delta_ttft_p99_s", "itl_added_s",
              "cpu_per_request_s", "requests", "errors")


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, str(FAKE), "--port", "0", "--ttft-ms", "5", "--itl-ms", "1",
                             "--tokens", "4"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("PORT "), line
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _sse_events(text: str) -> list[str]:
    return [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]


def test_fake_streams_chat_and_completions(fake_url: str) -> None:
    chat = httpx.post(f"{fake_url}/v1/chat/completions", timeout=10, json={
        "model": "m", "messages": [{"role": "user", "content": "a b c"}], "stream": True,
        "stream_options": {"include_usage": True}})
    events = _sse_events(chat.text)
    assert chat.status_code == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["delta"]["content"] for c in chunks[:-1]] == [" tok"] * 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    # Token-id prompt, max_tokens below the fake's count, vLLM's return_token_ids.
    done = httpx.post(f"{fake_url}/v1/completions", timeout=10, json={
        "model": "m", "prompt": [5, 6, 7, 8, 9], "max_tokens": 2, "return_token_ids": True}).json()
    assert done["choices"][0]["text"] == " tok tok" and done["choices"][0]["token_ids"] == [42, 42]
    assert done["usage"]["prompt_tokens"] == 5 and done["prompt_token_ids"] == [5, 6, 7, 8, 9]
    streamed = _sse_events(httpx.post(f"{fake_url}/v1/completions", timeout=10, json={
        "model": "m", "prompt": [1, 2], "stream": True}).text)
    assert [json.loads(e)["choices"][0]["text"] for e in streamed[:-1]] == [" tok"] * 4


def test_fake_refuses_bad_input(fake_url: str) -> None:
    bad = httpx.post(f"{fake_url}/v1/completions", content=b"{not json", timeout=10)
    assert bad.status_code == 400 and "invalid JSON" in bad.json()["error"]["message"]
    assert httpx.get(f"{fake_url}/v1/nothing", timeout=10).status_code == 404


def test_closed_loop_ramp_staggers_the_streams(fake_url: str) -> None:
    port = int(fake_url.rsplit(":", 1)[1])
    target = Target("127.0.0.1", port, "/v1/chat/completions", request_body(4))
    results, _ = run_loop(closed_loop(target, 4, duration_s=0.6, ramp_s=0.4))
    assert results and all(r.ok for r in results)
    start = min(r.sent for r in results)
    # Stream i starts i * 0.1 s after the first: at no send were more streams busy than had started.
    for result in results:
        busy = sum(1 for r in results if r.sent <= result.sent < r.end)
        assert busy <= 1 + int((result.sent - start + 0.005) / 0.1), (busy, result.sent - start)
    assert max(r.sent for r in results) - start >= 0.3  # and the last one did start


def _bench(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "overhead.json"
    env = {**os.environ, "SLUICE_BENCH_LITELLM_VENV": str(tmp_path / "no-litellm")}
    proc = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "--log-level", "WARNING", "bench", "gateway-overhead",
         "--upstream", "fake", "--quick", "--concurrency", "1,3", "--requests-per-level", "4",
         "--saturation-streams", "4", "--saturation-s", "1", "--json", str(out), *args],
        capture_output=True, text=True, timeout=540, cwd=REPO, env=env)
    return proc, out


def _check_column(column: dict, levels: tuple[str, ...]) -> None:
    assert column["saturated_rps"] is not None and column["saturated_rps"] > 0
    assert set(column["levels"]) == set(levels)
    for row in column["levels"].values():
        for key in LEVEL_KEYS:
            assert key in row, key
        assert row["errors"] == 0 and row["requests"] == 4
        assert row["ttft_p50_s"] > 0 and row["ttft_p99_s"] >= row["ttft_p50_s"]


@pytest.mark.timeout(600)  # sluice serve's start-up and three short runs; minutes on a busy 2-core machine
def test_bench_direct_and_sluice(tmp_path: Path) -> None:
    proc, out = _bench(tmp_path, "--vs", "litellm")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    for name in ("direct", "sluice"):
        _check_column(summary[name], ("1", "3"))
    assert summary["direct"]["levels"]["1"]["delta_ttft_p50_s"] == 0.0
    # Streams start spread over one request's length; above 1 stream the level also runs all at once.
    assert summary["plan"]["ramp_s"] > 0
    for name in ("direct", "sluice"):
        assert "burst" not in summary[name]["levels"]["1"]
        burst = summary[name]["levels"]["3"]["burst"]
        assert all(key in burst for key in LEVEL_KEYS) and burst["errors"] == 0
    assert "litellm" not in summary and "no LiteLLM virtualenv" in summary["skipped"]["litellm"]
    assert summary["placement"]["gateway_cpus"] and summary["placement"]["client_cpus"]
    assert "delta_ttft_p50_at_1_met" in summary["verdict"]
    assert "ΔTTFT p50" in proc.stdout and "placement:" in proc.stdout


def test_bench_flags_are_validated(tmp_path: Path) -> None:
    proc, _ = _bench(tmp_path, "--vs", "haproxy")
    assert proc.returncode != 0 and "--vs: unknown peer" in proc.stderr
    for bad in ("-1", "nan", "1e9"):
        proc, out = _bench(tmp_path, "--ramp-s", bad)
        assert proc.returncode != 0 and "--ramp-s must be between 0 and 60" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and not out.exists()
    proc, _ = _bench(tmp_path, "--ramp-s", "soon")
    assert proc.returncode != 0 and "--ramp-s" in proc.stderr and "Traceback" not in proc.stderr
    plain = subprocess.run([sys.executable, "-m", "sluice.cli", "bench", "gateway-overhead", "--vs", "litellm"],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
    assert plain.returncode != 0 and "need --upstream fake" in plain.stderr
