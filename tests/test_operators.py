"""The operator registry's activations (lsa_models/operators/), every mode against float64
truth: slopes, values and curvature at points of an interval inside the op's enclosures over
it; the global factor and token radius above every point's; the Jacobian enclosure of the
local engine (primitives.elementwise) holding the exact Jacobian at points of the ball in both
norms; the affine relaxation holding the values; the derived graphs' g f'(x) equal to
autograd's; ball arithmetic holding the float64 value. Refusals are typed and named."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lsa_models.engine.affine import form as affine
from lsa_models.engine.affine import walk as affine_rules
from lsa_models.engine.derived.tangent import _Builder
from lsa_models.engine.enclosure import primitives as pr
from lsa_models.engine.values import Ball, LocalNotCertified, enclose
from lsa_models.operators import ACTIVATIONS, ModeNotImplemented, activation
from lsa_models.operators.activation import Activation
from tests.jacobians import assert_arb_holds, ball_points

# every activation, with attribute settings where it has them (torch's exports among them)
CASES: list[tuple[str, dict[str, Any]]] = [
    ("Relu", {}), ("Tanh", {}), ("Sigmoid", {}), ("Erf", {}), ("Gelu", {}), ("Softplus", {}),
    ("HardSigmoid", {}), ("HardSigmoid", {"alpha": 0.1666666716337204, "beta": 0.5}),
    ("HardSigmoid", {"alpha": 1.5, "beta": 0.25}), ("HardSwish", {}), ("LeakyRelu", {}),
    ("LeakyRelu", {"alpha": 0.10000000149011612}), ("LeakyRelu", {"alpha": 2.5}),
    ("LeakyRelu", {"alpha": -0.5}),
]
NEW = ("Softplus", "HardSigmoid", "HardSwish", "LeakyRelu")
P = 5


def _op(case: tuple[str, dict[str, Any]]) -> Activation:
    op = activation(*case)
    assert op is not None
    return op


def _grads(op: Activation, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Value, f' and f'' by autograd on the op's own torch evaluation, in float64."""
    t = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = op.evaluate(t)
    (g,) = torch.autograd.grad(y.sum(), t, create_graph=True)
    if g.requires_grad:
        (h,) = torch.autograd.grad(g.sum(), t)
    else:
        h = torch.zeros_like(t)
    return y.detach().numpy(), g.detach().numpy(), h.detach().numpy()


def _off_kinks(op: Activation, x: np.ndarray) -> np.ndarray:
    """Points farther than 1e-9 from the op's kinks (where autograd picks one side)."""
    kinks = {"Relu": [0.0], "LeakyRelu": [0.0]}.get(op.op_type, [])
    if op.op_type in ("HardSigmoid", "HardSwish"):
        a, b = op.alpha, op.beta  # type: ignore[attr-defined]
        kinks = [-b / a, (1 - b) / a]
    keep = np.ones(x.shape, dtype=bool)
    for k in kinks:
        keep &= np.abs(x - k) > 1e-9 * (1 + abs(k))
    return x[keep]


def test_registry_covers_every_activation_with_one_class_each() -> None:
    assert set(ACTIVATIONS) >= {"Relu", "Tanh", "Sigmoid", "Erf", "Gelu", *NEW}
    assert all(t in c.types for t, c in ACTIVATIONS.items())
    assert len({c.kind for c in ACTIVATIONS.values()}) == len(ACTIVATIONS)


@given(case=st.sampled_from(CASES), seed=st.integers(0, 10**6),
       width=st.sampled_from([1e-6, 1e-2, 0.5, 3.0, 12.0]))
