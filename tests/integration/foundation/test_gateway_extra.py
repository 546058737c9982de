"""`pip install '.[gateway]'` in an empty virtualenv: no torch, triton or matplotlib, and a
`sluice gateway` started from it serves a chat completion through an upstream worker.

The real thing the gateway image does (docker/Dockerfile.gateway): a fresh venv, the package built
from this checkout, the dependencies from the configured index (pip's cache makes a second run
quick). The broker, the upstream (the lab's fake OpenAI server) and the model's tokenizer (the demo
model's directory) come from the test environment; the gateway process is the new venv's alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sluice.broker import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
ADMIN_TOKEN = "gateway-extra-admin-token-0123456789"
WORKER_SECRET = "gateway-extra-worker-secret-0123456789"


@pytest.fixture(scope="module")
def gateway_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("gateway-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # --no-compile: no bytecode written for every installed module (the test imports few of them).
    done = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-compile",
                           "-c", str(ROOT / "constraints.txt"), f"{ROOT}[gateway]"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


def test_the_gateway_group_brings_no_torch_triton_or_matplotlib(gateway_venv: Path) -> None:
    probe = ("import importlib.util as u; print(','.join(n for n in ('torch', 'triton', 'matplotlib', 'sluice', "
             "'litestar', 'aiokafka') if u.find_spec(n) is not None))")
    found = subprocess.run([str(gateway_venv / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                           check=True, cwd="/").stdout.strip().split(",")
    assert found == ["sluice", "litestar", "aiokafka"]


@pytest.fixture
def fake_upstream() -> Iterator[int]:
    process = subprocess.Popen([sys.executable, str(ROOT / "src" / "sluice_lab" / "fake_openai.py"), "--port", "0",
                                "--tokens", "8"], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("PORT "), line
        yield int(line.split()[1])
    finally:
        process.terminate()
        process.wait(10)


def test_a_gateway_from_the_group_serves_through_an_upstream(
        gateway_venv: Path, fake_upstream: int, bootstrap_servers: str, demo_model_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.mkdir()
    (config / "sluice.toml").write_text("")
    (config / "models.toml").write_text(f'[[models]]\nname = "demo"\npath = "{demo_model_dir}"\n')
    (config / "tenants.toml").write_text('[[tenants]]\nname = "app"\n')
    (config / "upstreams.toml").write_text(
        f'[[upstreams]]\nname = "fake"\nbase_url = "http://127.0.0.1:{fake_upstream}/v1"\nmodels = ["demo"]\n')
    port = free_port()
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "SLUICE_CONFIG_DIR": str(config),
           "SLUICE_KAFKA_BOOTSTRAP_SERVERS": bootstrap_servers,
           "SLUICE_KAFKA_TOPIC_PREFIX": f"extra{time.monotonic_ns()}",
           "SLUICE_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'sluice.db'}",
           "SLUICE_GATEWAY_WORKER_PORT": str(free_port()), "SLUICE_GATEWAY_WORKER_SECRET": WORKER_SECRET,
           "SLUICE_ADMIN_TOKEN": ADMIN_TOKEN}
    log = (tmp_path / "gateway.log").open("wb")
    gateway = subprocess.Popen([str(gateway_venv / "bin" / "sluice"), "gateway", "--port", str(port)], cwd=tmp_path,
                               env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    try:
        deadline = time.monotonic() + 120
        while True:
            assert gateway.poll() is None, (tmp_path / "gateway.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the gateway did not become ready"
            try:
                if httpx.get(f"{base}/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        tenants = httpx.get(f"{base}/admin/tenants", headers=admin, timeout=10).json()
        tenant_id = next(t["id"] for t in tenants["data"] if t["name"] == "app")
        key = httpx.post(f"{base}/admin/tenants/{tenant_id}/keys", headers=admin, json={}, timeout=10).json()["key"]
        answer = httpx.post(f"{base}/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=60,
                            json={"model": "demo", "messages": [{"role": "user", "content": "hello"}],
                                  "max_tokens": 8})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["choices"][0]["message"]["content"] and body["usage"]["completion_tokens"] == 8
    finally:
        gateway.terminate()
        try:
            gateway.wait(30)
        except subprocess.TimeoutExpired:
            gateway.kill()
        log.close()
