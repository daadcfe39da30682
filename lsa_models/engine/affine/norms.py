"""The affine forms' normalisation and softmax: the variance, LayerNorm and RMSNorm as
chains of forms, softmax by its exponentials and their sum (or its Taylor form), a division
by a form; derivations in docs/local-affine.md."""

from __future__ import annotations

import math

import numpy as np

from lsa_models.bounds.numerics import U
from lsa_models.engine.affine.elementwise import EXP, RECIPROCAL, RSQRT, SQUARE, elementwise
from lsa_models.engine.affine.form import (
    _REL,
    TINY,
    Aff,
    NotAffine,
    _up,
    _width,
    dev,
    fresh,
    interval,
    narrow,
    ranges,
    rough_lin,
    select,
    token_radius,
)
from lsa_models.engine.affine.linear import _reduce, _scale_const, _shift, weighted_sum
from lsa_models.engine.affine.products import _sum_cols, product
from lsa_models.engine.enclosure.primitives import SOFTMAX
from lsa_models.engine.values import Ball, center_margin, gamma


def variance(u: Aff, v: Aff, ball: Ball) -> Aff:
    """The variance v_t = ||u_t||^2 / D + eps by its expansion around the centre: with
    Du = u_t(X) - u_t(X0) and rho_t >= ||Du||_2 (`token_radius`),
    v_t(X) - v_t(X0) = (2/D) u0_t . Du + ||Du||^2 / D, the last in [0, rho_t^2 / D]: one
    one-sided term per token instead of one per entry (the square's). u0 = c + e, |e| <= m:
    (2/D) e . Du <= (2/D) ||m_t|| rho_t goes to the box. `v` gives the centre and margin."""
    d = u.shape[-1]
    rho = token_radius(u, ball)  # (..., T, 1)
    w = 2.0 * u.c / d
    s = weighted_sum(u, w, ball)  # (2/D) c . u: its change is (2/D) c . Du
    lo_ = s.o
    quad = _up(rho * rho / d, 2)  # ||Du||^2 / D in [0, quad]
    mn = np.sqrt(_up(np.square(u.m).sum(axis=-1, keepdims=True), d + 2)) * (1 + 4 * U)
    # plus the rounding of the weights w = fl(2 c / D): |w - 2c/D| <= u |w|, times ||Du||
    wn = np.sqrt(np.square(w).sum(axis=-1, keepdims=True)) * (1 + 4 * U)
    extra = _up(2.0 / d * mn * rho + 2 * U * wn * rho, 2)
    # the per-token error as a symbol: every entry of the token's LayerNorm output shares it
    a, b = fresh(s.a, s.b, _up(0.5 * quad + extra + _REL * np.abs(lo_), 2))
    return Aff(v.c, v.m, lo_ + 0.5 * quad, a, b)


def norm_parts(x: Aff, ln_eps: float, ball: Ball, centre: bool = True) -> tuple[Aff, Aff]:
    """The forms of a LayerNorm's centred input u = x - mean x (..., D) (an RMSNorm's: u = x,
    `centre` False) and r = (mean u^2 + eps)^-1/2 (..., 1) over the last axis."""
    d = x.shape[-1]
    u = x
    if centre:
        mu = _reduce(x, d, True, ball)
        u = _add(x, Aff(-mu.c, mu.m, -mu.o, -mu.a, mu.b), ball)  # (..., D)
    q = elementwise(u, SQUARE, ball)
    v = _shift(_reduce(q, d, True, ball), np.asarray(ln_eps))
    v = select(v, variance(u, v, ball), ball)
    vlo = np.full(v.shape, ln_eps * (1 - 1e-12))  # the mean of squares is >= 0
    r = elementwise(v, RSQRT, ball, vlo, np.full(v.shape, np.inf))
    return u, r


