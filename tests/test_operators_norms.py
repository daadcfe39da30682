"""The operator registry's row-wise normalisations (lsa_models/operators/softmax.py and
normalization.py: Softmax, LayerNormalization), every mode against float64 truth: the
probability ranges and the Jacobian entries' radius (Softmax), sigma^2's range, the entries of
S = dz/dx, z's interval and the output's range (LayerNorm) holding the exact values and
Jacobians at points of the boxes; the local engine's Jacobian enclosure holding the exact
Jacobian at points of the ball in both norms; the affine relaxation holding the values; the
derived graphs equal to autograd's products; ball arithmetic holding the float64 value; the
global factors above the exact Jacobians' norms. Missing modes are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lsa_models.engine.affine import form as affine
from lsa_models.engine.affine import norms as affine_norms
from lsa_models.engine.derived.tangent import _Builder
from lsa_models.engine.enclosure import primitives as pr
from lsa_models.engine.enclosure.rules import layernorm as local_layernorm
from lsa_models.engine.rounding.forward_ball import PREC
from lsa_models.engine.values import Ball, LocalNotCertified, enclose
from lsa_models.operators import NORMS, OPERATORS, ModeNotImplemented, make
from lsa_models.operators.normalization import LayerNormalization, decimal_attr
from lsa_models.operators.softmax import Softmax
from tests.jacobians import ball_points

P = 5
SM = Softmax("Softmax")
LN = LayerNormalization("LayerNormalization", {"epsilon": np.float32(1e-5)})


def _softmax(x: np.ndarray) -> np.ndarray:
    return torch.softmax(torch.from_numpy(x), dim=-1).numpy()


def _sm_jac(p: np.ndarray) -> np.ndarray:
    return np.einsum("...i,ij->...ij", p, np.eye(p.shape[-1])) - p[..., :, None] * p[..., None, :]


def _ln(x: torch.Tensor, g: np.ndarray | None = None, b: np.ndarray | None = None,
        eps: float = LN.eps) -> torch.Tensor:
    """The float64 LayerNorm over the last axis (the function certified: epsilon read as
    `decimal_attr`)."""
    gt = None if g is None else torch.from_numpy(g)
    bt = None if b is None else torch.from_numpy(b)
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), gt, bt, eps)


def _ln_jac(x: np.ndarray) -> np.ndarray:
    """dz/dx per token (T, D, D) for z = LayerNorm(x) without scale and bias."""
    return np.stack([torch.autograd.functional.jacobian(_ln, torch.from_numpy(t)).numpy()
                     for t in x])


def _box(rng: np.random.Generator, shape: tuple[int, ...], width: float
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A centre and a box [lo, hi] around it, and points of the box (corners and inside)."""
    c = rng.standard_normal(shape) * 2
    r = rng.uniform(0, width, size=shape)
    lo, hi = c - r, c + r
    t = np.concatenate([rng.integers(0, 2, size=(8, *shape)).astype(float),
                        rng.random((8, *shape))])
    return c, np.stack([lo, hi]), lo[None] + (hi - lo)[None] * t


def _inside(lo: np.ndarray, hi: np.ndarray, v: np.ndarray, tol: float = 1e-12) -> bool:
    t = tol * (1 + np.abs(v))
    return bool(np.all(lo <= v + t) and np.all(v <= hi + t))


def test_registry_holds_the_norms_one_class_each() -> None:
    assert set(NORMS) == {"Softmax", "LayerNormalization"}
    assert all(OPERATORS[t] is c and t in c.types for t, c in NORMS.items())
    sm = make("Softmax", {"axis": 1})
    assert isinstance(sm, Softmax) and sm.axis == 1
    ln = make("LayerNormalization", {"epsilon": np.float32(1e-5)})
    assert isinstance(ln, LayerNormalization) and ln.eps == 1e-5 == decimal_attr(1e-5)


