"""The signed telescoped terms (lsa_models/engine/remainders/signed_adjoints.py,
docs/local-second-order.md "Signed adjoints"): the bound on G (D(x) - D(x0)) for LayerNorm against
exact float64 gradients of G . LayerNorm(x) at points of the input box (corners included), with the
adjoint known only to within its margin; and whole graphs against exact Jacobians at the corners of
the ball."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lsa_models.empirical.local import local_lower_bound
from lsa_models.engine.drivers.jacobian import local_jacobian
from lsa_models.engine.remainders.signed_adjoints import layernorm_rules
from lsa_models.engine.values import Ball, LocalValue, enclose
from lsa_models.onnx import load_onnx
from lsa_models.onnx.loading import OnnxModel
from tests.profile import at_most


def _ball_point(rng: np.random.Generator, norm: str, p: int, eps: float) -> np.ndarray:
    """A point of the ball's boundary or inside it (inf: a corner or a uniform point; 2: the
    sphere)."""
    if norm == "inf":
        e = rng.choice([-1.0, 1.0], size=p) if rng.random() < 0.5 else \
            rng.uniform(-1.0, 1.0, size=p)
    else:
        e = rng.standard_normal(p)
        e /= np.linalg.norm(e)
    return e * eps


def _phi(x: np.ndarray, a: np.ndarray, ln_eps: float) -> np.ndarray:
    """grad_x of sum(a * LayerNorm(x)) (no affine: a holds G * gamma), exactly in float64."""
    xt = torch.from_numpy(x).requires_grad_(True)
    y = torch.nn.functional.layer_norm(xt, (x.shape[-1],), eps=ln_eps)
    (gx,) = torch.autograd.grad((torch.from_numpy(a) * y).sum(), xt)
    return gx.numpy()


@settings(max_examples=at_most(80), deadline=None)  # an example costs ~60 ms on 2 shared cores
@given(seed=st.integers(0, 10**6), d=st.integers(2, 8), t=st.integers(1, 3),
       scale=st.sampled_from([0.05, 1.0, 4.0]), eps=st.sampled_from([1e-3, 0.05, 0.5, 2.0]),
       ln_eps=st.sampled_from([1e-5, 1e-2, 1.0]), adj=st.sampled_from([0.0, 1e-3, 0.3]),
       const=st.booleans(), norm=st.sampled_from(["inf", "2"]),
       wider=st.sampled_from([0.0, 0.5]))
def test_layernorm_signed_bounds_the_adjoint_row_change(
        seed: int, d: int, t: int, scale: float, eps: float, ln_eps: float, adj: float,
        const: bool, norm: str, wider: float) -> None:
    """x(e) = x0 + A e + B (e * e) / 2 on the ball |e| <= eps (P = 4 directions): Jacobian
    A + B diag(e), enclosed by A +- |B| eps; the box from the mean value form, sometimes
    widened (any valid box must do)."""
    rng = np.random.default_rng(seed)
    p = 4
    x0 = rng.standard_normal((t, d)) * scale
    if const:  # a token near the constant line: sigma small, the Hessian large
        x0[0] = 0.3 + 1e-3 * rng.standard_normal(d)
    amat = rng.standard_normal((t, d, p)) * rng.uniform(0.1, 1.0)
    bmat = rng.standard_normal((t, d, p)) * rng.choice([0.0, 0.3, 2.0])
    ball = Ball(np.zeros(p), eps, norm)
    v = enclose(x0, amat, np.abs(bmat) * eps, ball)
    v = LocalValue(x0, v.lo - wider * (v.hi - v.lo), v.hi + wider * (v.hi - v.lo), v.jc, v.jr)
    gam = rng.standard_normal(d) * 2
    k = 2
    g = rng.standard_normal((k, t, d))
    ga = np.abs(g) * (1 + adj) + adj * np.abs(g).max()
    c = layernorm_rules(v, gam, ln_eps, np.zeros((t, d)), ball)[0](g, ga).reshape(k, t, d)
    assert np.all(c >= 0)
    for _ in range(12):
        e = _ball_point(rng, norm, p, eps)
        x = x0 + amat @ e + 0.5 * bmat @ (e * e)
        assert np.all((v.lo <= x) & (x <= v.hi))
        gt = g + (ga - np.abs(g)) * rng.uniform(-1.0, 1.0, g.shape)  # the true adjoint
        for i in range(k):
            a = gt[i] * gam
            diff = np.abs(_phi(x, a, ln_eps) - _phi(x0, a, ln_eps))
            assert np.all(diff <= c[i] * (1 + 1e-9) + 1e-12), float(np.max(diff - c[i]))


class TwoNorms(nn.Module):
    """LN -> Linear -> tanh -> LN -> Linear on tokens (N = 2, D = 3): every LayerNorm's
    adjoint has mixed signs, so its signed term meets the cancellations it relies on."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(3, eps=1e-3), nn.LayerNorm(3, eps=1e-3)
        self.lin, self.out = nn.Linear(3, 3), nn.Linear(3, 2)
        with torch.no_grad():
            self.ln1.weight.uniform_(-2, 2)
            self.ln2.weight.uniform_(-2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + torch.tanh(self.lin(self.ln1(x)))
        return self.out(self.ln2(y))


@pytest.fixture(scope="module")
def two_norms() -> OnnxModel:
    torch.manual_seed(1)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = Path(tmp) / "ln2.onnx"
        torch.onnx.export(TwoNorms().eval(), (torch.randn(1, 2, 3),), str(path), dynamo=False,
                          opset_version=18, input_names=["x"], output_names=["y"])
        return load_onnx(path.read_bytes())


@settings(max_examples=at_most(12), deadline=None)  # an example costs ~800 ms on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 0.1, 0.3]),
       scale=st.sampled_from([0.1, 1.0]))
