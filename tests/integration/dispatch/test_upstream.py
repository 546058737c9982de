"""[[upstreams]]: a sluice gateway with no workers of its own in front of real OpenAI-compatible servers.

The upstream is another `sluice serve` process (the demo model on its CPU worker), reached over
HTTP with an API key of its own; the front gateway (`sluice serve --workers 0`) tokenizes, queues,
applies quotas and classes, and forwards token-id prompts. Nothing is mocked: faults are real
(a client that goes away, an upstream SIGKILLed and restarted). A second kind of upstream, the
HF-transformers server of the measurement tests, is served through the same link.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from sluice.broker import free_port
from sluice.cli import main
from sluice.errors import ConfigError
from sluice.settings import load_settings

from .conftest import wait_until
from .test_serve import Serve, serve_environment, write_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Speculation off: the class test's long stream must hold the upstream while two requests queue
# behind it, and prompt lookup on the demo model's repetitive greedy text would finish it in a
# fraction of a second (CI saw the interactive request never queue).
# The upstream's context is shorter than the demo model's 4096 (the front's own): the front reads
# it from the upstream's /v1/models and checks requests against it.
UPSTREAM_CONTEXT = 3072
UPSTREAM_TOML = ("[dispatch]\nlocal_workers = 1\nheartbeat_interval_s = 0.5\n"
                 "[engine]\nmax_num_seqs = 16\nmax_num_batched_tokens = 512\nnum_speculative_tokens = 0\n"
                 f"max_model_len = {UPSTREAM_CONTEXT}\n")
HOLDER_MAX_TOKENS = 2000
# No minimum class shares: the class test checks that interactive goes before batch work queued
# earlier, which the batch lane's share (owed when no recent dispatch was batch) would reverse.
FRONT_TOML = ("[dispatch]\nheartbeat_interval_s = 0.5\nheartbeat_timeout_s = 5.0\n"
              "[scheduler]\nmin_share_standard = 0.0\nmin_share_batch = 0.0\n")
FRONT_TENANTS = ('[[tenants]]\nname = "demo-chat"\npriority_ceiling = "interactive"\n'
                 '[[tenants]]\nname = "nightly"\ndefault_class = "batch"\npriority_ceiling = "batch"\n'
                 '[[tenants]]\nname = "metered"\nquotas.requests_per_minute = 1\n')
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


def tenant_key(serve: Serve, name: str) -> str:
    tenants = serve.admin("GET", "/admin/tenants").json()
    tenant_id = next(t["id"] for t in (tenants["data"] if isinstance(tenants, dict) else tenants)
                     if t["name"] == name)
    return str(serve.admin("POST", f"/admin/tenants/{tenant_id}/keys", json={"name": "t"}).json()["key"])


def records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def six_at_once(client: openai.OpenAI, prompt: str, *, max_tokens: int) -> list[str | None]:
    """Six greedy completions (`prompt 0` … `prompt 5`) sent at once; their finish reasons."""
    finished: list[str | None] = []

    def ask(i: int) -> None:
        answer = client.completions.create(model="demo", prompt=f"{prompt} {i}", temperature=0,
                                           max_tokens=max_tokens, extra_body={"ignore_eos": True})
        finished.append(answer.choices[0].finish_reason)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    return finished


class Pair:
    """An upstream `sluice serve` and a front gateway whose one worker is that upstream."""

    def __init__(self, root: Path, model_dir: Path, bootstrap_servers: str, max_concurrency: int) -> None:
        self.root = root
        up_dir = root / "up"
        up_dir.mkdir(parents=True, exist_ok=True)
        self.up_records = up_dir / "records.jsonl"
        self.up_env = serve_environment(up_dir, write_config(up_dir / "config", model_dir, sluice_toml=UPSTREAM_TOML),
                                        bootstrap_servers, "up")
        self.up_env["SLUICE_GATEWAY_RECORD_LOG_PATH"] = str(self.up_records)
        self.up_port = free_port()
        self.upstream = self.start_upstream()
        self.up_key = tenant_key(self.upstream, "demo-chat")

        front_dir = root / "front"
        front_dir.mkdir(parents=True, exist_ok=True)
        config = write_config(front_dir / "config", model_dir, sluice_toml=FRONT_TOML, tenants_toml=FRONT_TENANTS)
        (config / "upstreams.toml").write_text(
            f'[[upstreams]]\nname = "second"\nbase_url = "http://127.0.0.1:{self.up_port}/v1"\n'
            f'api_key_env = "UPSTREAM_KEY"\nmodels = ["demo"]\nmax_concurrency = {max_concurrency}\n'
            'request_timeout_s = 120\n')
        self.front_records = front_dir / "records.jsonl"
        env = serve_environment(front_dir, config, bootstrap_servers, "front")
        env.update(SLUICE_GATEWAY_RECORD_LOG_PATH=str(self.front_records), UPSTREAM_KEY=self.up_key)
        self.front = Serve(front_dir, env, free_port(), "--workers", "0")
        self.front.wait_ready()
        self.keys = {name: tenant_key(self.front, name) for name in ("demo-chat", "nightly", "metered")}

    def start_upstream(self) -> Serve:
        serve = Serve(self.root / "up", self.up_env, self.up_port)
        serve.wait_ready()
        return serve

    def client(self, tenant: str = "demo-chat", **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(api_key=self.keys[tenant], base_url=self.front.base + "/v1", max_retries=0,
                             timeout=120, **kwargs)

    def workers(self) -> list[dict[str, Any]]:
        return list(self.front.admin("GET", "/admin/workers").json()["workers"])

    def stop(self) -> None:
        self.front.stop()
        self.upstream.stop()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path, bootstrap_servers: str) -> Iterator[Pair]:
    pair = Pair(tmp_path_factory.mktemp("upstream"), demo_model_dir, bootstrap_servers, max_concurrency=1)
    try:
        yield pair
    finally:
        pair.stop()


def test_upstream_config_errors_are_one_line(tmp_path: Path, demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path / "config", demo_model_dir)
    cases = {
        'name = "a"\nbase_url = "ftp://x"\nmodels = ["demo"]\n': "base_url must be http(s)",
        'name = "a"\nbase_url = "http://u:secret@x"\nmodels = ["demo"]\n': "must not carry credentials",
        'name = "a"\nbase_url = "http://x"\nmodels = ["other"]\n': "not in models.toml",
        'name = "a"\nbase_url = "http://x"\nmodels = ["demo"]\nkind = "tgi"\n': "upstreams",
        'name = "a"\nbase_url = "http://x"\nmodels = ["demo"]\nmax_concurrency = 0\n': "max_concurrency",
        'name = "a"\nbase_url = "http://x"\nmodels = ["demo"]\napi_key = "k"\n': "api_key",
        'name = "a"\nbase_url = "http://x"\nmodels = ["demo"]\nkv_events_endpoint = "tcp://x:5557"\n': "needs kind",
        'name = "a"\nbase_url = "http://x"\nmodels = ["demo"]\nkind = "vllm"\nkv_events_endpoint = "http://x"\n':
            "tcp://HOST:PORT",
    }
    for body, expected in cases.items():
        (config / "upstreams.toml").write_text("[[upstreams]]\n" + body)
        with pytest.raises(ConfigError) as caught:
            load_settings(config, environ={})
        message = str(caught.value)
        assert expected in message and "\n" not in message and "secret" not in message, message

    # A key variable that is not set: `sluice serve` stops with one line naming it, before starting.
    (config / "upstreams.toml").write_text('[[upstreams]]\nname = "a"\nbase_url = "http://x"\n'
                                           'models = ["demo"]\napi_key_env = "SLUICE_TEST_NO_SUCH_KEY"\n')
    monkeypatch.setenv("SLUICE_CONFIG_DIR", str(config))
    monkeypatch.delenv("SLUICE_TEST_NO_SUCH_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["serve", "--workers", "0", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert "SLUICE_TEST_NO_SUCH_KEY" in err and "is not set" in err and len(err.splitlines()) == 1, err


def test_completions_and_chat_streaming_and_not(pair: Pair) -> None:
    client = pair.client()
    direct = openai.OpenAI(api_key=pair.up_key, base_url=pair.upstream.base + "/v1", max_retries=0, timeout=120)
    extra = {"ignore_eos": True}
    expected = direct.completions.create(model="demo", prompt="the quick brown fox", temperature=0, max_tokens=6,
                                         extra_body=extra).choices[0].text
    completion = client.completions.create(model="demo", prompt="the quick brown fox", temperature=0,
                                           max_tokens=6, extra_body=extra)
    assert completion.choices[0].text == expected  # the same greedy tokens as asked directly
    assert completion.usage is not None and completion.usage.completion_tokens == 6
    assert completion.usage.prompt_tokens > 0

    chunks = list(client.completions.create(model="demo", prompt="the quick brown fox", temperature=0,
                                            max_tokens=6, stream=True, stream_options={"include_usage": True},
                                            extra_body=extra))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6

    messages: list[Any] = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=5,
                                          extra_body=extra)
    expected_chat = direct.chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=5,
                                                   extra_body=extra).choices[0].message.content
    assert chat.choices[0].message.content == expected_chat and chat.usage is not None
    assert chat.usage.completion_tokens == 5
    streamed = list(client.chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=5,
                                                   stream=True, extra_body=extra))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected_chat

    # A stream's record is written when its pump ends, which may be just after the client's [DONE].
    wait_until(lambda: len([r for r in records(pair.front_records) if r["finish_reason"] == "length"]) >= 4,
               "the four requests' records")
    served = [r for r in records(pair.front_records) if r["finish_reason"] == "length"]
    assert len(served) >= 4 and all(r["worker"] == "upstream/second" for r in served)
    (view,) = pair.workers()
    assert view["worker_id"] == "upstream/second" and view["kind"] == "upstream"
    assert "127.0.0.1" not in json.dumps(view)  # no URL in the views


def test_the_upstream_s_context_its_refusals_and_logprobs_reach_the_client_as_4xx(pair: Pair) -> None:
    """Issue #35: an over-long request is a 400 naming max_tokens at the front (the upstream's
    /v1/models context, not the model's config); a request the upstream itself refuses (here: its
    tenant's per-request output cap, a real 400 of a real server) reaches the client as the same
    400 with the upstream's message, streamed or not; logprobs, which the link does not relay,
    are a 400 naming them rather than an empty list."""
    headers = {"authorization": f"Bearer {pair.keys['demo-chat']}"}
    with httpx.Client(base_url=pair.front.base, headers=headers, timeout=120) as front:
        cards = front.get("/v1/models").json()["data"]
        assert [c["max_model_len"] for c in cards if c["id"] == "demo"] == [UPSTREAM_CONTEXT]
        for stream in (False, True):
            body = {"model": "demo", "prompt": "a long story", "max_tokens": UPSTREAM_CONTEXT - 2, "stream": stream}
            answer = front.post("/v1/completions", json=body)
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["param"] == "max_tokens" and str(UPSTREAM_CONTEXT) in error["message"], error
        for path, extra in (("/v1/completions", {"logprobs": 2}), ("/v1/chat/completions", {"logprobs": True})):
            prompt = {"prompt": "hi"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]}
            answer = front.post(path, json={"model": "demo", **prompt, "max_tokens": 2, **extra})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "logprobs", answer.text

        tenants = pair.upstream.admin("GET", "/admin/tenants").json()
        up_tenant = next(t["id"] for t in (tenants["data"] if isinstance(tenants, dict) else tenants)
                         if t["name"] == "demo-chat")
        capped = pair.upstream.admin("PATCH", f"/admin/tenants/{up_tenant}", json={"quotas": {"max_output_tokens": 3}})
        assert capped.status_code == 200, capped.text
        try:
            for stream in (False, True):
                body = {"model": "demo", "prompt": "hello", "max_tokens": 5, "stream": stream}
                answer = front.post("/v1/completions", json=body)
                assert answer.status_code == 400, answer.text  # not a 500 "please retry"
                error = answer.json()["error"]
                assert "your limit is 3" in error["message"] and "retry" not in error["message"], error
        finally:
            lifted = pair.upstream.admin("PATCH", f"/admin/tenants/{up_tenant}",
                                         json={"quotas": {"max_output_tokens": None}})
            assert lifted.status_code == 200 and lifted.json()["quotas"]["max_output_tokens"] is None, lifted.text
        again = front.post("/v1/completions", json={"model": "demo", "prompt": "hello", "max_tokens": 5})
        assert again.status_code == 200, again.text  # the cap lifted: served again


def test_quota_refuses_before_the_upstream_sees_anything(pair: Pair) -> None:
    client = pair.client("metered")
    before = len(records(pair.up_records))
    client.completions.create(model="demo", prompt="one", **{k: v for k, v in GREEDY.items() if k != "ignore_eos"})
    wait_until(lambda: len(records(pair.up_records)) == before + 1, "the upstream's record")
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="demo", prompt="two", max_tokens=2)
    time.sleep(0.5)  # a request that reached the upstream would have left its record by now
    assert len(records(pair.up_records)) == before + 1


def _stream_until_first_chunk(pair: Pair, started: threading.Event, stop: threading.Event,
                              box: dict[str, Any]) -> None:
    """A long streaming request; returns (closing the stream) once `stop` is set."""
    try:
        with httpx.stream("POST", pair.front.base + "/v1/completions", timeout=120,
                          # Abort at once on disconnect (no resumable-stream grace): the abort must reach the upstream.
                          headers={"authorization": f"Bearer {pair.keys['demo-chat']}",
                                   "x-sluice-disconnect": "abort"},
                          json={"model": "demo", "prompt": "a long story", "max_tokens": HOLDER_MAX_TOKENS,
                                "stream": True, "ignore_eos": True, "temperature": 0}) as response:
            box["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data:"):
                    box.setdefault("events", []).append(line)
                    started.set()
                if stop.is_set():
                    return
    except httpx.HTTPError as exc:
        box["error"] = exc
    finally:
        started.set()


def test_disconnect_reaches_the_upstream_and_classes_keep_their_order(pair: Pair) -> None:
    """max_concurrency 1: while a long stream holds the upstream, a batch request then an
    interactive one queue at the front gateway; the client closing its stream aborts it at the
    upstream (its own record says abort), and the interactive request is sent first."""
    started, stop, box = threading.Event(), threading.Event(), {}
    holder = threading.Thread(target=_stream_until_first_chunk, args=(pair, started, stop, box))
    holder.start()
    assert started.wait(120) and box.get("status") == 200
    results: dict[str, str] = {}

    def ask(tenant: str, tier: str | None) -> None:
        kwargs: dict[str, Any] = {"extra_body": {"service_tier": tier}} if tier else {}
        answer = pair.client(tenant).completions.create(model="demo", prompt=f"from {tenant}", max_tokens=2,
                                                        temperature=0, **kwargs)
        results[tenant] = answer.id

    def waiting(label: str) -> bool:
        return any(line.startswith(f'sluice:num_requests_waiting{{class="{label}"}} 1')
                   for line in pair.front.admin("GET", "/metrics").text.splitlines())

    batch = threading.Thread(target=ask, args=("nightly", None))
    batch.start()
    wait_until(lambda: waiting("batch"), "the batch request queued")
    interactive = threading.Thread(target=ask, args=("demo-chat", "priority"))
    interactive.start()
    wait_until(lambda: waiting("interactive"), "the interactive request queued")
    stop.set()  # the client goes away mid-stream
    holder.join(60)
    batch.join(120)
    interactive.join(120)
    assert set(results) == {"nightly", "demo-chat"}
    wait_until(lambda: any(r["finish_reason"] == "abort" for r in records(pair.up_records)),
               "the upstream's abort record")
    aborted = [r for r in records(pair.up_records) if r["finish_reason"] == "abort"]
    assert aborted and aborted[-1]["completion_tokens"] < HOLDER_MAX_TOKENS

    def served_by_class() -> dict[str, dict[str, Any]]:
        return {r["priority_class"]: r for r in records(pair.front_records)
                if r["priority_class"] in ("batch", "interactive") and r["finish_reason"] == "length"}

    # A record is written when its pump ends, which may be just after the client has its answer.
    wait_until(lambda: len(served_by_class()) == 2, "the batch and interactive requests' records")
    front = served_by_class()
    assert front["interactive"]["dispatch_time"] < front["batch"]["dispatch_time"]


def test_own_worker_and_upstream_in_one_deployment(pair: Pair, tmp_path: Path, demo_model_dir: Path,
                                                   bootstrap_servers: str) -> None:
    """A gateway with a local worker process and the upstream: one queue, both serve."""
    config = write_config(tmp_path / "config", demo_model_dir, sluice_toml=FRONT_TOML)
    (config / "upstreams.toml").write_text(
        f'[[upstreams]]\nname = "second"\nbase_url = "http://127.0.0.1:{pair.up_port}"\n'
        'api_key_env = "UPSTREAM_KEY"\nmodels = ["demo"]\nmax_concurrency = 1\n')
    record_log = tmp_path / "records.jsonl"
    env = serve_environment(tmp_path, config, bootstrap_servers, "mixed")
    env.update(SLUICE_GATEWAY_RECORD_LOG_PATH=str(record_log), UPSTREAM_KEY=pair.up_key)
    mixed = Serve(tmp_path, env, free_port(), "--workers", "1")
    try:
        mixed.wait_ready()  # answers, with one of the two
        wait_until(lambda: len(mixed.admin("GET", "/admin/workers").json()["workers"]) == 2,
                   "a worker and the upstream", timeout=180)
        kinds = sorted(w["kind"] for w in mixed.admin("GET", "/admin/workers").json()["workers"])
        assert kinds == ["upstream", "worker"]
        client = openai.OpenAI(api_key=tenant_key(mixed, "demo-chat"), base_url=mixed.base + "/v1",
                               max_retries=0, timeout=120)
        assert six_at_once(client, "mixed", max_tokens=8) == ["length"] * 6
        wait_until(lambda: len(records(record_log)) == 6, "the six records")
        served_by = {r["worker"] for r in records(record_log)}
        assert "upstream/second" in served_by and len(served_by) == 2, served_by
    finally:
        mixed.stop()


def test_upstream_killed_mid_stream_then_back(pair: Pair) -> None:
    """SIGKILL of the upstream: the open stream ends with an error event, a batch line in flight
    is re-queued (the batch completes with every line once the upstream is back), and the link
    re-attaches by itself."""
    nightly = pair.client("nightly")
    lines = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"model": "demo", "prompt": f"doc {i}", "max_tokens": 4,
                                         "temperature": 0, "ignore_eos": True}}) + "\n" for i in range(6))
    started, stop, box = threading.Event(), threading.Event(), {}
    holder = threading.Thread(target=_stream_until_first_chunk, args=(pair, started, stop, box))
    holder.start()
    assert started.wait(120) and box.get("status") == 200
    uploaded = nightly.files.create(file=("docs.jsonl", lines.encode()), purpose="batch")
    batch = nightly.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    pair.upstream.kill()
    holder.join(60)
    events = box.get("events", [])
    assert events and '"error"' in events[-1] and "generation_failed" in events[-1], events[-3:]
    wait_until(lambda: not pair.workers(), "the front gateway to drop the upstream")

    pair.upstream = pair.start_upstream()
    wait_until(lambda: bool(pair.workers()), "the upstream re-attached")
    answer = pair.client().completions.create(model="demo", prompt="after", max_tokens=2, temperature=0)
    assert answer.choices[0].finish_reason == "length"
    deadline = time.monotonic() + 240
    while (done := nightly.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, "the batch did not complete"
        time.sleep(0.2)
    assert done.status == "completed" and done.request_counts is not None
    assert done.request_counts.completed == 6 and done.error_file_id is None


HF_SERVER = Path(__file__).resolve().parents[1] / "measure" / "hf_openai_server.py"


def test_hf_transformers_server_as_a_vllm_kind_upstream(tmp_path: Path, demo_model_dir: Path,
                                                        bootstrap_servers: str) -> None:
    """An independent server (HF transformers, no sluice code) behind the front gateway, as kind
    "vllm": it runs one request at a time (HF_MAX_RUNNING=1) and reports its queue in vLLM's
    /metrics gauges. Six concurrent requests with max_concurrency 8 and max_worker_waiting 1: all
    are served, and the server never holds more than one running and one waiting (plus at most
    one sent while its gauges were being read), where the cap alone would let it hold all six."""
    env_hf = dict(os.environ, HF_MAX_RUNNING="1")
    proc = subprocess.Popen([sys.executable, str(HF_SERVER), str(demo_model_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env_hf)
    front: Serve | None = None
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("PORT "), line
        hf_base = f"http://127.0.0.1:{int(line.split()[1])}"
        config = write_config(tmp_path / "config", demo_model_dir,
                              sluice_toml=FRONT_TOML.replace("[dispatch]\n", "[dispatch]\nmax_worker_waiting = 1\n"))
        (config / "upstreams.toml").write_text(
            f'[[upstreams]]\nname = "hf"\nbase_url = "{hf_base}"\nkind = "vllm"\n'
            'api_key_env = "HF_KEY"\nmodels = ["demo"]\nmax_concurrency = 8\n')
        env = serve_environment(tmp_path, config, bootstrap_servers, "hf")
        env["HF_KEY"] = "test-key"
        front = Serve(tmp_path, env, free_port(), "--workers", "0")
        front.wait_ready()
        key = tenant_key(front, "demo-chat")
        client = openai.OpenAI(api_key=key, base_url=front.base + "/v1", max_retries=0, timeout=120)
        completion = client.completions.create(model="demo", prompt="hello", temperature=0, max_tokens=5,
                                               extra_body={"ignore_eos": True})
        assert completion.usage is not None and completion.usage.completion_tokens == 5
        assert completion.choices[0].text
        chunks = list(client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                                     temperature=0, max_tokens=4, stream=True,
                                                     extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        assert six_at_once(client, "question", max_tokens=24) == ["length"] * 6
        gauges = {name.split("{")[0]: float(value) for name, value in
                  (row.rsplit(" ", 1) for row in httpx.get(hf_base + "/metrics", timeout=10).text.splitlines()
                   if row and not row.startswith("#"))}
        assert gauges["hf:max_requests_present"] <= 3, gauges
        (view,) = front.admin("GET", "/admin/workers").json()["workers"]
        assert view["device"] == "upstream (vllm)"
        # The gauges are polled once a second: the view shows the empty queue by the next poll.
        wait_until(lambda: front.admin("GET", "/admin/workers").json()["workers"][0]["num_waiting"] == 0,
                   "the upstream's waiting gauge back at 0", timeout=30)
    finally:
        if front is not None:
            front.stop()
        proc.terminate()
        proc.wait(timeout=10)