@given(seed=st.integers(0, 10**6), width=st.sampled_from([1e-6, 1e-2, 0.5, 3.0]))
def test_softmax_ranges_hold_every_point_of_the_box(seed: int, width: float) -> None:
    """p(x) in [plo, phi] and |J(x) - S(c)| <= sr entrywise for x in the logit box."""
    rng = np.random.default_rng(seed)
    c, (lo, hi), xs = _box(rng, (3, 6), width)
    pc = _softmax(c)
    sc = SM.jacobian_center(pc)
    assert np.allclose(sc, _sm_jac(pc), rtol=0, atol=1e-15)
    plo, phi, sr = SM.jacobian_ranges(lo, hi, pc, sc)
    assert np.array_equal(np.stack(SM.probability_ranges(lo, hi, pc)), np.stack([plo, phi]))
    for x in xs:
        p = _softmax(x)
        assert np.allclose(SM.point(x), p, rtol=1e-13, atol=1e-300)
        assert _inside(plo, phi, p)
        assert np.all(np.abs(_sm_jac(p) - sc) <= sr + 1e-15)


@given(seed=st.integers(0, 10**6), width=st.sampled_from([1e-6, 1e-2, 0.5, 3.0]))
def test_layernorm_ranges_hold_every_point_of_the_box(seed: int, width: float) -> None:
    """For x in the box: sigma^2 in variance_range, every entry of S = dz/dx in
    jacobian_ranges' [lo, hi] (plus REL of its magnitude), z in its interval, and
    y = gamma z + beta in output_range."""
    rng = np.random.default_rng(seed)
    c, (lo, hi), xs = _box(rng, (3, 6), width)
    d = c.shape[-1]
    g, b = rng.standard_normal(d), rng.standard_normal(d)
    uc = c - c.mean(axis=-1, keepdims=True)
    ru = (hi - lo) / 2 + (hi - lo).mean(axis=-1, keepdims=True) / 2 + 1e-13 * (1 + np.abs(c))
    norm0 = np.sqrt(np.square(uc).sum(axis=-1, keepdims=True))
    rho = np.sqrt(np.square(ru).sum(axis=-1, keepdims=True)) * (1 + 1e-12)
    s_lo, s_hi = LN.variance_range(norm0, rho, d, LN.eps)
    e_lo, e_hi, mag, zr = LN.jacobian_ranges(uc - ru, uc + ru, s_lo, s_hi)
    y_lo, y_hi = LN.output_range(uc, ru, g, b)
    sc = np.square(uc).sum(axis=-1, keepdims=True) / d + LN.eps
    assert np.allclose(LN.jacobian_center(uc, sc), _ln_jac(c), rtol=1e-9, atol=1e-12)
    for x in xs:
        u = x - x.mean(axis=-1, keepdims=True)
        s = np.square(u).sum(axis=-1, keepdims=True) / d + LN.eps
        assert _inside(s_lo, s_hi, s)
        jac = _ln_jac(x)
        assert np.all(e_lo - 4e-12 * mag <= jac) and np.all(jac <= e_hi + 4e-12 * mag)
        z = _ln(torch.from_numpy(x)).numpy()
        assert _inside(zr[0], zr[1], z, 1e-10)
        y = _ln(torch.from_numpy(x), g, b).numpy()
        assert _inside(y_lo, y_hi, y, 1e-10)


def _local_input(rng: np.random.Generator, t: int, n: int, scale: float, eps: float,
                 norm: str) -> tuple[np.ndarray, np.ndarray, Ball, object]:
    c = rng.standard_normal((t, n)) * 2
    a = rng.standard_normal((t, n, P)) * scale
    ball = Ball(np.zeros(P), eps, norm)
    return c, a, ball, enclose(c, a, np.zeros_like(a), ball)


def _check_local(y: object, f: object, c: np.ndarray, a: np.ndarray, rng: np.random.Generator,
                 eps: float, norm: str) -> None:
    """|J(X) - jc| <= jr entrywise and the values in [lo, hi] at points of the ball."""
    for d in ball_points(rng, P, eps, norm, 8):
        dt = torch.tensor(d, dtype=torch.float64)
        jac = torch.autograd.functional.jacobian(
            lambda z: f(torch.from_numpy(c) + torch.from_numpy(a) @ z), dt).numpy()  # type: ignore[operator]
        val = f(torch.from_numpy(c + a @ d)).numpy()  # type: ignore[operator]
        assert np.all(np.abs(jac - y.jc) <= y.jr + 1e-12 * (1 + np.abs(jac)))  # type: ignore[attr-defined]
        assert _inside(y.lo, y.hi, val)  # type: ignore[attr-defined]