def test_enclosures_hold_every_point_of_the_interval(case: tuple[str, dict[str, Any]],
                                                     seed: int, width: float) -> None:
    op = _op(case)
    rng = np.random.default_rng(seed)
    lo = rng.uniform(-6, 6, size=16)
    hi = lo + rng.uniform(0, width, size=16)
    lo[:2], hi[:2] = -3.0, 3.0  # HardSwish's own kinks, exactly at the ends
    xs = lo[None] + (hi - lo)[None] * np.concatenate([[0.0, 1.0], rng.random(30)])[:, None]
    xs[-1] = np.clip(-1.5, lo, hi)  # HardSwish's minimum where it is inside
    vlo, vhi = op.value_range(lo, hi)
    dlo, dhi = op.d1_range(lo, hi)
    slo, shi = op.subgradient_range(lo, hi) if op.op_type != "Gelu" else (dlo, dhi)
    curv = op.d2_range(lo, hi)
    lip = op.global_factor()
    for x in xs:
        y, g, h = _grads(op, x)
        tol = 1e-12 * (1 + np.abs(y))
        assert np.all(vlo <= y + tol) and np.all(y <= vhi + tol), case
        assert np.all(vlo <= op.point(x) + tol) and np.all(op.point(x) <= vhi + tol)
        assert np.all(np.abs(g) <= lip * (1 + 1e-12)), case
        mask = np.isin(x, _off_kinks(op, x))
        gt = 1e-12 * (1 + np.abs(g))
        assert np.all((dlo <= g + gt)[mask]) and np.all((g <= dhi + gt)[mask]), case
        assert np.all((slo <= g + gt)[mask]) and np.all((g <= shi + gt)[mask]), case
        assert np.all(np.abs(op.d1(x) - g)[mask] <= gt[mask]), case
        if curv is not None:
            ht = 1e-9 * (1 + np.abs(h))
            assert np.all((curv[0] <= h + ht)[mask]) and np.all((h <= curv[1] + ht)[mask]), \
                case


@given(case=st.sampled_from(CASES), seed=st.integers(0, 10**6),
       scale=st.sampled_from([0.1, 1.0, 10.0]))
def test_token_radius_bounds_every_token(case: tuple[str, dict[str, Any]], seed: int,
                                         scale: float) -> None:
    op = _op(case)
    x = np.random.default_rng(seed).standard_normal((4, 7)) * scale
    r = float(np.sqrt(np.square(x).sum(axis=-1)).max())
    rad = op.token_radius(r, 7)
    assert rad is not None
    y = _grads(op, x)[0]
    assert float(np.sqrt(np.square(y).sum(axis=-1)).max()) <= rad


def _affine_value(c: np.ndarray, a: np.ndarray, ball: Ball):  # type: ignore[no-untyped-def]
    return enclose(c, a, np.zeros_like(a), ball)


def _points(rng: np.random.Generator, eps: float, norm: str, k: int = 8) -> list[np.ndarray]:
    return ball_points(rng, P, eps, norm, k)


@given(case=st.sampled_from(CASES), seed=st.integers(0, 10**6),
       eps=st.sampled_from([1e-3, 1e-2, 1e-1, 1.0]), norm=st.sampled_from(["2", "inf"]))
def test_local_enclosure_holds_exact_jacobians_in_the_ball(
        case: tuple[str, dict[str, Any]], seed: int, eps: float, norm: str) -> None:
    """primitives.elementwise with the op: |J(X) - jc| <= jr entrywise and the values in
    [lo, hi] at points of the ball, the exact float64 Jacobian by autograd; and the
    certified operator norm of the Jacobian (the enclosure's) above the exact one."""
    op = _op(case)
    rng = np.random.default_rng(seed)
    c = rng.standard_normal(4) * 3
    a = rng.standard_normal((4, P))
    ball = Ball(np.zeros(P), eps, norm)
    x = _affine_value(c, a, ball)
    y = pr.elementwise(x, op, op.point(c), ball)
    for d in _points(rng, eps, norm):
        xin = c + a @ d
        if len(_off_kinks(op, xin)) < xin.size:
            continue
        dt = torch.tensor(d, dtype=torch.float64)
        jac = torch.autograd.functional.jacobian(
            lambda z: op.evaluate(torch.from_numpy(c) + torch.from_numpy(a) @ z), dt).numpy()
        val = op.evaluate(torch.from_numpy(xin)).numpy()
        assert np.all(np.abs(jac - y.jc) <= y.jr + 1e-12 * (1 + np.abs(jac))), case
        assert np.all(val >= y.lo - 1e-12) and np.all(val <= y.hi + 1e-12), case
        # the norm certified from the enclosure: |jc| + jr, row sums (inf) or Frobenius (2)
        box = np.abs(y.jc) + y.jr
        cert = box.sum(axis=1).max() if norm == "inf" else np.sqrt(np.square(box).sum())
        exact = np.abs(jac).sum(axis=1).max() if norm == "inf" else np.linalg.norm(jac, 2)
        assert exact <= cert * (1 + 1e-12)