def layernorm(x: Aff, gamma_: np.ndarray, beta: np.ndarray | None, ln_eps: float,
              out_c: np.ndarray, ball: Ball, xlo: np.ndarray | None = None,
              xhi: np.ndarray | None = None) -> Aff:
    """y = gamma (x - mean x) (mean (x - mean x)^2 + eps)^-1/2 + beta over the last axis."""
    d = x.shape[-1]
    if xlo is not None and xhi is not None:
        x = narrow(x, xlo, xhi, ball)
    u, r = norm_parts(x, ln_eps, ball)
    w = product(u, r, ball, matmul=False)
    out_m = center_margin(out_c)
    y = _scale_const(w, gamma_, out_c, out_m, ball)
    # |y - beta| <= |gamma| sqrt(D - 1) (the centred entry is at most sqrt(D - 1) of the
    # token's centred norm)
    bnd = np.abs(gamma_) * math.sqrt(d - 1) * (1 + 1e-12)
    bb = np.zeros_like(out_c) if beta is None else np.broadcast_to(beta, out_c.shape)
    return narrow(y, bb - bnd, bb + bnd, ball)


def _add(x: Aff, y: Aff, ball: Ball) -> Aff:
    o = x.o + y.o
    n = _width(x, y)
    a = _sum_cols(x.a, y.a, n)
    c = x.c + y.c
    g = 2 * U
    b = _up(x.b + y.b + g * (np.abs(o) + rough_lin(x, ball) + rough_lin(y, ball)), 4)
    m = _up(x.m + y.m + g * np.abs(c), 2) + TINY
    return Aff(c, m, o, a, b)


def softmax(x: Aff, axis: int, out_c: np.ndarray, ball: Ball, xlo: np.ndarray | None,
            xhi: np.ndarray | None) -> Aff:
    """p = e / sum e, e = exp(x - s) with s the centre's maximum (a constant: softmax is
    shift invariant); the result narrowed to the probability ranges of the logit ranges."""
    ax = axis % x.c.ndim
    if ax != x.c.ndim - 1:
        x = Aff(np.moveaxis(x.c, ax, -1), np.moveaxis(x.m, ax, -1), np.moveaxis(x.o, ax, -1),
                np.moveaxis(x.a, ax, -2), np.moveaxis(x.b, ax, -1))
        if xlo is not None and xhi is not None:
            xlo, xhi = np.moveaxis(xlo, ax, -1), np.moveaxis(xhi, ax, -1)
        oc = np.moveaxis(out_c, ax, -1)
    else:
        oc = out_c
    n = x.shape[-1]
    if xlo is not None and xhi is not None:
        x = narrow(x, xlo, xhi, ball)
    s = x.c.max(axis=-1, keepdims=True)
    z = _shift(x, -s)
    e = elementwise(z, EXP, ball)
    elo, ehi = ranges(e, ball)
    tot = _reduce(e, n, False, ball)
    tlo = np.maximum(np.maximum(elo, 0.0).sum(axis=-1, keepdims=True) * (1 - 1e-12), TINY)
    inv = elementwise(tot, RECIPROCAL, ball, tlo, np.full(tot.shape, np.inf))
    p = product(e, inv, ball, matmul=False, out_c=oc, out_m=center_margin(oc))
    lo, hi = ranges(x, ball)
    plo, phi = SOFTMAX.probability_ranges(lo, hi, oc)
    dd = difference_dev(x, ball)
    if dd is not None:
        plo, phi = _difference_ranges(x, dd, oc, plo, phi)
    if np.all(np.isfinite(lo)) and np.all(np.isfinite(hi)):
        taylor = _softmax_taylor(x, oc, ball, lo, hi) if dd is None else \
            _softmax_midpoint(x, oc, ball, plo, phi, dd)
        p = select(p, taylor, ball)
    p = narrow(p, plo, phi, ball)
    if ax != x.c.ndim - 1:
        return Aff(out_c, np.moveaxis(p.m, -1, ax), np.moveaxis(p.o, -1, ax),
                   np.moveaxis(p.a, -2, ax), np.moveaxis(p.b, -1, ax))
    p.stochastic = True
    return p