@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 1e-1, 1.0]),
       norm=st.sampled_from(["2", "inf"]))
def test_local_softmax_holds_exact_jacobians_in_the_ball(seed: int, eps: float, norm: str
                                                        ) -> None:
    rng = np.random.default_rng(seed)
    c, a, ball, x = _local_input(rng, 2, 4, 0.5, eps, norm)
    y = pr.softmax(x, -1, _softmax(c), ball)  # type: ignore[arg-type]
    _check_local(y, lambda z: torch.softmax(z, dim=-1), c, a, rng, eps, norm)


@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 1e-1]),
       norm=st.sampled_from(["2", "inf"]))
def test_local_layernorm_holds_exact_jacobians_in_the_ball(seed: int, eps: float, norm: str
                                                          ) -> None:
    rng = np.random.default_rng(seed)
    c, a, ball, x = _local_input(rng, 2, 6, 0.3, eps, norm)
    g, b = rng.standard_normal(6), rng.standard_normal(6)
    y = local_layernorm(x, g, b, LN.eps, _ln(torch.from_numpy(c), g, b).numpy(), ball)  # type: ignore[arg-type]
    _check_local(y, lambda z: _ln(z, g, b), c, a, rng, eps, norm)


def _aff(c: np.ndarray, a: np.ndarray) -> affine.Aff:
    z = np.zeros(c.shape)
    return affine.Aff(c.copy(), z.copy(), z.copy(), a.copy(), z.copy())


@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-2, 1e-1, 1.0]),
       norm=st.sampled_from(["2", "inf"]))
def test_affine_relaxations_hold_the_values(seed: int, eps: float, norm: str) -> None:
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((2, 6)) * 2
    a = rng.standard_normal((2, 6, P)) * 0.3
    ball = Ball(np.zeros(P), eps, norm)
    g, b = rng.standard_normal(6), rng.standard_normal(6)
    p = affine_norms.softmax(_aff(c, a), -1, _softmax(c), ball, None, None)
    ln = affine_norms.layernorm(_aff(c, a), g, b, LN.eps, _ln(torch.from_numpy(c), g, b).numpy(),
                                ball)
    (plo, phi), (ylo, yhi) = affine.ranges(p, ball), affine.ranges(ln, ball)
    for d in ball_points(rng, P, eps, norm, 8):
        x = c + a @ d
        assert _inside(plo, phi, _softmax(x))
        assert _inside(ylo, yhi, _ln(torch.from_numpy(x), g, b).numpy())


@given(seed=st.integers(0, 10**6))
def test_derived_graphs_are_the_jacobian_products(seed: int) -> None:
    """Softmax: y (g - sum(y g)) = J g in either operand order; LayerNorm: the tangent graph's
    dn = dz/dx t and the adjoint graph's (dy/dx)^T gy with the scale, from n and r given."""
    rng = np.random.default_rng(seed)
    x, t, gy = (rng.standard_normal((3, 5)) for _ in range(3))
    scale = rng.standard_normal(5)
    yv = _softmax(x)
    u = x - x.mean(axis=-1, keepdims=True)
    r = 1.0 / np.sqrt(np.square(u).mean(axis=-1, keepdims=True) + LN.eps)
    env = {k: torch.from_numpy(v) for k, v in
           {"x": x, "t": t, "gy": gy, "y": yv, "n": u * r, "r": r, "scale": scale}.items()}
    b = _Builder(env)
    jt = np.einsum("tij,tj->ti", _sm_jac(yv), t)
    for first in (True, False):
        out = Softmax("Softmax", {"axis": 1}).scaled_derivative(b, "t", "x", "y", first)
        assert np.allclose(b.env[out].numpy(), jt, rtol=1e-12, atol=1e-14)
    jz = _ln_jac(x)
    dn = LN.tangent_graph(b, "t", "n", "r")["dn"]
    assert np.allclose(b.env[dn].numpy(), np.einsum("tij,tj->ti", jz, t), atol=1e-10)
    adj = LN.adjoint_graph(b, "gy", "n", "r", "scale")
    assert np.allclose(b.env[adj].numpy(), np.einsum("tij,ti->tj", jz, gy * scale), atol=1e-10)


