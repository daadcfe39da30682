"""The zoo's session state: every case is built and exported once (session-scoped tmp dir),
its lower bound computed once per model, and every outcome recorded; at the end of the
session the outcomes go to bench/out/zoo.json and bench/out/zoo.md (`python -m tests.zoo.table`
turns a full run into docs/supported-models.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import tv_schemas  # noqa: F401  (before anything imports timm/transformers)
from .cases import Built, Case
from .harness import Outcome, export, lower_bound, run_lsa
from .table import OUT_DIR, write_outputs


class Zoo:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.built: dict[str, Built] = {}
        self.files: dict[tuple[str, str], Path] = {}
        self.lowers: dict[str, float] = {}
        self.outcomes: dict[tuple[str, str, str], Outcome] = {}

    def build(self, case: Case) -> Built:
        if case.key not in self.built:
            self.built[case.key] = case.build()
        return self.built[case.key]

    def file(self, case: Case, exporter: str) -> Path:
        key = (case.key, exporter)
        if key not in self.files:
            safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in case.key)
            self.files[key] = export(self.build(case), exporter,
                                     self.root / f"{safe}-{exporter}.onnx")
        return self.files[key]

    def lower(self, case: Case) -> float:
        """One lower bound per model: its layouts and exports compute the same function."""
        if case.model not in self.lowers:
            self.lowers[case.model] = lower_bound(self.build(case))
        return self.lowers[case.model]

    def outcome(self, case: Case, exporter: str) -> Outcome:
        key = (case.model, exporter, case.layout)
        if key not in self.outcomes:
            out = run_lsa(case, exporter, self.file(case, exporter))
            if out.verdict == "certified" or case.expected == "certified":
                out.lower = self.lower(case)
            self.outcomes[key] = out
        return self.outcomes[key]


_ZOO: list[Zoo] = []


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Zoo:
    z = Zoo(tmp_path_factory.mktemp("zoo"))
    _ZOO.append(z)
    return z


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _ZOO and _ZOO[0].outcomes:
        write_outputs(list(_ZOO[0].outcomes.values()), OUT_DIR)