def test_signed_layernorm_terms_hold_at_every_corner(two_norms: OnnxModel, seed: int,
                                                     eps: float, scale: float) -> None:
    x0 = np.random.default_rng(seed).standard_normal((1, 2, 3)) * scale
    lj = local_jacobian(two_norms, x0, eps, "inf", margins_of=0)
    f = two_norms.module.with_dtype(torch.float64)
    upper = lj.upper()
    assert lj.structured is not None and lj.structured.rows_abs is not None
    for k in range(2 ** x0.size):  # every corner of the inf-ball
        d = np.array([1.0 if k >> i & 1 else -1.0 for i in range(x0.size)]).reshape(x0.shape)
        jac = torch.autograd.functional.jacobian(f, torch.from_numpy(x0 + eps * d)) \
            .reshape(-1, x0.size).numpy()
        assert np.all(np.abs(jac - lj.jc) <= lj.jr + 1e-12), \
            float(np.max(np.abs(jac - lj.jc) - lj.jr))
        assert float(np.abs(jac).sum(axis=1).max()) <= upper
        assert np.all(np.abs(jac).sum(axis=1) <= lj.structured.rows_abs)
        assert float(np.abs(jac[0] - jac[1]).sum()) <= lj.margin_dual[1]
    lb = local_lower_bound(f, x0, eps, "inf", restarts=1, steps=6, seed=seed)
    assert lb.lower <= upper


