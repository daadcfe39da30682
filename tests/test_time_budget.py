"""Time budgets (lsa_models/engine/routes/budget.py): a radius search or a verdict stopped by its
budget is a prefix of the unbudgeted one (its certified radius at most the unbudgeted one, a
verdict it reaches the same), marked stopped_by_budget with the stage it kept from running; a
budget that never runs out changes nothing; bad budgets are refused (library ValueError, CLI
exit 2). The budgets here run on a counting clock (one tick per look at it), so where a
search stops does not depend on the machine's speed."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from bench.local_models import build, center, export
from lsa_models.engine.routes import budget as budget_mod
from lsa_models.engine.routes import table as routes
from lsa_models.engine.routes.at_radius import decide, decide_all
from lsa_models.engine.routes.budget import Budget, check_time_budget
from lsa_models.engine.routes.certify import RobustnessResult, robustness
from lsa_models.onnx import OnnxModel, load_onnx
from service.cli import app
from service.robustness.verdicts import verdict_json


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> tuple[OnnxModel, Path]:
    path = export(build("mlp", seed=4), tmp_path_factory.mktemp("budget") / "mlp.onnx")
    return load_onnx(path.read_bytes()), path


@pytest.fixture(scope="module")
def searched(mlp: tuple[OnnxModel, Path]) -> tuple[np.ndarray, int, RobustnessResult]:
    """An input, its label and its unbudgeted radius search on the inf-ball."""
    om, _ = mlp
    x0 = center(5).numpy().astype(np.float64)
    label = _label(om, x0)
    return x0, label, robustness(om, x0, label, "inf")


def _label(om: OnnxModel, x0: np.ndarray) -> int:
    with torch.no_grad():
        return int(om.module.with_dtype(torch.float64)(torch.from_numpy(x0)).argmax())


def _ticks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The budgets' clock advances one second per look (a budget of k seconds is spent at
    its k-th look); no walk timed yet, and a first walk predicted to take one look."""
    clock = itertools.count()
    monkeypatch.setattr(budget_mod, "time", SimpleNamespace(monotonic=lambda: float(next(clock))))
    _predict(monkeypatch, 1.0)


