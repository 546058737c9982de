"""Building and loading sluice's native CPU kernels (C++ through torch's extension loader).

Each kernel is one C++ file in kernels/csrc/ (shipped in the package), named by the `NativeKernel`
of the Python module that calls into it. It is compiled with `-O3 -march=native`, so its binary
fits one CPU model: it is cached under a key of the CPU (model name and feature flags), torch's
version, the compiler flags and the text of the .cpp file, in SLUICE_KERNEL_CACHE or
~/.cache/sluice/kernels. A home directory shared by machines with different CPUs then holds one
binary per CPU, and an edited .cpp builds afresh.

Warnings are on (`-Wall -Wextra`; torch's headers are system includes, so only our code warns);
SLUICE_KERNEL_WERROR=1 makes them errors (tests/kernels/conftest.py sets it, so the kernel tests
fail on any warning). A build that fails keeps the compiler's output in `NativeKernel.last_failure`.

The compile always runs in a separate, niced process (`python -m sluice.kernels.cpu_build
<module>`), in a fresh temporary directory beside the target, and moves the finished module into
place with one rename: an engine process never compiles, never waits on torch's build lock (a
stale one left by a killed build once stalled an engine step until its heartbeats were missed),
and never sees a half-written module. Two builders of one kernel serialise on an flock, which
the kernel releases when its holder dies. `NativeKernel.ready()`, what an engine asks before
using a kernel, only imports an already built module (importlib, not the extension loader).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# -fopenmp: ATen's `at::parallel_for` is a header template whose OpenMP backend is a `#pragma omp
# parallel` compiled into the extension itself; without the flag the pragma is dropped and every
# parallel_for runs on one thread (measured: 2 threads then ran the decode kernel no faster than
# one; with it, 1.8-2.1x). The module links libgomp.so.1 by soname, so inside a torch process it
# binds to the libgomp torch has already loaded: one OpenMP runtime and one thread pool.
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fopenmp", "-Wall", "-Wextra")
LINK_FLAGS = ("-fopenmp",)
WERROR_SWITCH = "SLUICE_KERNEL_WERROR"  # "1": warnings are errors
CSRC = Path(__file__).resolve().parent / "csrc"  # the kernels' C++ files
_BUILD_TIMEOUT_S = 1800  # a build takes ~20 s of CPU; minutes of wall time on a loaded machine
_LOOK_EVERY_S = 1.0  # how often ready() looks for a module a build may have finished meanwhile


def compile_flags() -> tuple[str, ...]:
    """COMPILE_FLAGS, with -Werror where SLUICE_KERNEL_WERROR=1 (read at each call: the flags are
    part of the cache key, and a test session sets the switch after this module is imported)."""
    return COMPILE_FLAGS + (("-Werror",) if os.environ.get(WERROR_SWITCH) == "1" else ())


def missing_tools() -> list[str]:
    """What a build needs and this machine lacks: the C++ compiler torch's loader calls (CXX, or
    c++) and ninja. Empty where a build can run."""
    compiler = (os.environ.get("CXX") or "c++").split()[0]  # "ccache g++" runs ccache
    return [tool for tool in (compiler, "ninja") if shutil.which(tool) is None]


def cache_root() -> Path:
    return Path(os.environ.get("SLUICE_KERNEL_CACHE") or Path.home() / ".cache" / "sluice" / "kernels")


def cpu_key() -> str:
    """What a -march=native binary depends on: the CPU model and its feature flags."""
    model, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name" and not model:
                model = value.strip()
            elif name.strip() in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    return f"{platform.machine()}|{model}|{flags}"


class NativeKernel:
    """One C++ kernel module: where it is cached, how it is built, and the loaded module."""

    def __init__(self, name: str, source: Path, defined_in: str, switch: str,
                 entry_points: tuple[str, ...]) -> None:
        self.name = name  # the extension's module name (its PyInit_ symbol)
        self.source = source  # the .cpp file, one translation unit (usually CSRC / "<kernel>.cpp")
        self.defined_in = defined_in  # the Python module holding this object, for the build process
        self.switch = switch  # environment variable; "0" turns the kernel off
        # The functions of `defined_in` that call into the module (bench/profile_engine labels them).
        self.entry_points = entry_points
        self.module: Any | None = None
        self.last_failure: str | None = None  # what the last build of this process printed, if it failed
        self._failed: Path | None = None  # a built file that would not load: not retried
        self._next_look = 0.0
        self._building: threading.Thread | None = None

    @property
    def disabled(self) -> bool:
        return os.environ.get(self.switch, "1") == "0"

    def path(self) -> Path:
        # The .cpp is read at each call (a few KiB; `ready` asks at most once a second until the
        # kernel is loaded): an edited file moves the key, so it builds afresh.
        flags = " ".join(compile_flags() + LINK_FLAGS)
        key = "\n".join([cpu_key(), torch.__version__, sys.version, flags, self.source.read_text()])
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        return cache_root() / f"{self.name}-{digest}" / f"{self.name}.so"

    def ready(self) -> bool:
        """Loaded, or built (by any process of this machine) and loaded now. Never compiles."""
        if self.disabled:
            return False
        if self.module is not None:
            return True
        now = time.monotonic()
        if now < self._next_look:
            return False
        self._next_look = now + _LOOK_EVERY_S
        path = self.path()
        if path == self._failed or not path.is_file():
            return False
        try:
            spec = importlib.util.spec_from_file_location(self.name, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except Exception as exc:  # built for another torch, or damaged
            log.warning("native kernel %s at %s could not be loaded, using the torch path: %s", self.name, path, exc)
            self._failed = path
            return False
        self.module = module
        log.info("native kernel %s loaded from %s", self.name, path)
        return True

    def build(self) -> bool:
        """Builds the kernel if it is not built yet (a compile of a minute or more), waiting for
        it, then loads it; False, with a warning, where it cannot be built."""
        if self.disabled:
            return False
        if not self.ready() and not self.path().is_file():
            self._compile()
        self._next_look = 0.0
        return self.ready()

    def build_in_background(self) -> None:
        """Starts the build in a background thread (its compile in a niced child process) unless
        the kernel is off, built or being built; the torch path runs until it is ready."""
        if self.disabled or self.ready() or self.path().is_file() or self._building is not None:
            return
        log.info("building native kernel %s in the background (a C++ compile, minutes on a busy machine); "
                 "the torch path runs until it is ready", self.name)
        self._building = threading.Thread(target=self._compile, name=f"build-{self.name}", daemon=True)
        self._building.start()

    def _compile(self) -> None:
        started = time.monotonic()
        missing = missing_tools()
        if missing:
            self.last_failure = f"not found on PATH: {', '.join(missing)}"
            log.warning("native kernel %s not built, using the torch path: %s", self.name, self.last_failure)
            return
        try:
            done = subprocess.run([sys.executable, "-m", "sluice.kernels.cpu_build", self.defined_in],
                                  capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self.last_failure = str(exc)
            log.warning("native kernel %s not built, using the torch path: %s", self.name, exc)
            return
        if done.returncode != 0:
            self.last_failure = (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
            log.warning("native kernel %s not built, using the torch path: %s", self.name,
                        _first_error(self.last_failure))
            return
        self.last_failure = None
        log.info("native kernel %s built in %.0f s: %s", self.name, time.monotonic() - started, self.path())


def _first_error(output: str) -> str:
    """The line of a failed build's output worth a log line: the compiler's first error (a Python
    traceback of torch's loader ends with ninja's "build stopped"), else the last line."""
    lines = output.splitlines() or [output]
    return next((line for line in lines if "error:" in line), lines[-1])


def _build_here(kernel: NativeKernel) -> None:
    """The build process: compile into a fresh directory, import it once, move it into place."""
    from torch.utils.cpp_extension import load

    target = kernel.path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        if target.is_file():
            return  # another builder finished while this one waited
        for stale in target.parent.glob("build-*"):  # left by a builder killed with its worker
            shutil.rmtree(stale, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(prefix="build-", dir=target.parent))
        try:
            # From the .cpp where it lies, so the compiler's messages name that file and its lines.
            load(name=kernel.name, sources=[str(kernel.source)], build_directory=str(scratch),
                 extra_cflags=list(compile_flags()), extra_ldflags=list(LINK_FLAGS), verbose=False)
            if kernel.path() != target:  # the .cpp was edited meanwhile: the binary may be of either text
                raise RuntimeError(f"{kernel.source} changed during its build; not installed, build again")
            os.replace(scratch / f"{kernel.name}.so", target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description="build one of sluice's native CPU kernels")
    parser.add_argument("module", help="the Python module whose KERNEL to build, e.g. sluice.kernels.cpu_decode")
    args = parser.parse_args()
    kernel = importlib.import_module(args.module).KERNEL
    if not isinstance(kernel, NativeKernel):
        raise SystemExit(f"{args.module}.KERNEL is not a NativeKernel")
    os.nice(10)  # an engine on the same cores keeps the priority
    _build_here(kernel)
    return 0


if __name__ == "__main__":
    # Through the package, so NativeKernel is the class the kernel modules import (not __main__'s).
    from sluice.kernels import cpu_build

    sys.exit(cpu_build.main())
