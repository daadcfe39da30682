"""The global mode of the linear, conv, layout, reduce, mask and constant families
(lsa_models/operators/): on random inputs and weights in float64, each class's Lipschitz
constant is at least the exact operator norm of the Jacobian of its own evaluation (2: spectral
norm of the flattened map; inf: largest absolute row sum), and its token radius at least every
output row's 2-norm; the ops without a rule refuse by name, and evaluate as numpy does."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from lsa_models.bounds.layer_graph.values import Value
from lsa_models.operators import ModeNotImplemented
from lsa_models.operators.linear import OUTSIDE_PATTERN, Refused
from lsa_models.operators.registry import (
    CONSTANTS,
    GLOBAL_OPERATORS,
    MASKS,
    global_operator,
)

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
        Case("Where", {}, [rng.random((3, 4)) < 0.5, r(3, 4), (v, (3, 4))], plain=True),
        Case("Max", {}, [(v, (3, 4)), r(3, 4)], plain=True),
        Case("Max", {}, [(v, (3, 4)), r(4), r(3, 1)], plain=True),
        Case("Min", {}, [(v, (3, 4)), np.array(0.1)], plain=True),
        Case("Min", {}, [(v, (3, 4))]),
    ]


# the ops with no global rule: each refuses an input-dependent operand, by name
# (Shape and Size: constants of any input, never bounded by the front end)
REFUSING = {t: " has no Lipschitz rule" if t in ("Shape", "Size") else OUTSIDE_PATTERN
            for t in ("Einsum", *MASKS, *CONSTANTS) if t not in ("Where", "Max", "Min")}


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


def test_every_global_operator_is_registered_and_refuses_by_name() -> None:
    assert all(t in c.types for t, c in GLOBAL_OPERATORS.items())
    rng = np.random.default_rng(0)
    covered = {c.op for c in _cases(rng)}
    assert not covered & set(REFUSING)
    assert covered | set(REFUSING) == set(GLOBAL_OPERATORS)
    var = Value(1.0, 1.0, (3, 4))
    for t, tail in REFUSING.items():
        op = global_operator(t, {"equation": "ij->ji"})
        assert op is not None
        with pytest.raises(Refused) as e:
            op.global_bound([var, np.ones((3, 4))], [(3, 4)], "2")
        assert e.value.op == t and e.value.tail.startswith(tail), (t, e.value.tail)
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
    with pytest.raises(Refused, match="broadcasts"):
        where.global_bound([np.ones((3, 4), bool), Value(1.0, None, (4,)), np.ones((3, 4))],
                           [(3, 4)], "2")
    for t in ("Max", "Min"):  # a clip by constants only, of the output's shape
        clip = global_operator(t)
        assert clip is not None and t in MASKS
        for args in ([two[0], two[1]], [np.ones((3, 4)), two[0]],
                     [Value(1.0, None, (4,)), np.ones((3, 4))]):
            with pytest.raises(Refused) as e:
                clip.global_bound(args, [(3, 4)], "2")
            assert e.value.tail == OUTSIDE_PATTERN


def _evaluate(op_type: str, attrs: dict[str, Any], *ins: Any) -> np.ndarray:
    op = global_operator(op_type, attrs)
    assert op is not None
    ts = [None if a is None else torch.as_tensor(a) for a in ins]
    (y,) = op.evaluate_inputs(ts, F64)
    return y.numpy()


def test_masks_and_constants_evaluate_as_numpy() -> None:
    """The evaluation of the ops the global analysis meets on constants (their values feed
    every rule downstream: a mask, a position table, a shape)."""
    import onnx

    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    a[0, 0] = b[0, 0]
    for t, f in (("Equal", np.equal), ("Less", np.less), ("Greater", np.greater),
                 ("LessOrEqual", np.less_equal), ("GreaterOrEqual", np.greater_equal)):
        assert np.array_equal(_evaluate(t, {}, a, b), f(a, b)), t
    p, q = a > 0, b > 0
    assert np.array_equal(_evaluate("And", {}, p, q), p & q)
    assert np.array_equal(_evaluate("Or", {}, p, q), p | q)
    assert np.array_equal(_evaluate("Not", {}, p), ~p)
    c = np.array([1.0, np.nan, np.inf, -np.inf])
    assert np.array_equal(_evaluate("IsNaN", {}, c), np.isnan(c))
    assert np.array_equal(_evaluate("IsInf", {}, c), np.isinf(c))
    assert np.array_equal(_evaluate("Where", {}, p, a, b), np.where(p, a, b))
    assert np.array_equal(_evaluate("Max", {}, a, b, np.float64(0.5)),
                          np.maximum(np.maximum(a, b), 0.5))
    assert np.array_equal(_evaluate("Min", {}, a, b), np.minimum(a, b))
    m = rng.standard_normal((4, 4))
    assert np.array_equal(_evaluate("Trilu", {}, m), np.triu(m))
    assert np.array_equal(_evaluate("Trilu", {"upper": 0}, m, np.int64(-1)), np.tril(m, -1))
    assert np.array_equal(_evaluate("Range", {}, np.int64(1), np.int64(9), np.int64(3)),
                          np.arange(1, 9, 3))
    x, y = np.array([-7, 7, -5]), np.array([3, -3, 2])
    assert np.array_equal(_evaluate("Mod", {}, x, y), np.mod(x, y))
    assert np.array_equal(_evaluate("Mod", {"fmod": 1}, x, y), np.fmod(x, y))
    for t, f in (("Cos", np.cos), ("Sin", np.sin), ("Exp", np.exp), ("Sqrt", np.sqrt),
                 ("Reciprocal", np.reciprocal), ("Log", np.log)):
        assert np.allclose(_evaluate(t, {}, np.abs(a) + 0.1), f(np.abs(a) + 0.1), rtol=1e-15), t
    assert np.allclose(_evaluate("Pow", {}, np.abs(a), b), np.power(np.abs(a), b), rtol=1e-14)
    w = rng.standard_normal((4, 5))
    assert np.allclose(_evaluate("Einsum", {"equation": b"ij,jk->ik"}, a, w), a @ w)
    assert np.array_equal(_evaluate("Shape", {"start": 1}, np.zeros((2, 3, 4))), [3, 4])
    assert _evaluate("Size", {}, np.zeros((2, 3))) == 6
    assert np.array_equal(_evaluate("ConstantOfShape", {}, np.array([2, 3])), np.zeros((2, 3)))
    filled = _evaluate("ConstantOfShape",
                       {"value": onnx.numpy_helper.from_array(np.array([7], np.int64))},
                       np.array([2]))
    assert filled.dtype == np.int64 and np.array_equal(filled, [7, 7])
    tensor = onnx.numpy_helper.from_array(a.astype(np.float32))
    assert np.array_equal(_evaluate("Constant", {"value": tensor}), a.astype(np.float32))
    assert _evaluate("Constant", {"value_ints": [1, 2]}).tolist() == [1, 2]
    assert _evaluate("Constant", {"value_float": 0.25}).dtype == np.float64


def test_front_end_refusals_name_the_node() -> None:
    """onnx/ops reads the classes and completes their refusals with the node's name."""
    from lsa_models.onnx.ops import OPS, Node, NotCertified, RunContext

    two = [Value(1.0, None, (3, 4)), Value(1.0, None, (4, 2))]
    with pytest.raises(NotCertified, match="^MatMul node mm multiplies two input-dependent"):
        OPS["MatMul"].bound(Node("mm", "MatMul", ["a", "b"], ["y"]), list(two), [(3, 2)], "2")
    with pytest.raises(NotCertified, match="^Div node d divides by zero"):
        OPS["Div"].bound(Node("d", "Div", ["a", "b"], ["y"]), [two[0], np.zeros(4)],
                         [(3, 4)], "2")
    with pytest.raises(NotCertified, match="^Einsum node e applied to an input-dependent "
                       "tensor outside a recognised pattern$"):
        OPS["Einsum"].bound(Node("e", "Einsum", ["a", "b"], ["y"], {"equation": "ij,jk->ik"}),
                            list(two), [(3, 2)], "2")
    with pytest.raises(NotCertified, match="^Equal node q applied to an input-dependent"):
        OPS["Equal"].bound(Node("q", "Equal", ["a", "b"], ["y"]), [two[0], np.zeros(4)],
                           [(3, 4)], "2")
    with pytest.raises(NotCertified, match="^Where node w with an input-dependent condition"):
        OPS["Where"].bound(Node("w", "Where", ["c", "a", "b"], ["y"]),
                           [two[0], two[0], np.zeros(4)], [(3, 4)], "2")
    with pytest.raises(NotImplementedError, match="^Constant node k: unsupported value"):
        OPS["Constant"].run(Node("k", "Constant", [], ["y"], {"value_string": b"s"}), [],
                            RunContext(F64))
    with pytest.raises(NotImplementedError, match="^Conv node c: 4-D convolutions"):
        OPS["Conv"].run(Node("c", "Conv", ["x", "w"], ["y"]),
                        [torch.zeros(1, 1, 2, 2, 2, 2), torch.zeros(1, 1, 1, 1, 1, 1)],
                        RunContext(F64))
