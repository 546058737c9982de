"""How a native kernel is built (kernels/cpu_build.py): warnings on, errors under SLUICE_KERNEL_WERROR=1,
the compiler's messages kept, and a cache key that follows the .cpp file's text and the flags.

Every kernel of kernels/native.py is built with -Werror by its own test module (test_cpu_decode,
test_cpu_gemv, test_cpu_glue, test_cpu_prefill: the `built` fixture, under conftest.py's
SLUICE_KERNEL_WERROR=1), and a failed build fails them; so no test here builds those again. These
tests build a probe instead: a plain CPython extension (no torch headers, a compile of a second)
with one warning that -Wall reports and one that only -Wextra reports.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from sluice.kernels import cpu_build
from sluice.kernels.cpu_build import NativeKernel

pytestmark = [pytest.mark.kernels, pytest.mark.timeout(300)]

_PROBE_CPP = """\
#include <Python.h>

static int probe(int unused_parameter) {  // -Wextra: unused parameter
  int unused_variable = 0;  // -Wall: unused variable
  return 0;
}

static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "sluice_warning_probe", nullptr, -1, nullptr,
                                 nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PyInit_sluice_warning_probe() { return PyModule_Create(&module_def); }

int probe_used() { return probe(1); }
"""

# What the build process imports (`python -m sluice.kernels.cpu_build probe_kernel`): the same kernel.
_PROBE_MODULE = """\
from pathlib import Path

from sluice.kernels.cpu_build import NativeKernel

KERNEL = NativeKernel("sluice_warning_probe", Path(__file__).with_name("probe.cpp"), __name__,
                      switch="SLUICE_WARNING_PROBE", entry_points=())
"""


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> NativeKernel:
    """The probe kernel, its module importable by the build process, its binary cached in tmp_path."""
    (tmp_path / "probe.cpp").write_text(_PROBE_CPP)
    (tmp_path / "probe_kernel.py").write_text(_PROBE_MODULE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("SLUICE_KERNEL_CACHE", str(tmp_path / "cache"))
    return NativeKernel("sluice_warning_probe", tmp_path / "probe.cpp", "probe_kernel",
                        switch="SLUICE_WARNING_PROBE", entry_points=())


@pytest.fixture
def toolchain() -> None:
    missing = cpu_build.missing_tools()
    if missing:
        pytest.skip(f"no {', '.join(missing)} here")


def test_the_kernel_tests_build_with_warnings_as_errors() -> None:
    """conftest.py sets the switch before any build, so every kernel test module's build has -Werror."""
    assert os.environ.get(cpu_build.WERROR_SWITCH) == "1"
    assert {"-Wall", "-Wextra", "-Werror"} <= set(cpu_build.compile_flags())


@pytest.mark.usefixtures("toolchain")
def test_a_warning_fails_the_build_under_werror(probe: NativeKernel, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """Both warnings (the -Wall one and the -Wextra one) are errors; the build's output names the
    .cpp and its lines, the log line gives the first error, and nothing is installed."""
    monkeypatch.setenv(cpu_build.WERROR_SWITCH, "1")
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert not probe.build()
    assert probe.last_failure is not None
    assert "probe.cpp:4:" in probe.last_failure and "unused-variable" in probe.last_failure
    assert "probe.cpp:3:" in probe.last_failure and "unused-parameter" in probe.last_failure
    assert "probe.cpp:" in caplog.text and "error:" in caplog.text
    assert not probe.path().exists()
    assert probe.module is None


@pytest.mark.usefixtures("toolchain")
def test_without_werror_warnings_do_not_stop_the_build(probe: NativeKernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside the kernel tests (a worker, a bench) the same source builds, is installed and loads."""
    monkeypatch.delenv(cpu_build.WERROR_SWITCH)
    assert probe.build(), probe.last_failure
    assert probe.last_failure is None
    assert probe.path().is_file()
    assert probe.module is not None and probe.module.__name__ == "sluice_warning_probe"


def test_the_cache_key_follows_the_cpp_text_and_werror(probe: NativeKernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edited .cpp, or -Werror on or off, is looked for (and built) under another key; the same
    text and flags find the same binary."""
    monkeypatch.setenv(cpu_build.WERROR_SWITCH, "1")
    strict = probe.path()
    assert probe.path() == strict
    monkeypatch.delenv(cpu_build.WERROR_SWITCH)
    lenient = probe.path()
    assert lenient != strict and lenient.name == strict.name
    probe.source.write_text(_PROBE_CPP + "// an edit\n")
    assert probe.path() not in (strict, lenient)
    probe.source.write_text(_PROBE_CPP)
    assert probe.path() == lenient


def test_a_missing_compiler_is_reported_without_a_build(probe: NativeKernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler: `build` says so (what the `built` fixture skips on), and starts no build process."""
    monkeypatch.setenv("CXX", "sluice-no-such-compiler")
    assert cpu_build.missing_tools()[:1] == ["sluice-no-such-compiler"]
    assert not probe.build()
    assert probe.last_failure is not None
    assert probe.last_failure.startswith("not found on PATH: sluice-no-such-compiler")
    assert not (probe.path().parent / "build.lock").exists()  # the build process would have made it
