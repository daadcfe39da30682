"""The affine softmax over wide, correlated logits (docs/local-affine.md, "Softmax"): the
logits' pairwise differences, the probability ranges they give and the mean value form about
the Jacobian's midpoints, each checked against exact float64 values at sampled points.

A logit form over P inputs and Q shared symbols is read as the set of logits
z = z0 + A_in d + A_sym e + beta (d in the ball, e in [-1, 1]^Q, |beta| <= b): every sampled
point must lie in what the rules claim, with the same d and e.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lsa_models.engine.affine import norms
from lsa_models.engine.affine.form import Aff, ranges
from lsa_models.engine.enclosure.primitives import SOFTMAX
from lsa_models.engine.values import Ball


def _logits(seed: int, rows: int, n: int, p: int, q: int, shared: float, scale: float,
            eps: float, norm: str) -> tuple[Aff, Ball]:
    """A form whose logits move together: each row's symbols hold a common part `shared`
    times one column (cancelled by the differences) plus small individual parts."""
    rng = np.random.default_rng(seed)
    c = rng.normal(size=(rows, n)) * scale
    ain = rng.normal(size=(rows, n, p)) * scale
    asym = rng.normal(size=(rows, n, q)) * 0.2 * scale
    if q:
        asym[..., 0] += shared * rng.normal(size=(rows, 1))
    b = np.abs(rng.normal(size=(rows, n))) * 0.01 * scale
    a = np.concatenate([ain, asym], axis=-1)
    ball = Ball(rng.normal(size=(p,)), eps, norm)
    return Aff(c, np.zeros_like(c), np.zeros_like(c), a, b), ball


L = np.longdouble  # the reference arithmetic: 64-bit mantissas where the platform has them


def _points(x: Aff, ball: Ball, seed: int, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(de, D): k sampled points, de the input change and symbols (P + Q,), D the logits'
    change from the centre c (in L); half of them corners (the extremes of a linear map)."""
    rng = np.random.default_rng(seed + 1)
    p, w = ball.size, x.a.shape[-1]
    out = []
    for t in range(k):
        if ball.norm == "inf":
            d = ball.eps * (rng.choice([-1.0, 1.0], p) if t % 2 else rng.uniform(-1, 1, p))
        else:
            d = rng.normal(size=p)
            d *= ball.eps * (1.0 if t % 2 else rng.uniform()) / max(np.linalg.norm(d), 1e-300)
        e = rng.choice([-1.0, 1.0], w - p) if t % 2 else rng.uniform(-1, 1, w - p)
        beta = x.b * rng.choice([-1.0, 1.0], x.b.shape)
        de = np.concatenate([d, e])
        out.append((de, x.o.astype(L) + x.a.astype(L) @ de.astype(L) + beta.astype(L)))
    return out


def _softmax(z: np.ndarray) -> np.ndarray:
    """In the arithmetic of z (L for the reference values)."""
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


CASES = dict(seed=st.integers(0, 10**6), rows=st.integers(1, 3), n=st.integers(2, 6),
             p=st.integers(1, 4), q=st.integers(0, 4), shared=st.sampled_from([0.0, 1.0, 8.0]),
             scale=st.sampled_from([0.1, 1.0, 3.0]), eps=st.sampled_from([0.01, 0.3, 1.0]),
             norm=st.sampled_from(["inf", "2"]))


# each example checks every sampled point in long double (seconds each): 120 examples
# cover the shapes and shared-symbol mixes; the full profile's count would only repeat them
@settings(max_examples=120, deadline=None)
@given(**CASES)
def test_difference_dev_holds(seed: int, rows: int, n: int, p: int, q: int, shared: float,
                              scale: float, eps: float, norm: str) -> None:
    x, ball = _logits(seed, rows, n, p, q, shared, scale, eps, norm)
    dd = norms.difference_dev(x, ball)
    assert dd is not None
    for _, dz in _points(x, ball, seed, 24):
        diff = dz[..., None, :] - dz[..., :, None]  # D_j - D_i, row i
        assert np.all(np.abs(diff) <= dd), float((np.abs(diff) - dd).max())