@pytest.mark.parametrize("eps", [1e-2, 0.1])
def test_signed_layernorm_past_the_relational_cap_holds_at_every_corner(
        two_norms: OnnxModel, eps: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """With RELATIONAL_MAX_ENTRIES (and the output's own cap) at 0 the LayerNorms' signed
    bounds are the box form alone and their second-order rule computes the relational pieces
    itself (signed(force=True)): the enclosure, rows and margins still hold at every corner,
    and are no tighter than with the relational form at the output only, which is no tighter
    than with it everywhere."""
    from lsa_models.engine.remainders import signed_adjoints as signed_mod
    x0 = np.random.default_rng(3).standard_normal((1, 2, 3))
    full = local_jacobian(two_norms, x0, eps, "inf", margins_of=0)
    monkeypatch.setattr(signed_mod, "RELATIONAL_MAX_ENTRIES", 0)
    out_only = local_jacobian(two_norms, x0, eps, "inf", margins_of=0)
    assert out_only.upper() >= full.upper() * (1 - 1e-12)
    monkeypatch.setattr(signed_mod, "RELATIONAL_OUTPUT_MAX_ENTRIES", 0)
    lj = local_jacobian(two_norms, x0, eps, "inf", margins_of=0)
    assert lj.upper() >= out_only.upper() * (1 - 1e-12)
    assert lj.structured is not None and lj.structured.rows_abs is not None
    f = two_norms.module.with_dtype(torch.float64)
    for k in range(2 ** x0.size):
        d = np.array([1.0 if k >> i & 1 else -1.0 for i in range(x0.size)]).reshape(x0.shape)
        jac = torch.autograd.functional.jacobian(f, torch.from_numpy(x0 + eps * d)) \
            .reshape(-1, x0.size).numpy()
        assert np.all(np.abs(jac - lj.jc) <= lj.jr + 1e-12)
        assert np.all(np.abs(jac).sum(axis=1) <= lj.structured.rows_abs)
        assert float(np.abs(jac[0] - jac[1]).sum()) <= lj.margin_dual[1]
    assert lj.upper() >= full.upper() * (1 - 1e-12)


@pytest.fixture(scope="module")
def tf1() -> OnnxModel:
    from bench.local_models import build, export
    with tempfile.TemporaryDirectory() as tmp:
        return load_onnx(export(build("tf1", seed=5), Path(tmp) / "tf1.onnx").read_bytes())


@settings(max_examples=at_most(6), deadline=None)  # an example costs ~22 s on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 3e-2]))
def test_signed_rows_hold_on_a_transformer(tf1: OnnxModel, seed: int, eps: float) -> None:
    """The signed output rows (`rows_abs`) and margin constants of the pre-norm Transformer
    against exact Jacobians at corners of the inf-ball and at the projected-ascent witness."""
    from bench.local_models import center
    x0 = center(seed % 1000).numpy().astype(np.float64)
    lj = local_jacobian(tf1, x0, eps, "inf", margins_of=0)
    assert lj.structured is not None and lj.structured.rows_abs is not None
    f = tf1.module.with_dtype(torch.float64)
    rng = np.random.default_rng(seed)
    pts = [x0 + rng.choice([-1.0, 1.0], size=x0.shape) * eps for _ in range(4)]
    pts.append(local_lower_bound(f, x0, eps, "inf", restarts=1, steps=6, seed=seed).witness)
    for x in pts:
        jac = torch.autograd.functional.jacobian(
            lambda z: f(z).reshape(-1), torch.from_numpy(x)).reshape(lj.jc.shape[0], -1).numpy()
        assert np.all(np.abs(jac).sum(axis=1) <= lj.structured.rows_abs)
        for j, bound in lj.margin_dual.items():
            assert float(np.abs(jac[0] - jac[j]).sum()) <= bound


@settings(deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(2, 6), t=st.integers(1, 3),
       scale=st.sampled_from([0.1, 1.0, 5.0]), eps=st.sampled_from([1e-3, 0.05, 0.5]),
       adj=st.sampled_from([0.0, 1e-3, 0.3]), norm=st.sampled_from(["inf", "2"]))
def test_softmax_signed_bounds_the_adjoint_row_change(
        seed: int, n: int, t: int, scale: float, eps: float, adj: float, norm: str) -> None:
    """l(e) = l0 + A e + B (e * e) / 2 on the ball (P = 4), p = softmax(l) over the last axis:
    the signed bound on |G (S(p(e)) - S(p(0)))| against the exact float64 values."""
    from lsa_models.engine.enclosure import primitives as pr
    from lsa_models.engine.remainders.signed_adjoints import SignedTerm
    rng = np.random.default_rng(seed)
    p = 4
    l0 = rng.standard_normal((t, n)) * scale
    amat = rng.standard_normal((t, n, p)) * rng.uniform(0.1, 2.0)
    bmat = rng.standard_normal((t, n, p)) * rng.choice([0.0, 0.5])
    ball = Ball(np.zeros(p), eps, norm)
    v = enclose(l0, amat, np.abs(bmat) * eps, ball)
    pc = torch.softmax(torch.from_numpy(l0), -1).numpy()
    out = pr.softmax(v, -1, pc, ball)
    assert isinstance(out.term, SignedTerm)
    k = 2
    g = rng.standard_normal((k, t, n))
    ga = np.abs(g) * (1 + adj) + adj * np.abs(g).max()
    c = out.term.signed(g, ga).reshape(k, t, n)

    def phi(lv: np.ndarray, gv: np.ndarray) -> np.ndarray:  # G S(p) per row
        q = torch.softmax(torch.from_numpy(lv), -1).numpy()
        return q * (gv - (gv * q).sum(axis=-1, keepdims=True))

    for _ in range(12):
        e = _ball_point(rng, norm, p, eps)
        lx = l0 + amat @ e + 0.5 * bmat @ (e * e)
        gt = g + (ga - np.abs(g)) * rng.uniform(-1.0, 1.0, g.shape)
        for i in range(k):
            diff = np.abs(phi(lx, gt[i]) - phi(l0, gt[i]))
            assert np.all(diff <= c[i] * (1 + 1e-9) + 1e-12), float(np.max(diff - c[i]))


@settings(deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 4), kk=st.integers(1, 4),
       m=st.integers(1, 4), h=st.integers(1, 2), eps=st.sampled_from([1e-3, 0.05, 0.5]),
       adj=st.sampled_from([0.0, 1e-3, 0.3]), norm=st.sampled_from(["inf", "2"]))
