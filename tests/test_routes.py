"""The route tables (lsa_models/engine/routes/table.py): each route once, in the order the tasks
try them, and their errors: a route that does not apply (RouteNotApplicable and the engines'
own "no rule" errors) leaves the other routes' numbers; a fault (KeyError, TypeError, ...)
propagates out of certify_local and decide."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from lsa_models.engine.derived.adjoint import NoAdjoint
from lsa_models.engine.routes import constant as constant_routes
from lsa_models.engine.routes import sweep
from lsa_models.engine.routes import table as routes
from lsa_models.engine.routes.at_radius import decide
from lsa_models.engine.routes.certify import certify_local
from lsa_models.engine.routes.errors import NOT_APPLICABLE, RouteNotApplicable
from lsa_models.onnx import LoadOptions, OnnxModel, load_onnx


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[OnnxModel, np.ndarray, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(1), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).eval()
    x = torch.randn(1, 2, 2, generator=torch.Generator().manual_seed(1))
    path = Path(tmp_path_factory.mktemp("routes")) / "tiny.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["y"])
    om = load_onnx(path.read_bytes(), "tiny.onnx", LoadOptions(check_ort=False))
    x0 = x.double().numpy()
    with torch.no_grad():
        label = int(model.double()(torch.from_numpy(x0)).argmax())
    return om, x0, label


def test_tables_list_each_route_once_in_order() -> None:
    assert [r.name for r in routes.LOCAL_ROUTES] == ["global", "enclosure", "adjoint",
                                                     "tangent"]
    assert [r.name for r in routes.AFFINE_STAGES] == ["affine", "affine-quad", "affine-eig"]
    assert [r.name for r in routes.SWEEP_PASSES] == ["sweep", "sweep-adjoint"]
    plain, quad, eig = routes.AFFINE_STAGES
    assert not plain.options and quad.options == {"quad": True}
    assert eig.options == {"quad": True, "eig": True}
    assert (plain.time_factor, quad.time_factor, eig.time_factor) == (
        1.0, routes.QUAD_WALK_COST, routes.EIG_WALK_COST)
    assert routes.SWEEP_PASSES[1].norms == sweep.ADJOINT_NORMS
    every = routes.LOCAL_ROUTES + routes.AFFINE_STAGES + routes.SWEEP_PASSES
    assert all(r.when and r.cost and r.returns and set(r.norms) <= {"2", "inf"}
               for r in every)


def test_affine_stages_apply_by_norm_and_graph(tiny: tuple[OnnxModel, np.ndarray, int]
                                               ) -> None:
    om, x0, _ = tiny
    # no attention: the second-order walks do not pay, the plain walk alone
    assert [r.name for r in routes.affine_stages(om, x0, "2")] == ["affine"]
    assert [r.name for r in routes.affine_stages(om, x0, "inf")] == ["affine"]


def _with(table: str, name: str, run: Any) -> tuple[routes.Route, ...]:
    return tuple(replace(r, run=run) if r.name == name else r
                 for r in getattr(routes, table))


def _raise(exc: Exception) -> Any:
    def run(*a: Any, **k: Any) -> Any:
        raise exc
    return run


def test_an_enclosure_that_does_not_apply_leaves_the_global_number(
        tiny: tuple[OnnxModel, np.ndarray, int], monkeypatch: pytest.MonkeyPatch) -> None:
    om, x0, _ = tiny
    whole = certify_local(om, x0, 1e-2, "2")
    glob = constant_routes.global_bound(om, "2", x0, 1e-2)
    monkeypatch.setattr(routes, "LOCAL_ROUTES",
                        _with("LOCAL_ROUTES", "enclosure", _raise(RouteNotApplicable("x"))))
    res = certify_local(om, x0, 1e-2, "2")
    assert res.verdict == "certified" and res.upper == glob.upper
    assert whole.upper is not None and glob.upper is not None and whole.upper <= glob.upper


@pytest.mark.parametrize("fault", [KeyError("k"), TypeError("t"), IndexError("i")])
def test_a_fault_in_a_route_propagates(tiny: tuple[OnnxModel, np.ndarray, int],
                                       monkeypatch: pytest.MonkeyPatch,
                                       fault: Exception) -> None:
    om, x0, label = tiny
    monkeypatch.setattr(routes, "LOCAL_ROUTES",
                        _with("LOCAL_ROUTES", "enclosure", _raise(fault)))
    with pytest.raises(type(fault)):
        certify_local(om, x0, 1e-2, "2")
    monkeypatch.setattr(routes, "AFFINE_STAGES",
                        _with("AFFINE_STAGES", "affine", _raise(fault)))
    with pytest.raises(type(fault)):
        decide(om, x0, label, "2", 1e-3, sweep=False)


def test_an_affine_walk_that_does_not_apply_leaves_the_other_steps(
        tiny: tuple[OnnxModel, np.ndarray, int], monkeypatch: pytest.MonkeyPatch) -> None:
    om, x0, label = tiny
    assert decide(om, x0, label, "2", 1e-3).certified_by == "affine"
    monkeypatch.setattr(routes, "AFFINE_STAGES",
                        _with("AFFINE_STAGES", "affine", _raise(RouteNotApplicable("x"))))
    v = decide(om, x0, label, "2", 1e-3)
    assert v.status == "certified" and v.certified_by == "sweep" and v.walks == 1


def test_the_adjoint_route_gives_no_number_where_a_node_has_no_rule(
        tiny: tuple[OnnxModel, np.ndarray, int], monkeypatch: pytest.MonkeyPatch) -> None:
    om, x0, _ = tiny
    assert isinstance(constant_routes.adjoint_bound(om, x0, 1e-2, "inf"), float)
    assert issubclass(NoAdjoint, NOT_APPLICABLE)
    monkeypatch.setattr(constant_routes, "AdjointGraph", _raise(NoAdjoint("no rule")))
    assert constant_routes.adjoint_bound(om, x0, 1e-2, "inf") is None
    monkeypatch.setattr(constant_routes, "AdjointGraph", _raise(KeyError("a fault")))
    with pytest.raises(KeyError):
        constant_routes.adjoint_bound(om, x0, 1e-2, "inf")


def test_output_size_reads_a_graph_without_a_batch_axis(tmp_path: Path) -> None:
    """A graph whose input is (N, D) (no batch axis): the output's size at x is the graph's
    output at x, not the module's forward over x's rows as a batch."""
    class Transposed(nn.Module):  # reads both axes: a row at a time it cannot run
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).transpose(0, 1)

    torch.manual_seed(0)
    model = Transposed().eval()
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    path = tmp_path / "rank2.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["y"])
    om = load_onnx(path.read_bytes(), "rank2.onnx", LoadOptions(check_ort=False))
    assert om.spec.rank == 2
    assert constant_routes.output_size(om, x.double().numpy()) == 15