def _softmax_taylor(x: Aff, oc: np.ndarray, ball: Ball, lo: np.ndarray, hi: np.ndarray
                    ) -> Aff:
    """Softmax along the last axis by the mean value theorem on each output entry:
    p_i(z) - p_i(z0) = sum_j J_ij(xi) D_j, D = z - z0, xi in the logits' box [lo, hi] (which
    holds z0 and z), J = diag(p) - p p^T within sc +- sr there (`Softmax.jacobian_ranges`, from the
    probability ranges), sc = J at the computed centre. So the change is the linear map sc
    applied to D's form, plus sum_j sr_ij max|D_j| as a new symbol: the logits' shared
    symbols go through sc with their signs (the exp / sum product form multiplies two
    forms that move together)."""
    n = x.shape[-1]
    sc = SOFTMAX.jacobian_center(oc)
    _, _, sr = SOFTMAX.jacobian_ranges(lo, hi, oc, sc)
    dlo, dhi = dev(x, ball)
    dmax = np.maximum(np.abs(dlo), np.abs(dhi))
    err = _up(np.einsum("...ij,...j->...i", sr, dmax), n + 2) + TINY
    return _jacobian_form(x, sc, oc, ball, err)


def _jacobian_form(x: Aff, sc: np.ndarray, oc: np.ndarray, ball: Ball, err: np.ndarray
                   ) -> Aff:
    """The change sc D of the logits' form through a matrix sc (..., n, n) row by row, with
    its roundings in the box and `err` (>= the remainder) as new symbols; centre oc."""
    n = x.shape[-1]
    o = np.einsum("...ij,...j->...i", sc, x.o)
    a = np.einsum("...ij,...jp->...ip", sc, x.a)
    asc = np.abs(sc)
    g = gamma(n + 2)
    b = _up(np.einsum("...ij,...j->...i", asc, x.b + g * (np.abs(x.o) + rough_lin(x, ball)))
            + g * np.abs(o), n + 4)
    a, b = fresh(a, b, err)
    return Aff(oc, center_margin(oc), o, a, b)


# the logits' pairwise differences cost rows n^2 W sums (n the softmax width, W the form's
# columns), n times the softmax's own products: skipped past this many
DIFFERENCE_ENTRIES = 1_000_000_000
# block size (entries) of one pass over the differences
_DIFF_BLOCK = 1 << 22


