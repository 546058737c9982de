"""The package layout: one import path per file, the lab apart from the product."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SRC = ROOT / "src"


def _tracked() -> list[str]:
    done = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def test_no_symlinks_are_tracked() -> None:
    # A symbolic link gives every file under it a second import path (mode 120000 in git's index).
    assert [line for line in _tracked() if line.startswith("120000")] == []


def test_the_repository_root_holds_no_python_package() -> None:
    # Packages live under src/: with the root on sys.path (pytest, `python -m`) none of ours can shadow
    # an installed one (transformers imports the PyPI package `kernels`, say).
    assert sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()) == []
    assert sorted(p.name for p in SRC.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and not p.name.endswith(".egg-info")) == ["sluice", "sluice_lab"]


def test_the_product_never_imports_the_lab() -> None:
    offenders = []
    for path in (SRC / "sluice").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(SRC)}: {n}" for n in names if n.split(".")[0] == "sluice_lab"]
    assert offenders == []


def test_transformers_models_import_with_the_root_first_on_sys_path() -> None:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "from transformers import Qwen2ForCausalLM; import sluice.kernels.ops"
    )
    done = subprocess.run([sys.executable, "-c", code, str(ROOT)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
