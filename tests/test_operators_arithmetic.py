"""The operator registry's arithmetic family (lsa_models/operators/arithmetic.py: Exp, Sqrt,
Reciprocal, Pow by a constant exponent), every mode against float64 truth on each op's domain:
slopes, values and curvature at points of an interval inside the op's enclosures over it; the
local engine's Jacobian enclosure (primitives.elementwise) holding the exact Jacobian at points
of the ball in both norms, and the norm it certifies above the exact one; the affine relaxation
holding the values; the derived graphs' g f'(x) equal to autograd's; ball arithmetic holding
the float64 value; a torch model of the family certified end to end. Domain violations and
missing modes are refused by name."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from lsa_models.engine.affine import form as affine
from lsa_models.engine.affine import walk as affine_rules
from lsa_models.engine.derived.tangent import _Builder
from lsa_models.engine.enclosure import primitives as pr
from lsa_models.engine.routes.certify import certify_local, robustness
from lsa_models.engine.values import Ball, LocalNotCertified, enclose
from lsa_models.onnx import load_onnx, load_onnx_model
from lsa_models.operators import (
    ARITHMETIC,
    OPERATORS,
    ModeNotImplemented,
    arithmetic,
    arithmetic_by_kind,
    make,
)
from lsa_models.operators.arithmetic import Arithmetic
from tests.jacobians import assert_arb_holds, ball_points, jacobian_norm
from tests.margins import boundary_point
from tests.onnx_export import export_to

CASES: list[tuple[str, dict[str, Any]]] = [
    ("Exp", {}), ("Sqrt", {}), ("Reciprocal", {}),
    *[("Pow", {"exponent": p}) for p in (2.0, 3.0, 4.0, 1.0, 0.5, -1.0, -0.5, 1.5, -2.0)],
]
# the exponents the affine relaxation and the derived graphs take
RELAXED = (2.0, 0.5, -1.0, -0.5)
P = 5


def _op(case: tuple[str, dict[str, Any]]) -> Arithmetic:
    op = arithmetic(*case)
    assert op is not None
    return op


def _anywhere(op: Arithmetic) -> bool:
    """Defined on the whole line (Exp, integer powers): else on x > 0 here."""
    p = getattr(op, "p", None)
    return op.op_type == "Exp" or (p is not None and p == int(p) and p >= 1)


def _interval(op: Arithmetic, rng: np.random.Generator, width: float
              ) -> tuple[np.ndarray, np.ndarray]:
    # inside the domain: x > 0 where it asks it (Reciprocal also on x < 0, below)
    lo = rng.uniform(-5, 5, size=16) if _anywhere(op) else np.exp(rng.uniform(-4, 2, size=16))
    hi = lo + rng.uniform(0, width, size=16) * (1 if _anywhere(op) else lo)
    if op.op_type == "Reciprocal":  # one side of 0, either side
        neg = rng.random(16) < 0.5
        lo, hi = np.where(neg, -hi, lo), np.where(neg, -lo, hi)
    return lo, hi


def _grads(op: Arithmetic, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = op.evaluate(t)
    (g,) = torch.autograd.grad(y.sum(), t, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), t, allow_unused=True)
    h = torch.zeros_like(t) if h is None else h
    return y.detach().numpy(), g.detach().numpy(), h.detach().numpy()


def _inside(lo: np.ndarray, hi: np.ndarray, v: np.ndarray, rel: float) -> bool:
    tol = rel * (1 + np.abs(v))
    return bool(np.all(lo <= v + tol) and np.all(v <= hi + tol))


def test_registry_holds_the_family_one_class_each() -> None:
    assert set(ARITHMETIC) == {"Exp", "Sqrt", "Reciprocal", "Pow"}
    assert all(OPERATORS[t] is c and t in c.types for t, c in ARITHMETIC.items())
    assert len({c.kind for c in ARITHMETIC.values()}) == len(ARITHMETIC)
    pw = make("Pow", {"exponent": 3.0})
    assert isinstance(pw, Arithmetic) and pw.p == 3.0  # type: ignore[attr-defined]
    assert isinstance(arithmetic_by_kind("sqrt"), type(make("Sqrt")))
    assert make("Tanh") is not None and make("NoSuchOp") is None


@given(case=st.sampled_from(CASES), seed=st.integers(0, 10**6),
       width=st.sampled_from([1e-6, 1e-2, 0.5, 3.0]))
def test_enclosures_hold_every_point_of_the_interval(case: tuple[str, dict[str, Any]],
                                                     seed: int, width: float) -> None:
    op = _op(case)
    rng = np.random.default_rng(seed)
    lo, hi = _interval(op, rng, width)
    assert op.domain_error(lo, hi) is None
    xs = lo[None] + (hi - lo)[None] * np.concatenate([[0.0, 1.0], rng.random(30)])[:, None]
    dlo, dhi = op.d1_range(lo, hi)
    try:
        vals: tuple[np.ndarray, np.ndarray] | None = op.value_range(lo, hi)
    except ModeNotImplemented:
        vals = None  # Pow by a non-integer exponent >= 0: no value range (none claimed)
    relaxed = op.op_type != "Pow" or op.p in RELAXED  # type: ignore[attr-defined]
    slopes = op.subgradient_range(lo, hi) if relaxed else None
    curv = op.d2_range(lo, hi) if relaxed else None
    for x in xs:
        y, g, h = _grads(op, x)
        assert np.all(np.abs(op.point(x) - y) <= 1e-12 * (1 + np.abs(y))), case
        assert np.all(np.abs(op.d1(x) - g) <= 1e-12 * (1 + np.abs(g))), case
        if vals is not None:
            assert _inside(*vals, y, 1e-12), case
        assert _inside(dlo, dhi, g, 1e-12), case
        if slopes is not None and curv is not None:
            assert _inside(*slopes, g, 1e-12), case
            assert _inside(*curv, h, 1e-9), case


def _centre(op: Arithmetic, rng: np.random.Generator) -> np.ndarray:
    if _anywhere(op):
        return rng.standard_normal(4) * 2
    return rng.uniform(2.0, 5.0, size=4) * (1 if op.op_type != "Reciprocal" else
                                           rng.choice([-1.0, 1.0], size=4))


@given(case=st.sampled_from(CASES), seed=st.integers(0, 10**6),
       eps=st.sampled_from([1e-3, 1e-2, 1e-1, 1.0]), norm=st.sampled_from(["2", "inf"]))
def test_local_enclosure_holds_exact_jacobians_in_the_ball(
        case: tuple[str, dict[str, Any]], seed: int, eps: float, norm: str) -> None:
    """|J(X) - jc| <= jr entrywise and the values in [lo, hi] at points of the ball (the
    exact float64 Jacobian by autograd); the norm certified from the enclosure above the exact
    one. The ball keeps the input inside the op's domain (|a d| <= 0.1 * 5 < 2 <= |c|)."""
    op = _op(case)
    rng = np.random.default_rng(seed)
    c = _centre(op, rng)
    a = rng.standard_normal((4, P)) * 0.1
    ball = Ball(np.zeros(P), eps, norm)
    x = enclose(c, a, np.zeros_like(a), ball)
    y = pr.elementwise(x, op, op.point(c), ball)
    for d in ball_points(rng, P, eps, norm, 8):
        dt = torch.tensor(d, dtype=torch.float64)
        jac = torch.autograd.functional.jacobian(
            lambda z: op.evaluate(torch.from_numpy(c) + torch.from_numpy(a) @ z), dt).numpy()
        val = op.evaluate(torch.from_numpy(c + a @ d)).numpy()
        assert np.all(np.abs(jac - y.jc) <= y.jr + 1e-12 * (1 + np.abs(jac))), case
        assert np.all(val >= y.lo - 1e-12 * (1 + np.abs(val))), case
        assert np.all(val <= y.hi + 1e-12 * (1 + np.abs(val))), case
        box = np.abs(y.jc) + y.jr
        cert = box.sum(axis=1).max() if norm == "inf" else np.sqrt(np.square(box).sum())
        exact = np.abs(jac).sum(axis=1).max() if norm == "inf" else np.linalg.norm(jac, 2)
        assert exact <= cert * (1 + 1e-12), case