def test_matmul_signed_bounds_the_adjoint_weights(
        seed: int, n: int, kk: int, m: int, h: int, eps: float, adj: float,
        norm: str) -> None:
    """A(e), B(e) = c + M e + Q (e * e) / 2 (P = 4), y = A @ B: the signed weights of the
    term on J_A (sum_m G_nm dB_km) and on J_B (sum_n G_nm dA_nk) against exact values, the
    same with the adjoint rows taken one at a time."""
    from lsa_models.engine.enclosure import primitives as pr
    from lsa_models.engine.remainders.signed_adjoints import SignedTerm
    rng = np.random.default_rng(seed)
    p = 4
    ball = Ball(np.zeros(p), eps, norm)

    def operand(shape: tuple[int, ...]) -> tuple[LocalValue, np.ndarray, np.ndarray,
                                                 np.ndarray]:
        c = rng.standard_normal(shape)
        mm = rng.standard_normal((*shape, p)) * rng.uniform(0.1, 2.0)
        qq = rng.standard_normal((*shape, p)) * rng.choice([0.0, 0.5])
        return enclose(c, mm, np.abs(qq) * eps, ball), c, mm, qq

    a, ac, am, aq = operand((h, n, kk))
    b, bc, bm, bq = operand((h, kk, m))
    y = pr.product(a, b, ac @ bc, ball, matmul=True)
    assert isinstance(y.term, SignedTerm)
    z = 3
    g = rng.standard_normal((z, h, n, m))
    ga = np.abs(g) * (1 + adj) + adj * np.abs(g).max()
    got = y.term.signed(g, ga)
    assert isinstance(got, list)
    # the rows one at a time (the chunks a large adjoint takes) give the same weights
    saved = pr.SIGNED_CHUNK_ENTRIES
    pr.SIGNED_CHUNK_ENTRIES = 1
    try:
        rowwise = y.term.signed(g, ga)
    finally:
        pr.SIGNED_CHUNK_ENTRIES = saved
    assert isinstance(rowwise, list)
    for full, rows in zip(got, rowwise, strict=True):
        np.testing.assert_allclose(rows, full, rtol=1e-12, atol=1e-300)
    c_a, c_b = got[0].reshape(z, h, n, kk), got[1].reshape(z, h, kk, m)
    for _ in range(12):
        e = _ball_point(rng, norm, p, eps)
        da = am @ e + 0.5 * aq @ (e * e)
        db = bm @ e + 0.5 * bq @ (e * e)
        gt = g + (ga - np.abs(g)) * rng.uniform(-1.0, 1.0, g.shape)
        for i in range(z):
            wa = np.abs(gt[i] @ np.swapaxes(db, -1, -2))  # (h, n, k)
            wb = np.abs(np.swapaxes(da, -1, -2) @ gt[i])  # (h, k, m)
            assert np.all(wa <= c_a[i] * (1 + 1e-9) + 1e-12), float(np.max(wa - c_a[i]))
            assert np.all(wb <= c_b[i] * (1 + 1e-9) + 1e-12), float(np.max(wb - c_b[i]))
