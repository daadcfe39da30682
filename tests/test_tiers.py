"""The two tiers stay what tests/conftest.py says: every marker it gives is declared, the
Makefile's fast tier deselects exactly those, every slow entry names a test, every test module
keeps a fast test, and no property test sets its own example count without saying why."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

from tests import conftest

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
TIER_MARKERS = {"slow", "zoo", "postgres", "redis", "browser"}


def functions_of(path: Path) -> set[str]:
    """Names of the test functions of a module, at top level or in a Test class."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            names.add(node.name)
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            names |= {f"{node.name}::{f.name}" for f in node.body
                      if isinstance(f, ast.FunctionDef) and f.name.startswith("test")}
    return names


def test_every_tier_marker_is_declared() -> None:
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]["markers"]
    names = {line.split(":", 1)[0] for line in declared}
    assert names >= TIER_MARKERS


def test_the_fast_tier_deselects_every_tier_marker() -> None:
    line = next(line for line in (REPO / "Makefile").read_text().splitlines()
                if line.startswith("FAST_TIER"))
    expr = line.split(":=", 1)[1].strip()
    assert set(re.findall(r"not (\w+)", expr)) == TIER_MARKERS
    assert expr == " and ".join(re.findall(r"not \w+", expr))  # nothing but "not m and ..."


@pytest.mark.parametrize(("nodeid", "fixtures", "want"), [
    ("tests/zoo/test_zoo.py::test_zoo_case[gpt2-dynamo]", (), ["zoo"]),
    ("tests/service/test_api.py::test_upload[postgres]", ("db_url", "pg_migrated"), ["postgres"]),
    ("tests/service/test_x.py::test_y", ("redis_env", "redis_url", "pg_schemas"),
     ["postgres", "redis"]),
    ("tests/service/test_docs_browser.py::test_z", ("sqlite_migrated",), ["browser"]),
    ("tests/service/test_api.py::test_upload[sqlite]", ("db_url",), []),
    ("tests/test_bounds_formulas.py::test_a", ("tmp_path",), []),
])
def test_markers_follow_the_rules(nodeid: str, fixtures: tuple[str, ...],
                                  want: list[str]) -> None:
    assert conftest.markers_for(nodeid, fixtures) == want


def test_a_slow_entry_marks_every_parameter_of_its_test() -> None:
    entry = next(iter(conftest.SLOW_TESTS))
    assert "slow" in conftest.markers_for(f"{entry}[case-1]", ())
    assert "slow" not in conftest.markers_for(f"{entry}_and_more", ())


def test_every_slow_entry_names_a_test() -> None:
    missing = []
    for entry in sorted(conftest.SLOW_TESTS):
        path, name = entry.split("::", 1)
        if not (REPO / path).is_file() or name not in functions_of(REPO / path):
            missing.append(entry)
    assert not missing, f"SLOW_TESTS entries that name no test: {missing}"


def test_every_module_keeps_a_fast_test() -> None:
    """A module whose every test is slow would leave its behaviour out of `make test`."""
    by_module: dict[str, set[str]] = {}
    for entry in conftest.SLOW_TESTS:
        path, name = entry.split("::", 1)
        by_module.setdefault(path, set()).add(name)
    all_slow = [path for path, names in by_module.items()
                if (REPO / path).is_file() and functions_of(REPO / path) <= names]
    assert not set(all_slow) - set(conftest.COVERED_BY), f"modules with no fast test: {all_slow}"
    for path, test in conftest.COVERED_BY.items():
        module, name = test.split("::", 1)
        assert name in functions_of(REPO / module) and test not in conftest.SLOW_TESTS, (
            path, test)


PINNED = re.compile(r"max_examples\s*=(?!=)")


def test_property_tests_take_their_example_count_from_the_profile() -> None:
    """`max_examples` in a test file comes with a comment saying why, on its line or the line
    before; otherwise the profile (fast or full) sets it."""
    unexplained = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.name == "conftest.py" and path.parent == TESTS:
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if PINNED.search(line) and "#" not in line and not (
                    i > 0 and lines[i - 1].lstrip().startswith("#")):
                unexplained.append(f"{path.relative_to(REPO)}:{i + 1}: {line.strip()}")
    assert not unexplained, "example counts without a reason:\n" + "\n".join(unexplained)


def test_the_profile_follows_the_environment() -> None:
    from hypothesis import settings
    assert settings().max_examples == settings.get_profile(conftest.PROFILE).max_examples


def test_a_cap_lowers_the_profile_count_and_never_raises_it() -> None:
    from hypothesis import settings

    from tests.profile import at_most
    count = settings().max_examples
    assert at_most(count + 100) == count and at_most(1) == 1