@given(seed=st.integers(0, 10**6))
def test_ball_arithmetic_holds_the_values(seed: int) -> None:
    flint = pytest.importorskip("flint")
    rng = np.random.default_rng(seed)
    x, g, bias = rng.standard_normal((2, 4)) * 3, rng.standard_normal(4), rng.standard_normal(4)
    old = flint.ctx.prec
    flint.ctx.prec = PREC
    try:
        def balls(v: np.ndarray) -> np.ndarray:
            return np.asarray(np.frompyfunc(lambda e: flint.arb(float(e)), 1, 1)(v), dtype=object)
        for got, want in (
                (SM.arb(flint.arb)(balls(x)), _softmax(x)),
                (LN.arb(flint.arb)(balls(x), balls(g), balls(bias)),
                 _ln(torch.from_numpy(x), g, bias).numpy())):
            for bv, w in zip(got.reshape(-1), want.reshape(-1), strict=True):
                assert float((bv - flint.arb(float(w))).abs_upper()) <= 1e-13 * (1 + abs(w))
                assert float(bv.rad()) < 1e-60
    finally:
        flint.ctx.prec = old


@given(seed=st.integers(0, 10**6))
def test_global_factors_bound_the_exact_jacobians(seed: int) -> None:
    """||J||_2 and ||J||_inf at random points below the global factors: softmax's 1/2,
    LayerNorm's max|gamma| / sqrt(eps) (2-norm) and its inf-norm constant."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 6)) * rng.choice([1e-3, 1.0, 10.0])
    g = rng.standard_normal(6)
    for j in _sm_jac(_softmax(x)):
        assert np.linalg.norm(j, 2) <= SM.global_factor()
        assert np.abs(j).sum(axis=1).max() <= SM.global_factor()
    for j in _ln_jac(x):
        jy = g[:, None] * j
        assert np.linalg.norm(jy, 2) <= LN.lipschitz(g, "2")
        assert np.abs(jy).sum(axis=1).max() <= LN.lipschitz(g, "inf")
    assert SM.token_radius(None, 6, 2) == 1.0  # rows along the axis: probabilities
    assert Softmax("Softmax", {"axis": 0}).token_radius(None, 9, 2) >= 3.0


def test_refusals_are_named() -> None:
    ball = Ball(np.zeros(P), 0.1, "inf")
    c = np.zeros((1, 3))
    y = enclose(c, np.ones((1, 3, P)), np.zeros((1, 3, P)), ball)
    y.hi = np.full_like(y.hi, np.inf)  # unbounded logits (a mask's): the plain rule refuses
    with pytest.raises(LocalNotCertified, match="Softmax of logits with infinite entries"):
        pr.softmax(y, -1, _softmax(c), ball)
    b = _Builder({"t": torch.zeros(1, 3), "y": torch.zeros(1, 3)})
    with pytest.raises(ModeNotImplemented, match="Softmax has no tangent/adjoint rule"):
        SM.scaled_derivative(b, "t", "x", "y", True)
    with pytest.raises(ModeNotImplemented, match="epsilon <= 0 is not Lipschitz"):
        LayerNormalization("LayerNormalization", {"epsilon": 0.0}).lipschitz(np.ones(3), "2")
    with pytest.raises(ModeNotImplemented, match="LayerNormalization has no global Lipschitz"):
        LN.global_factor()
    with pytest.raises(ModeNotImplemented, match="Softmax has no derivative rule"):
        SM.d1(np.zeros(3))