@given(case=st.sampled_from(CASES), seed=st.integers(0, 10**6),
       eps=st.sampled_from([1e-2, 1e-1, 1.0]), norm=st.sampled_from(["2", "inf"]))
def test_affine_relaxation_holds_the_values(case: tuple[str, dict[str, Any]], seed: int,
                                            eps: float, norm: str) -> None:
    op = _op(case)
    if op.op_type == "Pow" and op.p not in RELAXED:  # type: ignore[attr-defined]
        with pytest.raises(affine_rules.NotAffine, match="Pow node n: Pow has no affine"):
            affine_rules.relaxation_fn(op, "n")
        return
    rng = np.random.default_rng(seed)
    c = _centre(op, rng)
    if op.op_type == "Reciprocal":
        c = np.abs(c)  # the relaxation's domain: x > 0
    a = rng.standard_normal((4, P)) * 0.1
    ball = Ball(np.zeros(P), eps, norm)
    z = np.zeros(c.shape)
    x = affine.Aff(c.copy(), z.copy(), z.copy(), a.copy(), z.copy())
    y = affine_rules.elementwise(x, affine_rules.relaxation_fn(op, "n"), ball)
    lo, hi = affine.ranges(y, ball)
    for d in ball_points(rng, P, eps, norm, 8):
        v = op.evaluate(torch.from_numpy(c + a @ d)).numpy()
        assert np.all(lo <= v + 1e-12 * (1 + np.abs(v))), case
        assert np.all(v <= hi + 1e-12 * (1 + np.abs(v))), case