def _predict(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """No walk timed yet; the size-based prediction of the first one is `seconds`."""
    monkeypatch.setattr(routes, "_PLAIN_WALK_S", {})
    monkeypatch.setattr(routes, "walk_estimate", lambda om, x: seconds)


def _search(r: RobustnessResult) -> tuple[Any, ...]:
    """What a radius search found (not its timings)."""
    return (r.certified_radius, r.attack_radius, r.certified_by, r.affine_radius,
            r.affine_walks, r.sweep_runs, r.pair_constants, r.margins)


def test_a_budget_stops_the_radius_search_at_a_prefix(
        mlp: tuple[OnnxModel, Path], searched: tuple[np.ndarray, int, RobustnessResult],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each budget's radius is at most the unbudgeted one and grows with the budget; a search
    the budget stopped names the stage it kept from running; one it did not stop is the
    unbudgeted search."""
    om, _ = mlp
    x0, label, full = searched
    assert not full.stopped_by_budget and full.time_budget is None and full.certified_radius > 0
    _ticks(monkeypatch)
    radii, stopped = [], []
    for looks in (1, 3, 6):
        r = robustness(om, x0, label, "inf", time_budget=looks)
        assert r.time_budget == looks and r.certified_radius <= full.certified_radius
        assert r.attack_radius == full.attack_radius  # the attack runs first, whole
        if r.stopped_by_budget:
            assert r.stopped_before is not None
            stopped.append(r.certified_radius)
        else:
            assert r.stopped_before is None and _search(r) == _search(full)
        radii.append(r.certified_radius)
    assert radii == sorted(radii)
    assert stopped[0] == 0.0  # the first look: before the affine walks
    assert any(0 < s < full.certified_radius for s in stopped)  # the radius found so far


def test_a_budget_stops_a_verdict_at_a_prefix(
        mlp: tuple[OnnxModel, Path], searched: tuple[np.ndarray, int, RobustnessResult],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At a radius each route certifies, one only the sweep certifies and one the attack
    flips: every budget gives the unbudgeted verdict or unknown, stopped_by_budget, with the
    reason naming the step it kept from running."""
    om, _ = mlp
    x0, label, r = searched
    assert r.attack_radius is not None
    for radius in (0.5 * r.affine_radius, r.certified_radius * 0.999, 1.05 * r.attack_radius):
        full = decide(om, x0, label, "inf", radius)
        assert full.status in ("certified", "attacked") and not full.stopped_by_budget
        assert full.reason is None
        with monkeypatch.context() as m:
            _ticks(m)
            for looks in (1, 2, 3, 5, 8):
                v = decide(om, x0, label, "inf", radius, time_budget=looks)
                if v.stopped_by_budget:
                    assert v.status == "unknown" and v.reason is not None
                    # spent, or the next step's predicted time would not fit
                    assert v.reason.startswith(f"the time budget ({looks:g} s) ")
                    assert v.walks <= full.walks and v.sweep_runs <= full.sweep_runs
                else:
                    assert (v.status, v.certified_by, v.flip_distance) == \
                        (full.status, full.certified_by, full.flip_distance)
                    if v.status == "attacked":  # the attack first: no walk before it
                        assert v.walks == v.sweep_runs == 0
                    else:
                        assert (v.walks, v.sweep_runs) == (full.walks, full.sweep_runs)


def test_tiny_and_generous_budgets_on_the_clock(
        mlp: tuple[OnnxModel, Path], searched: tuple[np.ndarray, int, RobustnessResult]
        ) -> None:
    """A budget spent before the search starts: radius 0 and unknown, stopped by it, and the
    calls return; a budget that does not run out gives the unbudgeted answers."""
    om, _ = mlp
    x0, label, full = searched
    tiny = robustness(om, x0, label, "inf", time_budget=1e-9)
    assert tiny.stopped_by_budget and tiny.certified_radius == 0.0
    assert tiny.stopped_before == "the affine walks"
    generous = robustness(om, x0, label, "inf", time_budget=3600)
    assert not generous.stopped_by_budget and _search(generous) == _search(full)
    radius = 0.5 * full.certified_radius
    v = decide(om, x0, label, "2", radius, time_budget=1e-9)
    assert v.status == "unknown" and v.stopped_by_budget and v.walks == 0
    assert v.reason == "the time budget (1e-09 s) ran out before the attack"
    assert v.stopped_before == "the attack" and v.proven_radius == 0.0
    assert decide(om, x0, label, "inf", radius, time_budget=3600).status == \
        decide(om, x0, label, "inf", radius).status == "certified"


def test_a_set_reports_each_input_the_budget_stopped(mlp: tuple[OnnxModel, Path]) -> None:
    om, _ = mlp
    xs = np.stack([center(s).numpy().astype(np.float64)[0] for s in (5, 6, 7)])
    labels = np.array([_label(om, x[None]) for x in xs])
    rep = decide_all(om, xs, labels, "inf", 0.01, time_budget=1e-9)
    assert rep.time_budget == 1e-9 and rep.count("unknown") == 3
    assert all(v.stopped_by_budget and v.reason is not None for v in rep.verdicts)
    with pytest.raises(ValueError, match="time_budget must be a finite number of seconds"):
        decide_all(om, xs, labels, "inf", 0.01, time_budget=-1.0)


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, math.nan, math.inf, "5", True])
def test_bad_budgets_are_refused(mlp: tuple[OnnxModel, Path], bad: Any) -> None:
    om, _ = mlp
    x0 = center(5).numpy().astype(np.float64)
    with pytest.raises(ValueError, match="time_budget must be a finite number of seconds"):
        check_time_budget(bad)
    with pytest.raises(ValueError, match="time_budget must be"):
        decide(om, x0, _label(om, x0), "inf", 0.01, time_budget=bad)
    with pytest.raises(ValueError, match="time_budget must be"):
        robustness(om, x0, _label(om, x0), "inf", time_budget=bad)


def test_budget_records_the_first_stage_it_stopped() -> None:
    b = Budget.start(None)
    assert not b.out("a", cost=1e9) and not b.stopped and b.reason() is None
    spent = Budget(deadline=-math.inf, seconds=2.0)
    assert spent.out("the sweep") and spent.out("later") and spent.stopped
    assert spent.reason() == "the time budget (2 s) ran out before the sweep"
    ahead = Budget.start(60.0)
    assert not ahead.out("a walk", cost=1.0) and ahead.out("the walk", cost=100.0)
    assert ahead.reason() == ("the time budget (60 s) would run out in the walk (predicted "
                              "100 s)")


