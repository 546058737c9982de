"""The child processes `sluice serve` owns: local workers and, with `--replicas`, gateway replicas.

Each child runs in its own process group (so stopping it stops anything it started), writes its
output to a log file under var/logs, and is restarted with backoff when it dies (`restart_delay`);
a child that ran for `HEALTHY_RUN_S` before dying starts the backoff over, and one that exited 0
(a replica drained on SIGTERM) is started again at once. `restart` stops and starts one child
on purpose (a rolling restart of the replicas, gateway/launch/replicas.py). Secrets reach children
through their environment, never their command line (`ps` shows it) or a log. Children also exit
by themselves when `serve` is gone (`--exit-with-parent`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sluice.settings import ModelSpec, Settings

log = logging.getLogger(__name__)

RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0)
# A child that ran this long before dying was healthy: its next restart starts the backoff over.
HEALTHY_RUN_S = 60.0


def restart_delay(restarts: int, uptime_s: float) -> tuple[float, int]:
    """(delay before the next start, the restart count after it) for a child that died after
    `uptime_s` seconds with `restarts` restarts behind it."""
    if uptime_s >= HEALTHY_RUN_S:
        restarts = 0
    return RESTART_BACKOFF_S[min(restarts, len(RESTART_BACKOFF_S) - 1)], restarts + 1


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """How to (re)start one child: `sluice` arguments after `python -m sluice.cli`, and its environment."""

    args: tuple[str, ...]
    env: dict[str, str]


@dataclass
class ChildProcesses:
    """Children of one kind ("worker", "replica"), by id: started, supervised, stopped together."""

    kind: str
    log_dir: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _specs: dict[str, ChildSpec] = field(default_factory=dict)
    _restarts: dict[str, int] = field(default_factory=dict)
    _started_at: dict[str, float] = field(default_factory=dict)
    _restarting: set[str] = field(default_factory=set)  # restarted on purpose (`restart`): not supervised now
    _stopping: bool = False

    def log_path(self, child_id: str) -> Path:
        return self.log_dir / f"{self.kind}-{child_id}.log"

    def start(self, child_id: str, spec: ChildSpec) -> None:
        self._specs[child_id] = spec
        self._spawn(child_id)

    def _spawn(self, child_id: str) -> None:
        spec = self._specs[child_id]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path(child_id), "ab")  # noqa: SIM115
        try:
            self.processes[child_id] = subprocess.Popen(
                [sys.executable, "-m", "sluice.cli", *spec.args],
                env=spec.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own group: we stop it (and anything it starts) as a whole
            )
        finally:
            out.close()
        self._started_at[child_id] = time.monotonic()
        log.info("started %s %s (pid %d)", self.kind, child_id, self.processes[child_id].pid)

    async def supervise(self) -> None:
        """Restarts a child that died (with backoff), until `stop()`."""
        while not self._stopping:
            await asyncio.sleep(1.0)
            for child_id, process in list(self.processes.items()):
                code = process.poll()
                if code is None or self._stopping or child_id in self._restarting:
                    continue
                uptime = time.monotonic() - self._started_at.get(child_id, time.monotonic())
                if code == 0:
                    # A clean exit (a replica drained on someone's SIGTERM) is no crash: start it
                    # again at once, and its backoff over.
                    log.warning("%s %s exited cleanly after %.0fs; starting it again (log %s)",
                                self.kind, child_id, uptime, self.log_path(child_id))
                    self._restarts[child_id] = 0
                    self._spawn(child_id)
                    continue
                delay, self._restarts[child_id] = restart_delay(self._restarts.get(child_id, 0), uptime)
                log.warning("%s %s exited with code %s after %.0fs; restarting in %.0fs (restart #%d; log %s)",
                            self.kind, child_id, code, uptime, delay, self._restarts[child_id],
                            self.log_path(child_id))
                await asyncio.sleep(delay)
                if not self._stopping:
                    self._spawn(child_id)

    def restart(self, child_id: str, grace_s: float) -> int | None:
        """Stops one child on purpose and starts it again (a rolling restart): SIGTERM (a replica
        drains), SIGKILL if it is still there after `grace_s`, then a new start; the supervisor
        leaves it alone meanwhile. Returns the old process's exit code (None: it was killed).
        Blocking: call it in a thread."""
        self._restarting.add(child_id)
        try:
            process = self.processes[child_id]
            code = _terminate(process, signal.SIGTERM, grace_s)
            if not self._stopping:
                self._restarts[child_id] = 0
                self._spawn(child_id)
            return code
        finally:
            self._restarting.discard(child_id)

    def stop(self, grace_s: float = 5.0, sig: signal.Signals = signal.SIGTERM) -> None:
        """`sig` to every child's group (SIGTERM: replicas drain; SIGINT: they stop at once),
        SIGKILL to those still there after `grace_s`."""
        self._stopping = True
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
        for process in self.processes.values():
            _terminate(process, None, grace_s)


def _terminate(process: subprocess.Popen[bytes], sig: signal.Signals | None, grace_s: float) -> int | None:
    """`sig` (if any) to the process's group, SIGKILL after `grace_s`; its exit code, None if killed."""
    if sig is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
    try:
        return process.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(grace_s)
        return None


class LocalWorkers:
    """`count` worker processes per configured model, each linked to every given gateway address."""

    def __init__(self, settings: Settings, count: int, device: str, log_dir: Path) -> None:
        self.settings = settings
        self.count = count
        self.device = device
        self.children = ChildProcesses("worker", log_dir)

    @property
    def processes(self) -> dict[str, subprocess.Popen[bytes]]:
        return self.children.processes

    def spawn_all(self, worker_ports: Sequence[int], secret: str) -> None:
        host = self.settings.gateway.worker_host
        gateways = ",".join(f"{host}:{port}" for port in worker_ports)
        env = self._environment(secret)
        for model in self.settings.models:
            for i in range(self.count):
                worker_id = f"local-{model.name}-{i}" if len(self.settings.models) > 1 else f"local-{i}"
                self.children.start(worker_id, ChildSpec(self._args(model, worker_id, gateways), env))

    def _args(self, model: ModelSpec, worker_id: str, gateways: str) -> tuple[str, ...]:
        args = ["worker", "--model", model.path, "--served-model-name", model.name, "--gateway", gateways,
                "--worker-id", worker_id, "--device", self.device, "--exit-with-parent"]
        # The worker reads the same settings itself (the environment is inherited): [engine] included.
        config_dir = Path(self.settings.config_dir)
        if config_dir.is_dir():
            args += ["--config", str(config_dir.resolve())]
        return tuple(args)

    def _environment(self, secret: str) -> dict[str, str]:
        """CPU workers share the machine with the gateway: unless the operator chose a thread count,
        leave one core to the gateway and split the rest between the local workers (torch's
        default of every core per process made engine steps 10-60x slower under contention)."""
        env = {k: v for k, v in os.environ.items() if k != "SLUICE_ADMIN_TOKEN"}  # workers never need it
        env["SLUICE_GATEWAY_WORKER_SECRET"] = secret
        if self.device == "cpu" and "OMP_NUM_THREADS" not in env:
            workers = max(1, self.count * len(self.settings.models))
            env["OMP_NUM_THREADS"] = str(max(1, ((os.cpu_count() or 1) - 1) // workers))
        return env

    async def supervise(self) -> None:
        await self.children.supervise()

    def stop(self, grace_s: float = 5.0) -> None:
        self.children.stop(grace_s)