@given(case=st.sampled_from(CASES), seed=st.integers(0, 10**6))
def test_derived_graph_is_g_times_the_derivative(case: tuple[str, dict[str, Any]],
                                                 seed: int) -> None:
    op = _op(case)
    rng = np.random.default_rng(seed)
    x, _ = _interval(op, rng, 0.0)
    g = rng.standard_normal(x.size)
    env = {"x": torch.from_numpy(x), "g": torch.from_numpy(g),
           "y": op.evaluate(torch.from_numpy(x))}
    b = _Builder(env)
    if op.op_type == "Pow" and op.p != 2.0:  # type: ignore[attr-defined]
        with pytest.raises(ModeNotImplemented, match="only for the exponent 2"):
            op.scaled_derivative(b, "g", "x", "y", True)
        return
    for first in (True, False):
        out = op.scaled_derivative(b, "g", "x", "y", first)
        want = g * _grads(op, x)[1]
        assert np.allclose(b.env[out].numpy(), want, rtol=1e-12, atol=1e-14), case


@given(case=st.sampled_from(CASES), seed=st.integers(0, 10**6))
def test_ball_arithmetic_holds_the_value(case: tuple[str, dict[str, Any]], seed: int) -> None:
    pytest.importorskip("flint")
    op = _op(case)
    x, _ = _interval(op, np.random.default_rng(seed), 0.0)
    assert_arb_holds(op, x)


def test_domain_and_mode_refusals_are_named() -> None:
    ball = Ball(np.zeros(P), 0.1, "inf")
    x = enclose(np.full(2, 0.05), np.ones((2, P)), np.zeros((2, P)), ball)  # reaches <= 0
    with pytest.raises(LocalNotCertified, match="Sqrt of a value the ball can bring to <= 0"):
        pr.elementwise(x, _op(("Sqrt", {})), np.sqrt(x.center), ball)
    with pytest.raises(LocalNotCertified, match="a division by a value the ball can bring"):
        pr.elementwise(x, _op(("Reciprocal", {})), 1.0 / x.center, ball)
    with pytest.raises(LocalNotCertified, match="Pow with exponent 1.5 of a value"):
        pr.elementwise(x, _op(("Pow", {"exponent": 1.5})), x.center ** 1.5, ball)
    pr.elementwise(x, _op(("Pow", {"exponent": 3.0})), x.center ** 3, ball)  # any sign
    with pytest.raises(ModeNotImplemented, match="Pow has no value range rule"):
        _op(("Pow", {"exponent": 0.5})).value_range(np.ones(1), np.ones(1))
    with pytest.raises(ModeNotImplemented, match="Exp has no global Lipschitz rule"):
        _op(("Exp", {})).global_factor()


class _Arithmetic(nn.Module):
    """Exp, Sqrt, Reciprocal and Pow (3, -0.5) on values the ball keeps in their domains."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.l1, self.l2 = nn.Linear(6, 8), nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.l1(x)
        a = torch.sqrt(z * z + 1.0)
        b = torch.reciprocal(1.0 + torch.exp(-z))
        c = 0.1 * z.pow(3)
        d = (z * z + 2.0).pow(-0.5)
        return self.l2(torch.cat([a, b, c, d], dim=-1))


@pytest.fixture(scope="module")
def arithmetic_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, np.ndarray]:
    x = torch.randn(1, 6, generator=torch.Generator().manual_seed(12))
    path = tmp_path_factory.mktemp("arith") / "a.onnx"
    return export_to(_Arithmetic(), x, path, False).read_bytes(), x.numpy().astype(np.float64)


@pytest.mark.parametrize("norm", ["2", "inf"])
def test_a_model_of_the_family_is_certified_above_exact_jacobians(
        arithmetic_model: tuple[bytes, np.ndarray], norm: str) -> None:
    """End to end (torch export, local engine): the certified local constant above the exact
    Jacobian norms at points of the ball, and no label flip inside the certified radius."""
    data, x0 = arithmetic_model
    ops = {n.op_type for n in onnx.load_from_string(data).graph.node}
    assert {"Exp", "Sqrt", "Reciprocal", "Pow"} <= ops
    lm = load_onnx_model(data, "a.onnx", check_ort=False)
    f = load_onnx(data).module.with_dtype(torch.float64)
    rng = np.random.default_rng(13)
    for eps in (1e-2, 0.2):
        upper = certify_local(lm, x0, eps, norm).upper
        assert upper is not None and math.isfinite(upper)
        exact = [jacobian_norm(f, torch.from_numpy(x0 + boundary_point(rng, x0.shape, eps,
                                                                         norm)), norm)
                 for _ in range(12)]
        assert max(exact) <= upper
    label = int(f(torch.from_numpy(x0)).argmax())
    r = robustness(lm, x0, label, norm, steps=6, attack_restarts=1).certified_radius
    assert r > 0
    for _ in range(64):
        d = boundary_point(rng, x0.shape, r * (1 - 1e-9), norm)
        assert int(f(torch.from_numpy(x0 + d)).argmax()) == label