def test_a_set_predicts_an_inputs_first_walk_from_the_last(
        mlp: tuple[OnnxModel, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a budget, the plain walk of the graph's last input predicts the next input's:
    a walk that would not fit is not started."""
    om, _ = mlp
    x0 = center(5).numpy().astype(np.float64)
    label = _label(om, x0)
    _ticks(monkeypatch)
    first = decide(om, x0, label, "inf", 1e-4, time_budget=1000)
    assert first.status == "certified" and first.certified_by == "affine"
    slow = routes._PLAIN_WALK_S[id(om)]
    monkeypatch.setitem(routes._PLAIN_WALK_S, id(om), (slow[0], 5000.0))
    v = decide(om, x0, label, "inf", 1e-4, time_budget=1000)
    assert v.status == "unknown" and v.walks == 0 and v.reason is not None
    assert v.reason.startswith("the time budget (1000 s) would run out in the affine walk")
    assert v.stopped_before == "the affine walk"


def _walks_cost(monkeypatch: pytest.MonkeyPatch, seconds: float) -> list[float]:
    """A clock that only the affine walks move, each plain walk by `seconds` (the attack
    and the sweep free); its reading, [now]."""
    now = [0.0]
    monkeypatch.setattr(budget_mod, "time", SimpleNamespace(monotonic=lambda: now[0]))
    plain = routes.AFFINE_STAGES[0]

    def walk(*args: Any, **kw: Any) -> Any:
        now[0] += seconds
        return plain.run(*args, **kw)

    monkeypatch.setattr(routes, "AFFINE_STAGES",
                        (replace(plain, run=walk), *routes.AFFINE_STAGES[1:]))
    return now


def test_a_walk_predicted_past_the_budget_is_not_started(
        mlp: tuple[OnnxModel, Path], searched: tuple[np.ndarray, int, RobustnessResult],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first walk's size-based prediction decides whether it starts: where it fits, the
    verdict is the unbudgeted one and ends within the budget; where it does not, unknown at
    once, naming the walk and its predicted time, nothing certified; the attack ran first."""
    om, _ = mlp
    x0, label, r = searched
    radius = 0.5 * r.affine_radius
    assert decide(om, x0, label, "inf", radius).certified_by == "affine"
    now = _walks_cost(monkeypatch, 3.0)
    _predict(monkeypatch, 3.0)
    v = decide(om, x0, label, "inf", radius, time_budget=4.0)
    assert (v.status, v.certified_by, v.walks, now[0]) == ("certified", "affine", 1, 3.0)
    now[0] = 0.0
    _predict(monkeypatch, 3.0)
    v = decide(om, x0, label, "inf", radius, time_budget=2.0)
    assert (v.status, v.walks, v.sweep_runs, now[0]) == ("unknown", 0, 0, 0.0)
    assert v.stopped_by_budget and v.stopped_before == "the affine walk"
    assert v.reason == "the time budget (2 s) would run out in the affine walk (predicted 3 s)"
    assert v.proven_radius == 0.0 and v.certified_by is None
    out = verdict_json(v)  # a set report's line says the same
    assert (out["stopped_by_budget"], out["stopped_before"], out["proven_radius"]) == (
        True, "the affine walk", 0.0)
    # an input the attack flips is answered though no walk fits
    _predict(monkeypatch, 3.0)
    assert r.attack_radius is not None
    a = decide(om, x0, label, "inf", 1.05 * r.attack_radius, time_budget=2.0)
    assert (a.status, a.walks, now[0]) == ("attacked", 0, 0.0)
    # the radius search: no walk started, radius 0
    _predict(monkeypatch, 3.0)
    s = robustness(om, x0, label, "inf", time_budget=2.0)
    assert (s.certified_radius, s.affine_walks, s.sweep_runs, now[0]) == (0.0, 0, 0, 0.0)
    assert s.stopped_by_budget and s.stopped_before == "the affine walks"


def test_a_sweep_run_predicted_past_the_budget_is_not_started(
        mlp: tuple[OnnxModel, Path], searched: tuple[np.ndarray, int, RobustnessResult],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep's run at the centre predicts nothing: its runs on balls are predicted as
    SWEEP_RUN_COST plain walks until one is timed; where that would not fit, unknown before
    them, else the unbudgeted verdict."""
    om, _ = mlp
    x0, label, r = searched
    radius = r.certified_radius * 0.999
    full = decide(om, x0, label, "inf", radius)
    assert full.certified_by == "sweep"
    now = _walks_cost(monkeypatch, 1.0)  # each plain walk 1 s; the sweep's runs free
    _predict(monkeypatch, 1.0)
    tight = 1.0 + routes.SWEEP_RUN_COST - 0.5
    v = decide(om, x0, label, "inf", radius, time_budget=tight)
    assert (v.status, v.walks, v.sweep_runs, now[0]) == ("unknown", 1, 1, 1.0)
    assert v.stopped_before == "the radius sweep's runs"
    assert v.reason == (f"the time budget ({tight:g} s) would run out in the radius sweep's "
                        f"runs (predicted {routes.SWEEP_RUN_COST:g} s)")
    now[0] = 0.0
    _predict(monkeypatch, 1.0)
    v = decide(om, x0, label, "inf", radius, time_budget=tight + 1.0)
    assert (v.status, v.certified_by, v.sweep_runs) == ("certified", "sweep", full.sweep_runs)


def test_the_walk_estimate_counts_the_forms_entries(mlp: tuple[OnnxModel, Path]) -> None:
    """The size-based estimate: WALK_ENTRY_S per entry of each computed tensor per input
    entry (the coefficients the walk's forms carry), whatever the input's values."""
    om, _ = mlp
    x0 = center(5).numpy().astype(np.float64)
    g = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        env = g.run_env(torch.from_numpy(x0))
    computed = [v for k, v in env.items() if k not in g.consts and v.is_floating_point()]
    assert len(computed) > 2
    want = routes.WALK_ENTRY_S * x0.size * sum(v.numel() for v in computed)
    assert routes.walk_estimate(om, x0) == pytest.approx(want, rel=1e-12)
    assert routes.walk_estimate(om, 3 * x0) == routes.walk_estimate(om, x0)


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "abc", "1e9", ""])
def test_cli_bad_time_budget_exits_2(mlp: tuple[OnnxModel, Path], tmp_path: Path,
                                     value: str) -> None:
    _, path = mlp
    np.save(tmp_path / "x0.npy", center(5).numpy())
    res = CliRunner().invoke(app, ["robustness", str(path), "--at", str(tmp_path / "x0.npy"),
                                   "--label", "0", "--time-budget", value])
    assert res.exit_code == 2 and "--time-budget must be a number of seconds > 0" in \
        res.stderr, res.output


def test_cli_budget_in_json_and_text(mlp: tuple[OnnxModel, Path], tmp_path: Path) -> None:
    """The budget and what it stopped in the JSON and the text of each mode; `none` is no
    budget."""
    om, path = mlp
    xs = np.stack([center(s).numpy().astype(np.float64)[0] for s in (5, 6)])
    labels = np.array([_label(om, x[None]) for x in xs])
    np.save(tmp_path / "x0.npy", xs[0])
    np.save(tmp_path / "xs.npy", xs)
    np.save(tmp_path / "ys.npy", labels)
    run = CliRunner().invoke
    one = ["robustness", str(path), "--at", str(tmp_path / "x0.npy"), "--label",
           str(labels[0]), "--norm", "inf"]
    out = json.loads(run(app, [*one, "--time-budget", "1e-9", "--json"]).stdout)
    assert out["stopped_by_budget"] is True and out["time_budget_s"] == 1e-9
    assert out["certified_radius"] == 0.0 and out["stopped_before"] == "the affine walks"
    text = run(app, [*one, "--time-budget", "1e-9"])
    assert text.exit_code == 0, text.output
    assert "stopped by the time budget (1e-09 s) before the affine walks" in text.stdout
    free = json.loads(run(app, [*one, "--radius", "1e-4", "--time-budget", "none",
                                "--json"]).stdout)
    assert free["time_budget_s"] is None and free["stopped_by_budget"] is False
    assert free["status"] == "certified" and free["reason"] is None
    at = json.loads(run(app, [*one, "--radius", "0.01", "--json", "--time-budget",
                              "1e-9"]).stdout)
    assert at["status"] == "unknown" and at["stopped_by_budget"] is True
    assert at["reason"].startswith("the time budget (1e-09 s) ran out")
    printed = run(app, [*one, "--radius", "0.01", "--time-budget", "1e-9"]).stdout
    assert "unknown (the time budget (1e-09 s) ran out before the attack)" in printed
    many = ["robustness", str(path), "--inputs", str(tmp_path / "xs.npy"), "--labels",
            str(tmp_path / "ys.npy"), "--radius", "0.01", "--norm", "inf", "--time-budget",
            "1e-9"]
    res = run(app, [*many, "--json"])
    s = json.loads(res.stdout)
    assert s["time_budget_s"] == 1e-9 and s["stopped_by_budget"] == 2
    assert [x["reason"] for x in s["samples"]] == [
        "the time budget (1e-09 s) ran out before the attack"] * 2
    assert "input 1/2: unknown (stopped by the time budget)" in res.stderr
    assert "(2 unknown when the time budget of 1e-09 s per input ran out)" in \
        run(app, many).stdout
