"""The code's shape stays readable by a newcomer: no source file over 600 lines, ruff's
complexity limit (15) holds everywhere with no per-file exceptions, and the local engine is a
package of sub-packages whose layering lint-imports checks (docs/local-bounds.md, "Code
layout")."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("lsa_models", "service", "api_schemas")
MAX_LINES = 600


def test_no_source_file_is_over_600_lines() -> None:
    long = {str(p.relative_to(REPO)): n
            for pkg in SOURCES for p in sorted((REPO / pkg).rglob("*.py"))
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


def test_complexity_limit_has_no_per_file_exceptions() -> None:
    lint = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert lint["mccabe"]["max-complexity"] == 15
    assert "C90" in lint["select"]
    ignored = {code for codes in lint.get("per-file-ignores", {}).values() for code in codes}
    assert not any(code.startswith("C90") for code in ignored)


def test_engine_modules_live_in_the_packages_the_layering_contract_names() -> None:
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"]
    (engine,) = [c for c in contracts if c["id"] == "local-engine"]
    layered = {name.strip() for layer in engine["layers"] for name in layer.split("|")}
    present = {p.stem if p.is_file() else p.name
               for p in (REPO / "lsa_models" / "engine").iterdir()
               if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").is_file())}
    assert present == layered