def difference_dev(x: Aff, ball: Ball) -> np.ndarray | None:
    """dd (..., n, n) >= |D_j - D_i| over the ball, D the form's change along the last axis
    (row i): |o_j - o_i| + ||a_in,j - a_in,i||_dual eps + ||a_sym,j - a_sym,i||_1 + b_i + b_j.
    Symbols both entries hold cancel, which the entries' own ranges cannot see. None where
    it would cost more than DIFFERENCE_ENTRIES."""
    n, w, p = x.shape[-1], x.a.shape[-1], ball.size
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    if rows * n * n * w > DIFFERENCE_ENTRIES:
        return None
    a = x.a.reshape(rows, n, w)
    out = np.empty((rows, n, n))
    step = max(1, _DIFF_BLOCK // max(1, n * w))
    for r in range(rows):
        for i0 in range(0, n, step):
            d = a[r, None, :, :] - a[r, i0:i0 + step, None, :]  # (k, n, w): row i, entry j
            if ball.norm == "inf":
                li = np.abs(d[..., :p]).sum(axis=-1)
            else:
                li = np.sqrt(_up(np.square(d[..., :p]).sum(axis=-1), p + 2)) * (1 + 4 * U)
            out[r, i0:i0 + step] = ball.eps * li + np.abs(d[..., p:]).sum(axis=-1)
    o = x.o.reshape(rows, n)
    bx = x.b.reshape(rows, n)
    out += np.abs(o[:, None, :] - o[:, :, None]) + bx[:, None, :] + bx[:, :, None]
    # each difference of floats rounds within u of its value, each sum within gamma
    return _up(out, w + 6).reshape(*x.shape, n)


def _difference_ranges(x: Aff, dd: np.ndarray, oc: np.ndarray, plo: np.ndarray,
                       phi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[plo, phi] narrowed by the ranges of the logits' differences: z_j - z_i lies within
    (c_j - c_i) +- (m_i + m_j + dd_ij) (the centre within m of the true value); kept
    around the computed centre oc."""
    cd = x.c[..., None, :] - x.c[..., :, None]
    rad = x.m[..., None, :] + x.m[..., :, None] + dd
    pad = _REL * (np.abs(x.c[..., None, :]) + np.abs(x.c[..., :, None]) + rad) + TINY
    qlo, qhi = SOFTMAX.difference_probability_ranges(cd - rad - pad, cd + rad + pad)
    return np.minimum(np.maximum(plo, qlo), oc), np.maximum(np.minimum(phi, qhi), oc)


def _softmax_midpoint(x: Aff, oc: np.ndarray, ball: Ball, plo: np.ndarray, phi: np.ndarray,
                      dd: np.ndarray) -> Aff:
    """Softmax by the mean value theorem about the midpoints of its Jacobian's ranges: for
    xi on the segment from z0 to z (its probabilities in [plo, phi], its differences in
    theirs), p_i(z) - p_i(z0) = sum_j J_ij(xi) D_j = sc_i . D + sum_j E_ij D_j, E = J(xi) - sc.
    J's rows sum to 0, so sum_j E_ij D_j = sum_{j != i} E_ij (D_j - D_i) - (sum_j sc_ij) D_i:
    the remainder is at most sum_{j != i} off_ij dd_ij + resid_i |D_i|, and also
    sum_j full_ij |D_j| (`Softmax.jacobian_midpoints`); the smaller per entry."""
    n = x.shape[-1]
    sc, off, full, resid = SOFTMAX.jacobian_midpoints(plo, phi)
    dlo, dhi = dev(x, ball)
    dmax = np.maximum(np.abs(dlo), np.abs(dhi))
    by_diff = np.einsum("...ij,...ij->...i", off, dd) + resid * dmax
    by_entry = np.einsum("...ij,...j->...i", full, dmax)
    err = _up(np.minimum(by_diff, by_entry), n + 2) + TINY
    return _jacobian_form(x, sc, oc, ball, err)


def _divide(args: list, var: list[int], c0: np.ndarray, m0: np.ndarray, ball: Ball,
            rg: tuple[np.ndarray, np.ndarray] | None) -> Aff:
    """x / y = x * (1 / y) for a positive y."""
    y = args[1]
    if rg is not None:
        y = narrow(y, rg[0], rg[1], ball)
    ylo, _ = ranges(y, ball)
    if not np.all(ylo > 0):
        raise NotAffine("a denominator's range reaches 0 or is negative")
    inv = elementwise(y, RECIPROCAL, ball)
    if 0 in var:
        return product(args[0], inv, ball, False, c0, m0)
    return _scale_const(inv, np.asarray(args[0], dtype=np.float64), c0, m0, ball)


def _lo(rg: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray | None:
    return None if rg is None else rg[0]


def _hi(rg: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray | None:
    return None if rg is None else rg[1]


def _softmax_or_interval(x: Aff, ax: int, c0: np.ndarray, m0: np.ndarray, ball: Ball,
                         rg: tuple[np.ndarray, np.ndarray] | None) -> Aff:
    try:
        return softmax(x, ax, c0, ball, _lo(rg), _hi(rg))
    except NotAffine:  # the probabilities of the logits' ranges, as an interval form
        lo, hi = ranges(x, ball) if rg is None else rg
        plo, phi = SOFTMAX.probability_ranges(np.moveaxis(lo, ax, -1),
                                              np.moveaxis(hi, ax, -1), np.moveaxis(c0, ax, -1))
        return interval(c0, m0, np.moveaxis(plo, -1, ax), np.moveaxis(phi, -1, ax), ball.size)