# each example checks every sampled point in long double (seconds each): 120 examples
# cover the shapes and shared-symbol mixes; the full profile's count would only repeat them
@settings(max_examples=120, deadline=None)
@given(**CASES)
def test_difference_probability_ranges_hold(seed: int, rows: int, n: int, p: int, q: int,
                                            shared: float, scale: float, eps: float,
                                            norm: str) -> None:
    x, ball = _logits(seed, rows, n, p, q, shared, scale, eps, norm)
    dd = norms.difference_dev(x, ball)
    assert dd is not None
    pc = _softmax(x.c)
    # the entries' own ranges wide open: what stands is the differences'
    lo, hi = x.c - 1e3, x.c + 1e3
    plo, phi = norms._difference_ranges(x, dd, pc, *SOFTMAX.probability_ranges(lo, hi, pc))
    for _, dz in _points(x, ball, seed, 24):
        pz = _softmax(x.c.astype(L) + dz)
        assert np.all(plo <= pz) and np.all(pz <= phi)


# each example checks every sampled point in long double (seconds each): 80 examples
# cover the shapes and shared-symbol mixes; the full profile's count would only repeat them
@settings(max_examples=80, deadline=None)
@given(**CASES)
def test_jacobian_midpoints_bound_the_jacobian(seed: int, rows: int, n: int, p: int, q: int,
                                               shared: float, scale: float, eps: float,
                                               norm: str) -> None:
    """J(z) = diag(p) - p p^T at any sampled point lies within sc +- full, its off-diagonal
    within sc +- off, and sc's rows sum to within resid of 0."""
    x, ball = _logits(seed, rows, n, p, q, shared, scale, eps, norm)
    pts = [_softmax(x.c.astype(L) + dz) for _, dz in _points(x, ball, seed, 24)]
    plo = np.min(pts, axis=0).astype(np.float64)
    phi = np.max(pts, axis=0).astype(np.float64)
    pts = [np.clip(pz, plo, phi) for pz in pts]  # the ranges as floats hold: read within
    sc, off, full, resid = SOFTMAX.jacobian_midpoints(plo, phi)
    eye = np.eye(n, dtype=bool)
    assert np.all(np.abs(sc.sum(axis=-1)) <= resid)
    for pz in pts:
        jac = np.einsum("...i,ij->...ij", pz, np.eye(n)) - pz[..., :, None] * pz[..., None, :]
        assert np.all(np.abs(jac - sc) <= full)
        assert np.all(np.abs(jac - sc)[..., ~eye] <= off[..., ~eye])


# each example checks every sampled point in long double (seconds each): 80 examples
# cover the shapes and shared-symbol mixes; the full profile's count would only repeat them
@settings(max_examples=80, deadline=None)
@given(**CASES)
def test_softmax_form_holds(seed: int, rows: int, n: int, p: int, q: int, shared: float,
                            scale: float, eps: float, norm: str) -> None:
    """The whole rule: at every sampled point the probabilities lie in the output form with
    the same input change and symbols, its new symbols and box free."""
    x, ball = _logits(seed, rows, n, p, q, shared, scale, eps, norm)
    oc = _softmax(x.c)
    with np.errstate(over="ignore"):  # as the walk runs its rules: overflows are refused there
        y = norms.softmax(x, -1, oc, ball, None, None)
    w = x.a.shape[-1]
    free = np.abs(y.a[..., w:]).sum(axis=-1) + y.b + y.m
    for de, dz in _points(x, ball, seed, 24):
        claim = y.c.astype(L) + y.o + y.a[..., :w].astype(L) @ de.astype(L)
        miss = np.abs(_softmax(x.c.astype(L) + dz) - claim) - free
        assert np.all(miss <= 0), float(miss.max())


def test_shared_symbols_narrow_the_probabilities() -> None:
    """Logits that move together by a large common symbol: their box gives probabilities
    near [0, 1]; their differences keep them near the centre's."""
    x, ball = _logits(3, 2, 5, 2, 3, 20.0, 0.3, 0.01, "inf")
    oc = _softmax(x.c)
    with np.errstate(over="ignore"):
        y = norms.softmax(x, -1, oc, ball, None, None)
    blo, bhi = SOFTMAX.probability_ranges(*ranges(x, ball), oc)
    plo, phi = ranges(y, ball)
    assert np.all(phi - plo < 0.2 * (bhi - blo) + 1e-3)
