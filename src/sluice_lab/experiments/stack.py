"""Start the full sluice stack (`sluice serve`) as a subprocess for the stack-level experiments.

The stack runs in a temp work dir with a copy of the config dir; everything that must differ per
run is set through SLUICE_* environment overrides (free ports, a fresh SQLite database, a known
admin token, the per-request record file, scheduler switches). Tenants and keys are created
through the admin API, as an operator would.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from sluice.broker import free_port
from sluice.errors import CLIError

STARTUP_TIMEOUT_S = 180.0


@dataclass
class Stack:
    base_url: str
    admin_token: str = field(repr=False)
    model: str
    workdir: Path
    record_log: Path
    process: subprocess.Popen[bytes]

    def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        url = f"{self.base_url}/admin{path}"
        response = httpx.request(method, url, json=body, headers=headers, timeout=30)
        if response.status_code >= 400:
            raise CLIError(f"admin API {method} {path} answered {response.status_code}: "
                           f"{response.text[:300]}")
        return response.json()

    def create_tenant_key(self, name: str, *, ceiling: str, default_class: str, weight: float = 1.0,
                          quotas: dict[str, Any] | None = None) -> str:
        """A tenant allowed every model, without quota limits unless given; returns a new API key."""
        tenant = self.admin("POST", "/tenants", {
            "name": name, "priority_ceiling": ceiling, "default_class": default_class, "weight": weight,
            "quotas": quotas or {}})
        return str(self.admin("POST", f"/tenants/{tenant['id']}/keys", {"name": "bench"})["key"])

    def workers(self) -> list[dict[str, Any]]:
        view = self.admin("GET", "/workers")
        return list(view.get("workers", view) if isinstance(view, dict) else view)

    def log_tail(self, lines: int = 20) -> str:
        path = self.workdir / "serve.log"
        text = path.read_text(errors="replace") if path.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # serve stops its workers and broker itself
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_stack(config_dir: str | Path, workdir: Path, model_dir: Path | None, *, workers: int = 1,
                env: dict[str, str] | None = None, worker_threads: int = 1, model_name: str | None = None,
                prefix: list[str] | None = None, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> Stack:
    """Start `sluice serve` and wait until the gateway answers and a worker has registered.

    model_dir None: serve the config dir's models.toml (named `model_name`); `prefix` goes before
    the command (e.g. taskset)."""
    config_dir = Path(config_dir)
    if not (config_dir / "sluice.toml").is_file():
        raise CLIError(f"--config-dir: {config_dir} has no sluice.toml (run from the repository root "
                       "or pass --config-dir)")
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(config_dir, workdir / "config", dirs_exist_ok=True)
    port, admin_token = free_port(), secrets.token_urlsafe(24)
    record_log = workdir / "records.jsonl"
    run_env = {
        **os.environ,
        "SLUICE_GATEWAY_PORT": str(port),
        "SLUICE_GATEWAY_WORKER_PORT": str(free_port()),
        "SLUICE_DATABASE_URL": f"sqlite+aiosqlite:///{workdir / 'sluice.db'}",
        "SLUICE_ADMIN_TOKEN": admin_token,
        "SLUICE_GATEWAY_RECORD_LOG_PATH": str(record_log),
        "SLUICE_CONFIG_DIR": str(workdir / "config"),
        # Workers inherit this: on a shared CPU, one torch thread per process avoids the
        # oversubscription that slows every step down by an order of magnitude.
        "OMP_NUM_THREADS": str(worker_threads),
        **(env or {}),
    }
    log = open(workdir / "serve.log", "ab")  # noqa: SIM115 - handed to the child process
    model_args = ["--model", str(model_dir)] if model_dir is not None else []
    process = subprocess.Popen(
        [*(prefix or []), sys.executable, "-m", "sluice.cli", "--log-level", "WARNING", "serve", "--config",
         str(workdir / "config"), *model_args, "--workers", str(workers)],
        cwd=workdir, env=run_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    name = model_name or (model_dir.resolve().name if model_dir else "")
    stack = Stack(base_url=f"http://127.0.0.1:{port}", admin_token=admin_token, model=name, workdir=workdir,
                  record_log=record_log, process=process)
    deadline = time.time() + startup_timeout_s
    try:
        while True:
            if process.poll() is not None:
                raise CLIError(f"`sluice serve` exited with status {process.returncode} during startup:\n"
                               f"{stack.log_tail()}")
            if time.time() > deadline:
                raise CLIError(f"`sluice serve` was not ready within {startup_timeout_s:.0f} s:\n"
                               f"{stack.log_tail()}")
            try:
                ready = httpx.get(f"{stack.base_url}/ready", timeout=5).status_code == 200
                if ready and len(stack.workers()) >= workers:
                    return stack
            except (httpx.HTTPError, CLIError):
                pass
            time.sleep(0.5)
    except BaseException:
        stack.stop()
        raise
