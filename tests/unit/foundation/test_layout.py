"""The repository's root folders never shadow an installed top-level package."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_kernels_at_the_root_is_a_namespace_portion() -> None:
    # transformers imports the PyPI package `kernels`; a regular package at the root would win.
    assert not (ROOT / "kernels" / "__init__.py").exists()


def test_transformers_models_import_with_the_root_first_on_sys_path() -> None:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "from transformers import Qwen2ForCausalLM; import sluice.kernels.ops"
    )
    done = subprocess.run([sys.executable, "-c", code, str(ROOT)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
