"""The golden-corpus bench (bench/golden): the recorder on one tiny classifier (every task, its
routes, numbers on the right side of their float64 bounds), the comparer on crafted records
(looser, lost, past a bound -> exit 1; identical and tighter -> 0; bad input -> 2) and the
route table's winners."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from bench.golden import compare, routes
from bench.golden.corpus import Case, _classifier_meta
from bench.golden.record import run_case

N, D, K = 2, 2, 2


def _export_tiny(d: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(1), nn.Linear(N * D, 8), nn.Tanh(), nn.Linear(8, K)).eval()
    torch.onnx.export(model, (torch.randn(1, N, D),), str(d / "model.onnx"), dynamo=False,
                      opset_version=17, input_names=["x"], output_names=["y"])
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(2, 1, N, D, generator=gen).numpy().astype(np.float64)
    return _classifier_meta(d, (d / "model.onnx").read_bytes(), xs, None, source="test")


@pytest.fixture(scope="module")
def tiny_items(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    case = Case("test/tiny", "test", _export_tiny, local=True, radius=True, set=True,
                attack_restarts=1)
    return run_case(case, tmp_path_factory.mktemp("golden"), force=True)


def test_recorder_records_every_task_with_routes_and_bounds(
        tiny_items: list[dict[str, Any]]) -> None:
    by_id = {it["id"]: it for it in tiny_items}
    assert set(by_id) == {f"test/tiny/{t}/{n}" for t in ("global", "local", "radius", "set")
                          for n in ("2", "inf")}
    for norm in ("2", "inf"):
        loc = by_id[f"test/tiny/local/{norm}"]
        assert loc["verdict"] == "certified" and loc["lower"] is not None, loc.get("error")
        assert loc["lower"] <= loc["value"]
        ran = [r for r in loc["routes"] if not r.get("forced")]
        assert {"global", "enclosure"} <= {r["route"] for r in ran}
        # the engine's number is the smallest of its routes'
        assert loc["value"] == min(r["value"] for r in ran if r.get("value") is not None)
        glob = by_id[f"test/tiny/global/{norm}"]
        assert glob["verdict"] == "certified" and glob["value"] >= loc["value"]
        rad = by_id[f"test/tiny/radius/{norm}"]
        assert rad["value"] > 0 and rad["upper"] is not None and rad["value"] <= rad["upper"]
        assert rad["value"] == max(r["value"] for r in rad["routes"]
                                   if r["route"] != "attack" and r.get("value") is not None)
        st = by_id[f"test/tiny/set/{norm}"]
        assert len(st["verdicts"]) == 2 and st["radius"] > 0
        assert all(v["status"] in ("certified", "attacked", "unknown", "misclassified")
                   for v in st["verdicts"])
    table = routes.routes({"label": "t", "items": tiny_items})
    assert not table["mismatched"]
    wins = {(r["task"], r["route"]): r["wins"] for r in table["rows"]}
    assert sum(w for (t, _), w in wins.items() if t == "local") == 2


def _doc(label: str, items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"label": label, "items": items, "wall_seconds": 1.0, "cpu_seconds": 1.0}


def _items() -> list[dict[str, Any]]:
    def it(task: str, kind: str, value: float | None, **kw: Any) -> dict[str, Any]:
        return {"id": f"m/{task}/2", "case": "m", "group": "g", "task": task, "norm": "2",
                "kind": kind, "value": value, "verdict": "certified", "seconds": 1.0,
                "cpu_seconds": 1.0, "model_sha256": "x", "routes": [], **kw}
    return [it("global", "upper", 10.0, lower=1.0), it("local", "upper", 2.0, lower=1.0),
            it("radius", "radius", 0.5, upper=1.0),
            it("set", "set", 1, verdicts=[{"status": "certified"}, {"status": "unknown"}])]


def _run(tmp_path: Path, a: list[dict[str, Any]], b: list[dict[str, Any]]) -> int:
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(_doc("a", a)))
    pb.write_text(json.dumps(_doc("b", b)))
    return compare.main([str(pa), str(pb), "--no-plot"])


def test_compare_identical_and_tighter_pass(tmp_path: Path) -> None:
    assert _run(tmp_path, _items(), _items()) == 0
    res = json.loads((tmp_path / "compare-a-b.json").read_text())
    assert res["numbers"]["identical"] == 3 and res["numbers"]["looser"] == 0
    b = _items()
    b[1]["value"], b[2]["value"] = 1.5, 0.6  # smaller constant, larger radius
    b[3]["verdicts"][1]["status"] = "certified"
    assert _run(tmp_path, _items(), b) == 0
    res = json.loads((tmp_path / "compare-a-b.json").read_text())
    assert res["numbers"]["tighter"] == 2 and res["set_verdicts"]["gained"] == 1


@pytest.mark.parametrize("change", ["looser-upper", "looser-radius", "lost", "below-lower",
                                    "above-attack", "set-lost", "missing"])
def test_compare_fails_on_looser_lost_or_past_a_bound(tmp_path: Path, change: str) -> None:
    b = copy.deepcopy(_items())
    if change == "looser-upper":
        b[1]["value"] = 2.0000001
    elif change == "looser-radius":
        b[2]["value"] = 0.4999
    elif change == "lost":
        b[0].update(value=None, verdict="not_certified")
    elif change == "below-lower":
        b[1]["value"] = 0.5  # tighter, but below the float64 Jacobian norm
    elif change == "above-attack":
        b[2]["value"] = 1.5
    elif change == "set-lost":
        b[3]["verdicts"][0]["status"] = "unknown"
    else:
        b.pop(1)
    assert _run(tmp_path, _items(), b) == 1


def test_compare_bad_input_exits_2(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("{not json")
    (tmp_path / "b.json").write_text(json.dumps(_doc("b", _items())))
    assert compare.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                         "--no-plot"]) == 2


def test_route_table_counts_winners_and_margins() -> None:
    item = {"id": "m/local/inf", "task": "local", "value": 1.0, "seconds": 4.0,
            "cpu_seconds": 4.0, "routes": [
                {"route": "global", "value": 9.0, "seconds": 1.0, "cpu_seconds": 1.0},
                {"route": "enclosure", "value": 1.005, "seconds": 1.0, "cpu_seconds": 1.0},
                {"route": "adjoint", "value": 1.0, "seconds": 2.0, "cpu_seconds": 2.0},
                {"route": "tangent", "value": 0.9, "seconds": 1.0, "cpu_seconds": 1.0,
                 "forced": True}]}
    res = routes.routes({"label": "t", "items": [item]})
    rows = {r["route"]: r for r in res["rows"]}
    assert rows["adjoint"]["wins"] == 1 and rows["adjoint"]["wins_over_margin"] == 0
    assert rows["adjoint"]["share_cpu"] == 0.5
    assert rows["tangent"]["would_win_forced"] == 1 and rows["tangent"]["calls"] == 0
    assert "local/adjoint" in res["win_by_under_margin_only"]
    assert {"local/global", "local/enclosure"} <= set(res["never_win"])
