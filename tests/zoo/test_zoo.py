"""Every zoo model through lsa: the right verdict, and no certified bound below the float64
Jacobian lower bound (a hard failure, never expected to fail)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .cases import CASES, Case
from .conftest import Zoo
from .table import DOC, doc_verdicts
from .today import TODAY


class WrongVerdict(AssertionError):
    """lsa's verdict is not the right one: the only failure an xfail mark may expect."""


def _params() -> list:  # type: ignore[type-arg]
    out = []
    for case in CASES:
        for exporter in case.exporters:
            reason = TODAY.get((case.model, case.layout, exporter))
            marks = [pytest.mark.xfail(strict=True, raises=WrongVerdict, reason=reason)
                     ] if reason else []
            layout = case.layout.replace(" ", "")
            out.append(pytest.param(case, exporter, id=f"{case.model}-{layout}-{exporter}",
                                    marks=marks))
    return out


@pytest.mark.parametrize(("case", "exporter"), _params())
def test_zoo_model_gets_right_verdict_and_sound_bound(zoo: Zoo, case: Case,
                                                      exporter: str) -> None:
    got = zoo.outcome(case, exporter)
    if got.verdict == "certified":
        # soundness: plain AssertionErrors, which no xfail mark expects
        assert case.expected == "certified", (
            f"UNSOUND: lsa certified {got.upper} for a model whose right verdict is "
            f"{case.expected}")
        assert got.upper is not None and got.lower is not None
        assert got.lower <= got.upper, (
            f"UNSOUND: certified upper {got.upper!r} is below the float64 Jacobian norm "
            f"{got.lower!r} of the torch module")
    if got.verdict != case.expected:
        raise WrongVerdict(f"lsa says {got.verdict} ({got.reason}); the right verdict is "
                           f"{case.expected}")


def test_zoo_table_matches_docs(zoo: Zoo) -> None:
    """docs/supported-models.md lists every zoo case, with the verdicts of this run (for
    the cases the run selected: all of them in CI). Regenerate: `python -m tests.zoo.table`."""
    doc = doc_verdicts(Path(DOC).read_text())
    want = {(c.model, e, c.layout): c.expected for c in CASES for e in c.exporters}
    assert set(doc) == set(want), (
        f"docs/supported-models.md is stale: missing {sorted(set(want) - set(doc))[:5]}, "
        f"extra {sorted(set(doc) - set(want))[:5]}; run `python -m tests.zoo.table`")
    assert {k: v[0] for k, v in doc.items()} == want
    stale = {k: (doc[k][1], o.verdict) for k, o in zoo.outcomes.items()
             if doc[k][1] != o.verdict}
    assert not stale, (f"docs/supported-models.md (doc, run) verdicts differ: {stale}; run "
                       "`python -m pytest tests/zoo && python -m tests.zoo.table`")
