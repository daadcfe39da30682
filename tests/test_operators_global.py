"""The global mode of the linear, conv, layout and reduce families (lsa_models/operators/):
on random inputs and weights in float64, each class's Lipschitz constant is at least the exact
operator norm of the Jacobian of its own evaluation (2: spectral norm of the flattened map;
inf: largest absolute row sum), and its token radius at least every output row's 2-norm."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from lsa_models.bounds.layer_graph.values import Value
from lsa_models.operators import ModeNotImplemented
from lsa_models.operators.linear import Refused
from lsa_models.operators.registry import LINEAR_MAPS, global_operator

F64 = torch.float64
SLACK = 1 + 1e-9  # the float64 SVD / sums that give the exact norms


def _norm(j: np.ndarray, norm: str) -> float:
    return float(np.linalg.norm(j, 2)) if norm == "2" else float(np.abs(j).sum(axis=1).max())


@dataclass
class Case:
    """A node of `op` with variable operands `vars` (shapes), constants `consts` (by input
    position) and attributes; `n_out` outputs."""

    op: str
    attrs: dict[str, Any]
    inputs: list[Any]  # ("var", shape) or a constant np.ndarray or None
    n_out: int = 1
    plain: bool = False  # variables are x itself (identity map): the Jacobian is the op's


def _cases(rng: np.random.Generator) -> list[Case]:
    def r(*s: int) -> np.ndarray:
        return rng.standard_normal(s)

    def idx(*a: int) -> np.ndarray:
        return np.asarray(a, dtype=np.int64)

    v = "var"
    return [
        Case("MatMul", {}, [(v, (2, 3, 4)), r(4, 5)], plain=True),
        Case("MatMul", {}, [(v, (2, 3, 4)), r(2, 4, 5)], plain=True),
        Case("MatMul", {}, [r(3, 3), (v, (3, 4))], plain=True),
        Case("Gemm", {"transB": 1, "alpha": 0.7, "beta": 1.3}, [(v, (3, 4)), r(5, 4), r(5)],
             plain=True),
        Case("Add", {}, [(v, (3, 4)), (v, (3, 4))]),
        Case("Add", {}, [(v, (3, 4)), r(4)], plain=True),
        Case("Sub", {}, [r(3, 1), (v, (3, 4))], plain=True),
        Case("Mul", {}, [r(3, 4), (v, (3, 4))], plain=True),
        Case("Div", {}, [(v, (3, 4)), r(4) + 3.0], plain=True),
        Case("Mul", {}, [(v, (3, 4)), (v, (3, 4))]),
        Case("Neg", {}, [(v, (3, 4))], plain=True),
        Case("Conv", {"strides": [2, 2]}, [(v, (1, 2, 4, 4)), r(3, 2, 2, 2), r(3)], plain=True),
        Case("Conv", {"strides": [2, 1], "pads": [1, 1, 1, 1]}, [(v, (1, 2, 5, 4)),
                                                                  r(3, 2, 3, 3)], plain=True),
        Case("Conv", {"dilations": [2], "group": 2}, [(v, (1, 4, 7)), r(4, 2, 3)], plain=True),
        Case("Reshape", {}, [(v, (2, 3, 4)), idx(6, 4)], plain=True),
        Case("Flatten", {"axis": 1}, [(v, (2, 3, 4))], plain=True),
        Case("Transpose", {"perm": [1, 0, 2]}, [(v, (2, 3, 4))], plain=True),
        Case("Transpose", {"perm": [0, 2, 1]}, [(v, (2, 3, 4))], plain=True),
        Case("Unsqueeze", {}, [(v, (3, 4)), idx(0)], plain=True),
        Case("Squeeze", {}, [(v, (1, 3, 4)), idx(0)], plain=True),
        Case("Identity", {}, [(v, (3, 4))], plain=True),
        Case("Dropout", {}, [(v, (3, 4))], n_out=2, plain=True),
        Case("Cast", {"to": 11}, [(v, (3, 4))], plain=True),
        Case("Slice", {}, [(v, (4, 6)), idx(1, 0), idx(4, 6), idx(0, 1), idx(2, 2)],
             plain=True),
        Case("Gather", {"axis": 0}, [(v, (4, 3)), idx(0, 2, 0, 0)], plain=True),
        Case("Gather", {"axis": 1}, [(v, (4, 3)), idx(2, 2, 1)], plain=True),
        Case("GatherElements", {"axis": 0}, [(v, (3, 2)), idx(0, 0, 1, 0, 2, 0).reshape(3, 2)],
             plain=True),
        Case("Concat", {"axis": -1}, [(v, (3, 2)), r(3, 2), (v, (3, 3))]),
        Case("Concat", {"axis": 0}, [(v, (2, 3)), (v, (1, 3)), r(2, 3)]),
        Case("Split", {"axis": 1}, [(v, (3, 5)), idx(2, 3)], n_out=2, plain=True),
        Case("Split", {"axis": 0, "num_outputs": 2}, [(v, (4, 3))], n_out=2, plain=True),
        Case("Expand", {}, [(v, (1, 3)), idx(4, 3)], plain=True),
        Case("Expand", {}, [(v, (3, 1)), idx(3, 4)], plain=True),
        Case("ReduceMean", {"axes": [-1]}, [(v, (3, 4))], plain=True),
        Case("ReduceSum", {"axes": [0], "keepdims": 0}, [(v, (3, 4))], plain=True),
        Case("ReduceMax", {"axes": [1]}, [(v, (3, 4))], plain=True),
        Case("Where", {}, [rng.random((3, 4)) < 0.5, (v, (3, 4)), (v, (3, 4))]),
        Case("Where", {}, [rng.random((3, 4)) < 0.5, (v, (3, 4)), r(3, 4)], plain=True),
    ]


def _setup(case: Case, rng: np.random.Generator, norm: str
           ) -> tuple[torch.Tensor, list[Any], Callable[[torch.Tensor], list[torch.Tensor]]]:
    """(a random point x0, the rule's arguments there: each variable's radius its token
    norms at x0, x -> the operands' torch values)."""
    shapes = [s for k, s in (a if isinstance(a, tuple) else (None, None) for a in case.inputs)
              if k == "var"]
    sizes = [int(np.prod(s)) for s in shapes]
    n = sizes[0] if case.plain else max(sizes) + 2
    # each variable operand is M_i x: the identity when plain, else a random linear map
    mats = [np.eye(n) if case.plain else rng.standard_normal((k, n)) / np.sqrt(n) for k in sizes]
    x0 = torch.from_numpy(rng.standard_normal(n))

    def operands(x: torch.Tensor) -> list[torch.Tensor]:
        out, j = [], 0
        for a in case.inputs:
            if isinstance(a, tuple):
                out.append((torch.from_numpy(mats[j]) @ x).reshape(shapes[j]))
                j += 1
            else:
                out.append(None if a is None else torch.from_numpy(np.asarray(a)))
        return out

    args: list[Any] = []
    vals = operands(x0)
    j = 0
    for a, val in zip(case.inputs, vals, strict=True):
        if isinstance(a, tuple):
            lip = _norm(mats[j], norm) * (1 + 1e-12)
            radius = float(val.reshape(-1, val.shape[-1]).norm(dim=1).max()) * (1 + 1e-12)
            args.append(Value(lip, radius, tuple(val.shape)))
            j += 1
        else:
            args.append(a)
    return x0, args, operands


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("norm", ["2", "inf"])
def test_global_factor_holds_the_exact_jacobian(seed: int, norm: str) -> None:
    rng = np.random.default_rng(seed)
    for case in _cases(rng):
        op = global_operator(case.op, case.attrs)
        assert op is not None, case.op
        x0, args, operands = _setup(case, rng, norm)

        def f(x: torch.Tensor, k: int, op: Any = op, operands: Any = operands,
              case: Case = case) -> torch.Tensor:
            return op.evaluate_inputs(operands(x), F64, case.n_out)[k].reshape(-1)

        outs = op.evaluate_inputs(operands(x0), F64, case.n_out)
        bounds = op.global_bound(args, [tuple(o.shape) for o in outs], norm)
        for k, (y, b) in enumerate(zip(outs, bounds, strict=False)):
            assert b is not None
            if not y.is_floating_point():
                continue
            jac = torch.autograd.functional.jacobian(lambda x, k=k: f(x, k), x0).numpy()
            exact = _norm(jac.reshape(-1, x0.numel()), norm)
            assert exact <= b.lip * SLACK, (case.op, case.attrs, norm, exact, b.lip)
            if b.radius is not None and y.dim():
                rows = float(y.reshape(-1, y.shape[-1]).norm(dim=1).max())
                assert rows <= b.radius * SLACK, (case.op, case.attrs, rows, b.radius)


def test_every_linear_map_is_registered_and_refuses_by_name() -> None:
    assert all(t in c.types for t, c in LINEAR_MAPS.items())
    rng = np.random.default_rng(0)
    covered = {c.op for c in _cases(rng)}
    assert covered == set(LINEAR_MAPS)
    two = [Value(1.0, None, (3, 4)), Value(1.0, None, (3, 4))]
    op = global_operator("MatMul")
    assert op is not None
    with pytest.raises(Refused, match="two input-dependent") as e:
        op.global_bound(two, [(3, 4)], "2")
    assert isinstance(e.value, ModeNotImplemented) and e.value.tail.startswith(" multiplies")
    where = global_operator("Where")
    assert where is not None
    with pytest.raises(Refused, match="condition"):
        where.global_bound([two[0], two[1], np.ones((3, 4))], [(3, 4)], "inf")


def test_front_end_refusals_name_the_node() -> None:
    """onnx/ops reads the classes and completes their refusals with the node's name."""
    from lsa_models.onnx.ops import OPS, Node, NotCertified, RunContext

    two = [Value(1.0, None, (3, 4)), Value(1.0, None, (4, 2))]
    with pytest.raises(NotCertified, match="^MatMul node mm multiplies two input-dependent"):
        OPS["MatMul"].bound(Node("mm", "MatMul", ["a", "b"], ["y"]), list(two), [(3, 2)], "2")
    with pytest.raises(NotCertified, match="^Div node d divides by zero"):
        OPS["Div"].bound(Node("d", "Div", ["a", "b"], ["y"]), [two[0], np.zeros(4)],
                         [(3, 4)], "2")
    with pytest.raises(NotImplementedError, match="^Conv node c: 4-D convolutions"):
        OPS["Conv"].run(Node("c", "Conv", ["x", "w"], ["y"]),
                        [torch.zeros(1, 1, 2, 2, 2, 2), torch.zeros(1, 1, 1, 1, 1, 1)],
                        RunContext(F64))
