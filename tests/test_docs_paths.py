"""The docs name only things that exist: every repository path and every test named in
README.md and docs/*.md is in the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
# Paths inside the repository start with one of these; anything else (model.safetensors,
# report.json, ./var/...) is an example file name of a user's, not ours.
TOP = ("lsa_models/", "api_schemas/", "service/", "tests/", "bench/", "docs/", "migrations/",
       ".ci/")
GENERATED = ("bench/out/",)  # written by the benchmarks, ignored by git
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOP) + r")[\w./-]*)")
TEST_REF = re.compile(r"(tests/[\w/]+\.py)::(test_\w+)")
BARE_TEST = re.compile(r"(?<![\w:/.])(test_\w+)\b(?!\.py)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _mentions(doc: Path) -> tuple[set[str], set[tuple[str, str]], set[str]]:
    text = doc.read_text(encoding="utf-8")
    paths = {m.rstrip(".,:;") for m in PATH.findall(text)}
    tests = set(TEST_REF.findall(text))
    bare = set(BARE_TEST.findall(TEST_REF.sub("", text)))
    for target in LINK.findall(text):
        if "://" not in target:
            rel = (doc.parent / target).resolve().relative_to(ROOT)
            paths.add(str(rel) + ("/" if target.endswith("/") else ""))
    return paths, tests, bare


def _all_test_names() -> set[str]:
    names: set[str] = set()
    for f in (ROOT / "tests").rglob("test_*.py"):
        names.add(f.stem)  # a test module named without its path
        names.update(re.findall(r"^\s*def (test_\w+)", f.read_text(encoding="utf-8"), re.M))
    return names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_paths_exist(doc: Path) -> None:
    paths, _, _ = _mentions(doc)
    missing = sorted(p for p in paths
                     if not p.startswith(GENERATED) and not (ROOT / p).exists())
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_tests_exist(doc: Path) -> None:
    _, tests, bare = _mentions(doc)
    missing = []
    for file, name in sorted(tests):
        source = ROOT / file
        if not source.is_file() or not re.search(rf"^\s*def {name}\b", source.read_text(
                encoding="utf-8"), re.M):
            missing.append(f"{file}::{name}")
    known = _all_test_names()
    missing += sorted(name for name in bare if name not in known)
    assert not missing, f"{doc.name} names tests that do not exist: {missing}"


def test_docs_paths_checker_sees_mentions() -> None:
    """The patterns find what the docs use: a backticked path, a link, a test reference."""
    sample = ROOT / "docs" / "certification.md"
    paths, tests, _ = _mentions(sample)
    assert "lsa_models/bounds/numerics.py" in paths
    assert "docs/theory.md" in paths  # a relative link, resolved from docs/
    assert ("tests/test_bounds_soundness.py",
            "test_causal_l2_mha_bound_never_below_jacobian_norm") in tests
