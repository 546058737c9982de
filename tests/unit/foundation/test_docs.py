"""The docs' links hold: every relative link in README.md and docs/ reaches a file (and its anchor a
heading), and every `docs/...` path named in the repository's text exists (files moved into
docs/lab/ took their references with them)."""

from __future__ import annotations

import itertools
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOCS_PATH = re.compile(r"docs/[\w./*{},-]+")
HEADING = re.compile(r"^#{1,6} (.+)$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _tracked(*patterns: str) -> list[Path]:
    done = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / line for line in done.stdout.splitlines() if (ROOT / line).is_file()]


def _markdown() -> list[Path]:
    return [p for p in _tracked("README.md", "docs", "bench/*.md") if p.suffix == ".md"]


def _anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_relative_links_reach_their_files_and_headings() -> None:
    broken = []
    for doc in _markdown():
        for target in LINK.findall(FENCE.sub("", doc.read_text(encoding="utf-8"))):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s):, mailto:
            file_part, _, anchor = target.partition("#")
            path = (doc.parent / file_part).resolve() if file_part else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def _expand(pattern: str) -> list[str]:
    """`a-{x,y}.json` -> a-x.json, a-y.json (one brace group at most, as the docs write them)."""
    match = re.search(r"\{([^}]*)\}", pattern)
    if match is None:
        return [pattern]
    return [pattern[:match.start()] + choice + pattern[match.end():] for choice in match.group(1).split(",")]


def test_every_named_docs_path_exists() -> None:
    missing = []
    texts = [p for p in _tracked() if p.suffix in (".md", ".py", ".toml", ".sh", ".yml") or p.name == "Makefile"]
    for path in texts:
        if "docs/lab/results" in str(path.relative_to(ROOT)):
            continue
        for found in set(DOCS_PATH.findall(path.read_text(encoding="utf-8", errors="replace"))):
            name = found.rstrip(".,")
            if name.endswith("/") or "..." in name:
                continue
            candidates = _expand(name)
            exists = [any(ROOT.glob(c)) if "*" in c else (ROOT / c).exists() for c in candidates]
            if not all(exists):
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert missing == []


def test_the_lab_notebook_is_newest_first() -> None:
    notebook = (ROOT / "docs" / "lab" / "notebook.md").read_text(encoding="utf-8")
    dates = re.findall(r"^## (\d{4}-\d{2}-\d{2})", notebook, re.MULTILINE)
    assert len(dates) > 10
    assert all(a >= b for a, b in itertools.pairwise(dates)), dates