@given(case=st.sampled_from(CASES), seed=st.integers(0, 10**6),
       eps=st.sampled_from([1e-2, 1e-1, 1.0]), norm=st.sampled_from(["2", "inf"]))
def test_affine_relaxation_holds_the_values(case: tuple[str, dict[str, Any]], seed: int,
                                            eps: float, norm: str) -> None:
    op = _op(case)
    if op.op_type == "Gelu":
        with pytest.raises(affine_rules.NotAffine, match="Gelu"):
            affine_rules.activation_fn(op, "g")
        return
    rng = np.random.default_rng(seed)
    c = rng.standard_normal(4) * 3
    a = rng.standard_normal((4, P))
    ball = Ball(np.zeros(P), eps, norm)
    x = _input_form(c, a, ball)
    y = affine_rules.elementwise(x, affine_rules.activation_fn(op, "n"), ball)
    lo, hi = affine.ranges(y, ball)
    for d in _points(rng, eps, norm):
        v = op.evaluate(torch.from_numpy(c + a @ d)).numpy()
        assert np.all(lo <= v + 1e-12) and np.all(v <= hi + 1e-12), case


def _input_form(c: np.ndarray, a: np.ndarray, ball: Ball) -> affine.Aff:
    """x = c + A d exactly, as an affine form over the ball's P coordinates."""
    z = np.zeros(c.shape)
    return affine.Aff(c.copy(), z.copy(), z.copy(), a.copy(), z.copy())


@given(case=st.sampled_from(CASES), seed=st.integers(0, 10**6))
def test_derived_graph_is_g_times_the_derivative(case: tuple[str, dict[str, Any]],
                                                 seed: int) -> None:
    op = _op(case)
    rng = np.random.default_rng(seed)
    x = _off_kinks(op, rng.uniform(-6, 6, size=12))
    g = rng.standard_normal(x.size)
    env = {"x": torch.from_numpy(x), "g": torch.from_numpy(g),
           "y": op.evaluate(torch.from_numpy(x))}
    b = _Builder(env)
    for first in (True, False):
        out = op.scaled_derivative(b, "g", "x", "y", first)
        want = g * _grads(op, x)[1]
        assert np.allclose(b.env[out].numpy(), want, rtol=1e-12, atol=1e-14), case


@given(case=st.sampled_from(CASES), seed=st.integers(0, 10**6))
def test_ball_arithmetic_holds_the_value(case: tuple[str, dict[str, Any]], seed: int) -> None:
    pytest.importorskip("flint")
    op = _op(case)
    x = np.random.default_rng(seed).uniform(-8, 8, size=6)
    assert_arb_holds(op, x)


def test_refusals_are_typed_and_named() -> None:
    tanh_gelu = _op(("Gelu", {"approximate": b"tanh"}))
    with pytest.raises(ModeNotImplemented, match="Gelu has no derivative rule"):
        tanh_gelu.d1_range(np.zeros(1), np.ones(1))
    flat = _op(("HardSigmoid", {"alpha": -0.2}))
    with pytest.raises(ModeNotImplemented, match="HardSigmoid .*alpha = -0.2"):
        flat.d1_range(np.zeros(1), np.ones(1))
    ball = Ball(np.zeros(P), 0.1, "inf")
    x = _affine_value(np.zeros(2), np.ones((2, P)), ball)
    with pytest.raises(LocalNotCertified, match="Gelu has no derivative rule"):
        pr.elementwise(x, tanh_gelu, np.zeros(2), ball)
    assert math.isfinite(flat.global_factor())
