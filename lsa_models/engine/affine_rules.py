"""The affine forms' rules (affine.py has the form and its invariant): elementwise functions,
products of two forms, linear and layout ops, LayerNorm and softmax as chains, one node at a
time (`step`) and a standalone walk (`walk`); derivations in docs/local-affine.md, "Affine value
forms"."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..bounds.numerics import U
from ..onnx.ops import FLOAT_TYPES, OPS, Node, RunContext, decimal_attr
from ..operators import (
    ARITHMETIC_TYPES,
    FUSABLE_ACTIVATIONS,
    ModeNotImplemented,
    activation,
    arithmetic,
)
from ..operators.activation import Activation, Relu
from ..operators.arithmetic import Arithmetic, Exp, Pow, Reciprocal, Sqrt
from ..operators.arithmetic import near_far as _near_far
from . import fused
from .affine import (
    _REL,
    COLLAPSE,
    GROUPS,
    PAIRS,
    QUAD,
    SPACE,
    TINY,
    Aff,
    NotAffine,
    _cols,
    _split_lin,
    _up,
    _width,
    dev,
    extreme_eigs,
    fresh,
    fresh_fill,
    input_form,
    input_radius,
    interval,
    lin,
    narrow,
    quad_cols,
    quad_size,
    ranges,
    reference,
    rough_lin,
    select,
    split_lin,
    symbol_radius,
    token_radius,
    triu_pack_sym,
)
from .internal_ops import GUARDS, RELU_GRAD
from .primitives import _softmax_ranges, probability_ranges
from .rules import _abs_node, linear_consts, run_tangents
from .values import Ball, center_margin, gamma

CTX = RunContext(torch.float64)


# --- elementwise functions: value, f' and f'' ranges over intervals (padded outward) ---

Iv = tuple[np.ndarray, np.ndarray]


def _pad(lo: np.ndarray, hi: np.ndarray) -> Iv:
    p = _REL * np.maximum(np.abs(lo), np.abs(hi)) + TINY
    return lo - p, hi + p


def _mono(f: Callable[[np.ndarray], np.ndarray], lo: np.ndarray, hi: np.ndarray) -> Iv:
    """Range of a function monotone on [lo, hi]: its endpoint values."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        u, v = f(lo), f(hi)
    return _pad(np.minimum(u, v), np.maximum(u, v))


@dataclass
class Fn:
    """f with enclosures of f, f', f'' over [lo, hi] (f'' may be None: first order only)."""

    value: Callable[[np.ndarray, np.ndarray], Iv]
    d1: Callable[[np.ndarray, np.ndarray], Iv]
    d2: Callable[[np.ndarray, np.ndarray], Iv] | None
    point: Callable[[np.ndarray], np.ndarray]  # f at a point (float64)
    domain: tuple[float, float] = (-math.inf, math.inf)  # open interval


def _square_value(lo: np.ndarray, hi: np.ndarray) -> Iv:
    near, far = _near_far(lo, hi)
    return _pad(near * near, far * far)


def relaxation_fn(op: Arithmetic, name: str = "") -> Fn:
    """An arithmetic op's value, slope and curvature enclosures: its relaxation's functions
    (lsa_models/operators/arithmetic.py) at the ends of the range, padded outward; NotAffine
    where the op has none (Pow by an exponent other than 2, 0.5, -1, -0.5)."""
    try:
        r = op.relaxation()
    except ModeNotImplemented as e:
        raise NotAffine(f"{op.op_type} node {name}: {e}") from None
    rv = r.value

    def value(lo: np.ndarray, hi: np.ndarray) -> Iv:
        return _pad(*rv(lo, hi)) if rv is not None else _mono(r.point, lo, hi)

    def d2(lo: np.ndarray, hi: np.ndarray) -> Iv:
        return (r.d2(lo), r.d2(hi)) if r.exact_d2 else _mono(r.d2, lo, hi)
    return Fn(value, lambda lo, hi: _mono(r.d1, lo, hi), d2, r.point, r.domain)


EXP = relaxation_fn(Exp("Exp"))
SQUARE = relaxation_fn(Pow("Pow", {"exponent": 2.0}))
RECIPROCAL = relaxation_fn(Reciprocal("Reciprocal"))
RSQRT = relaxation_fn(Pow("Pow", {"exponent": -0.5}))
SQRT = relaxation_fn(Sqrt("Sqrt"))


def activation_fn(op: Activation, name: str = "") -> Fn:
    """An activation's value, slope and curvature enclosures (lsa_models/operators/); NotAffine
    where the op has no affine relaxation."""
    empty = np.zeros(0)
    try:
        op.subgradient_range(empty, empty)
        curved = op.d2_range(empty, empty) is not None
    except ModeNotImplemented as e:
        raise NotAffine(f"{op.op_type} node {name}: {e}") from None

    def d2(lo: np.ndarray, hi: np.ndarray) -> Iv:
        r = op.d2_range(lo, hi)
        assert r is not None
        return r
    return Fn(op.value_range, op.subgradient_range, d2 if curved else None, op.point)


# max(x, 0): convex, so `elementwise`'s chord candidate applies (f'' >= 0: given as [0, inf],
# which leaves the second-order candidate infinite): on a range [l, u] around 0 the chord
# lam = u / (u - l) with the change in [0, -lam l] (DeepZ's relaxation)
RELU = activation_fn(Relu("Relu"))


def chain_fn(chain: fused.Chain, consts: dict[str, float]) -> Fn:
    """A fused elementwise chain (fused.py) through its interval differentiation."""
    def value(lo: np.ndarray, hi: np.ndarray) -> Iv:
        return fused.ranges(chain, consts, lo, hi)[0]

    def d1(lo: np.ndarray, hi: np.ndarray) -> Iv:
        return fused.ranges(chain, consts, lo, hi)[1]

    def d2(lo: np.ndarray, hi: np.ndarray) -> Iv:
        r = fused.second(chain, consts, lo, hi)
        if r is None:
            return np.full_like(lo, -np.inf), np.full_like(lo, np.inf)
        return r

    def point(x: np.ndarray) -> np.ndarray:
        lo, hi = fused.evaluate(chain, consts, x, x)[0]
        return 0.5 * (lo + hi)

    return Fn(value, d1, d2, point)


# the chord candidate of `elementwise` for convex f, and its grid of tangent lines
CHORD, CHORD_POINTS = True, 16


def _chord(fn: Fn, hlo: np.ndarray, hhi: np.ndarray, tlo: np.ndarray, thi: np.ndarray,
           convex: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For f convex on [hlo, hhi] (f'' >= 0 there: `convex`), the chord's slope lam and
    f(t) - f(t0) - lam (t - t0) = h(t) - h(t0) in shift +- err for all t in [hlo, hhi] and
    t0 in [tlo, thi], h = f - lam t (convex): h <= its larger end value, and h >= the lower
    envelope of its tangent lines at CHORD_POINTS + 1 grid points (on [t_k, t_k+1], h is above
    both lines, slopes from f' enclosures: the smallest one rightwards of t_k, the largest
    leftwards of t_k+1), whose minimum per segment is at an end or where the lines cross.
    Entries that are not convex, or of zero width, get err = inf (never taken)."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        w = hhi - hlo
        fl, fu = fn.value(hlo, hlo), fn.value(hhi, hhi)
        lam = np.where(w > 0, (0.5 * (fu[0] + fu[1]) - 0.5 * (fl[0] + fl[1])) / w, 0.0)
        g = np.linspace(0.0, 1.0, CHORD_POINTS + 1)
        t = hlo[..., None] + w[..., None] * g  # (..., K + 1), the ends exactly hlo and hhi
        t[..., -1] = hhi
        ft = fn.value(t, t)
        lt = lam[..., None] * t
        pad = 4 * U * np.abs(lt) + _REL * (np.abs(ft[0]) + np.abs(ft[1]))
        h_lo, h_hi = ft[0] - lt - pad, ft[1] - lt + pad
        dt = fn.d1(t, t)
        s_lo = dt[0] - lam[..., None] - 4 * U * np.abs(lam[..., None])
        s_hi = dt[1] - lam[..., None] + 4 * U * np.abs(lam[..., None])
        hmax = np.maximum(h_hi[..., 0], h_hi[..., -1])
        ta, tb = t[..., :-1], t[..., 1:]
        ha, hb = h_lo[..., :-1], h_lo[..., 1:]
        sa, sb = s_lo[..., :-1], s_hi[..., 1:]  # A(t) = ha + sa (t - ta), B(t) = hb + sb (t - tb)
        at_a = np.maximum(ha, hb + sb * (ta - tb))
        at_b = np.maximum(ha + sa * (tb - ta), hb)
        den = sa - sb
        tx = (hb - ha - sb * tb + sa * ta) / np.where(den != 0, den, np.inf)
        inside = (den != 0) & (tx > ta) & (tx < tb)
        cross = np.where(inside, ha + sa * (tx - ta), np.inf)
        seg = np.minimum(np.minimum(at_a, at_b), cross)
        seg = seg - _REL * (np.abs(ha) + np.abs(hb)
                            + (np.abs(sa) + np.abs(sb)) * (tb - ta))
        hmin = seg.min(axis=-1)
        # h(t0) for the true centre t0 in [tlo, thi]
        f0 = fn.value(tlo, thi)
        l0 = np.stack([lam * tlo, lam * thi])
        h0_lo = f0[0] - l0.max(axis=0) - 4 * U * np.abs(l0).max(axis=0) - _REL * np.abs(f0[0])
        h0_hi = f0[1] - l0.min(axis=0) + 4 * U * np.abs(l0).max(axis=0) + _REL * np.abs(f0[1])
        lo_, hi_ = hmin - h0_hi, hmax - h0_lo
        shift = 0.5 * (lo_ + hi_)
        err = _up(0.5 * (hi_ - lo_), 2) + _REL * np.abs(shift) + TINY
        ok = convex & (w > 0) & np.isfinite(err) & np.isfinite(shift) & np.isfinite(lam)
    return (np.where(ok, lam, 0.0), np.where(ok, shift, 0.0), np.where(ok, err, np.inf))


def _iv_mul(a: Iv, b: Iv) -> Iv:
    c = np.stack([a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1]])
    c = np.where(np.isnan(c), np.inf, c)  # 0 * inf: no information
    return _pad(c.min(axis=0), c.max(axis=0))


def elementwise(x: Aff, fn: Fn, ball: Ball, xlo: np.ndarray | None = None,
                xhi: np.ndarray | None = None, out_c: np.ndarray | None = None,
                out_m: np.ndarray | None = None) -> Aff:
    """y = f(x) entrywise. [xlo, xhi]: a known range of x (intersected with the form's);
    out_c, out_m: y's centre and margin when y is a graph tensor (else f(c), propagated).

    With t0 = x(X0) in c +- m and D = x(X) - t0 in [dlo, dhi]:
      second order: f(t0 + D) - f(t0) = lam D + (f'(t0) - lam) D + f''(xi) D^2 / 2, lam the
        middle of f' over [c - m, c + m];
      first order:  = lam D + (f'(xi) - lam) D, lam the middle of f' over the whole range;
      interval:     in [f range - f(t0)].
    Every entry keeps the narrowest."""
    dlo, dhi = dev(x, ball)
    if xlo is not None and xhi is not None:
        dlo = np.maximum(dlo, xlo - x.c - x.m)
        dhi = np.minimum(dhi, xhi - x.c + x.m)
        dhi = np.maximum(dhi, dlo)
    tlo, thi = x.c - x.m, x.c + x.m
    hlo = np.minimum(tlo + np.minimum(dlo, 0.0), tlo)
    hhi = np.maximum(thi + np.maximum(dhi, 0.0), thi)
    hlo, hhi = _pad(hlo, hhi)
    if xlo is not None and xhi is not None:  # both x(X) and x(X0) lie in [xlo, xhi]
        hlo, hhi = np.maximum(hlo, xlo), np.minimum(hhi, xhi)
    lo_d, hi_d = fn.domain
    if np.any(hlo <= lo_d) or np.any(hhi >= hi_d):
        raise NotAffine("a range leaves the function's domain")
    if out_c is None:
        out_c = fn.point(x.c)
        vlo, vhi = fn.value(tlo, thi)
        out_m = _up(np.maximum(vhi - out_c, out_c - vlo), 2) + _REL * np.abs(out_c) + TINY
    assert out_m is not None
    near, far = _near_far(dlo, dhi)
    lin_x = lin(x, ball)
    # candidates (lam, shift, err): the change is lam (o + a z + [-b, b]) + shift +- err
    cands: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    with np.errstate(over="ignore", invalid="ignore"):
        glo, ghi = fn.d1(hlo, hhi)  # first order
        lam = 0.5 * (glo + ghi)
        cands.append((lam, np.zeros_like(lam), _up(np.maximum(ghi - lam, lam - glo), 2) * far))
        if fn.d2 is not None:  # second order
            g0 = fn.d1(tlo, thi)
            qlo, qhi = fn.d2(hlo, hhi)
            lam = 0.5 * (g0[0] + g0[1])
            r2 = _iv_mul((0.5 * qlo, 0.5 * qhi), _square_value(dlo, dhi))
            mid = 0.5 * (r2[0] + r2[1])
            cands.append((lam, mid, _up(np.maximum(g0[1] - lam, lam - g0[0]), 2) * far
                          + _up(0.5 * (r2[1] - r2[0]), 2) + _REL * np.abs(mid)))
            if CHORD and np.any(qlo >= 0):
                cands.append(_chord(fn, hlo, hhi, tlo, thi, qlo >= 0))
        # an entry whose candidate overflowed gets an infinite width (never taken)
        widths = [np.where(np.isfinite(la) & np.isfinite(sh) & np.isfinite(er),
                           np.abs(la) * (lin_x + x.b) + er, np.inf) for la, sh, er in cands]
    lam, shift, err = (np.where(np.isfinite(widths[0]), v, 0.0) for v in cands[0])
    width = widths[0]
    for (lam2, shift2, err2), w2 in zip(cands[1:], widths[1:], strict=True):
        take = w2 < width
        lam, shift, err = (np.where(take, lam2, lam), np.where(take, shift2, shift),
                           np.where(take, err2, err))
        width = np.minimum(w2, width)
    # the interval: where COLLAPSE times narrower (or where no linear candidate is finite),
    # the entry forgets its linear part
    vlo, vhi = fn.value(hlo, hhi)
    ilo, ihi = vlo - out_c - out_m, vhi - out_c + out_m
    imid = 0.5 * (ilo + ihi)
    ihw = _up(0.5 * (ihi - ilo) + _REL * (np.abs(vlo) + np.abs(vhi) + np.abs(out_c) + out_m),
              2) + TINY
    if not (np.all(np.isfinite(width) | np.isfinite(ihw)) and np.all(np.isfinite(imid)
                                                                       | np.isfinite(width))):
        raise NotAffine("a range overflows")
    take = (ihw < COLLAPSE * width) | ~np.isfinite(width)
    if np.any(take):
        lam = np.where(take, 0.0, lam)
        shift = np.where(take, imid, shift)
        err = np.where(take, ihw, err)
    return _scaled(x, lam, err, out_c, out_m, lin_x, shift)


def _scaled(x: Aff, lam: np.ndarray, err: np.ndarray, c: np.ndarray, m: np.ndarray,
            lin_x: np.ndarray, shift: np.ndarray | None = None) -> Aff:
    """lam * (o + a d + [-b, b]) + shift + [-err, err], its rounding added: fl(lam a) is
    within U |lam a| of lam a entrywise, so its change over the ball within U |lam| lin(x)."""
    o = lam * x.o
    if shift is not None:
        o = o + shift
    al = np.abs(lam)
    b = _up(al * x.b + 4 * U * (al * (np.abs(x.o) + lin_x) + np.abs(o)), 4)

    def fill(out: np.ndarray) -> None:  # lam * a, written where the form keeps it
        np.multiply(lam[..., None], x.a, out=out)
    a, b = fresh_fill(fill, x.a.shape[-1], b, _up(err, 1))
    return Aff(c, m, o, a, b)


# --- products of two forms ---

# the exact quadratic form of a MatMul's two linear parts is formed while it holds at most
# this many entries (output entries x P^2), else its terms are bounded one by one
MAX_QUAD_ENTRIES = 8_000_000


def _quadratic(ux: np.ndarray, uy: np.ndarray, ball: Ball, bound: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray] | None:
    """An enclosure of sum_j (ux_ij . d)(uy_jk . d) over the ball for every (i, k): d^T M d
    with M = sum_j ux_ij uy_jk^T (P x P). inf-ball: the diagonal's terms are one-sided
    (d_p^2 in [0, eps^2]), the rest bounded by sum |M_pq| eps^2; 2-ball: the extreme
    eigenvalues of M's symmetric part times eps^2 (LAPACK's are exact for a matrix within
    c P u ||M||_F of it: Weyl's inequality, the slack added). `bound` (the terms' product
    bound, sum_j li_x li_y) scales the rounding of M's sums."""
    p = ux.shape[-1]
    n_out = int(np.prod(np.broadcast_shapes(ux.shape[:-3], uy.shape[:-3]))) * \
        ux.shape[-3] * uy.shape[-2]
    if n_out * p * p > MAX_QUAD_ENTRIES:
        return None
    m = np.einsum("...ijp,...jkq->...ikpq", ux, uy)
    e2 = ball.eps * ball.eps
    k = ux.shape[-2]
    if ball.norm == "inf":
        diag = np.diagonal(m, axis1=-2, axis2=-1)  # (..., i, k, P)
        off = np.maximum(np.abs(m).sum(axis=(-2, -1)) - np.abs(diag).sum(axis=-1), 0.0)
        off = _up(off, p * p + 2)
        lo = e2 * (np.minimum(diag, 0.0).sum(axis=-1) - off)
        hi = e2 * (np.maximum(diag, 0.0).sum(axis=-1) + off)
        slack = _REL * (np.abs(lo) + np.abs(hi)) + gamma(k + p * p) * bound
    else:
        sym = 0.5 * (m + np.swapaxes(m, -1, -2))
        # per support: the first attention's q k^T entries read two tokens' inputs
        w_lo, w_hi = extreme_eigs(sym.reshape(-1, p, p))
        fro = np.sqrt(np.square(sym).sum(axis=(-2, -1)))
        lo = e2 * np.minimum(w_lo.reshape(sym.shape[:-2]), 0.0)
        hi = e2 * np.maximum(w_hi.reshape(sym.shape[:-2]), 0.0)
        slack = e2 * 64 * p * U * fro + gamma(k + p) * bound + _REL * (np.abs(lo) + np.abs(hi))
    return lo - slack - TINY, hi + slack + TINY


def _quad_matrix(ux: np.ndarray, uy: np.ndarray, matmul: bool) -> np.ndarray | None:
    """M with (u_x . d)(u_y . d) summed = d^T M d per output entry, (*out, P, P): MatMul
    sum_j ux_ij uy_jk^T, elementwise ux uy^T (broadcast); None past MAX_QUAD_ENTRIES."""
    p = ux.shape[-1]
    if matmul:
        n_out = int(np.prod(np.broadcast_shapes(ux.shape[:-3], uy.shape[:-3]))) * \
            ux.shape[-3] * uy.shape[-2]
    else:
        n_out = int(np.prod(np.broadcast_shapes(ux.shape[:-1], uy.shape[:-1])))
    if n_out * p * p > MAX_QUAD_ENTRIES:
        return None
    if matmul:
        return np.einsum("...ijp,...jkq->...ikpq", ux, uy)
    return ux[..., :, None] * uy[..., None, :]


def _to_quad(m: np.ndarray, ball: Ball, bound: np.ndarray, k: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """d^T M d on the second-order symbols (affine.QUAD): the coefficients (*out, P(P+1)/2),
    the offset eps^2 / 2 tr M and the error: M's own rounding (each entry a sum of k products,
    within gamma_k of sum_j |ux_jp| |uy_jq|, whose eps^2-weighted sum over p, q is `bound` =
    sum_j li_x li_y) plus 1e-12 of the coefficients' and offset's magnitudes (the scalings)."""
    p = m.shape[-1]
    e2 = ball.eps * ball.eps
    diag = quad_cols(p)[1]
    coef = triu_pack_sym(m)  # (M_pq + M_qp) for p <= q; the diagonal holds 2 M_pp
    coef *= e2  # p < q: eps^2 (M_pq + M_qp)
    coef[..., diag] *= 0.25  # p = q: eps^2 M_pp / 2 = (eps^2 2 M_pp) / 4
    off = 0.5 * e2 * np.trace(m, axis1=-2, axis2=-1)
    err = gamma(k + 2) * bound + _REL * (np.abs(off) + np.abs(coef).sum(axis=-1))
    return coef, off, _up(err, p * p + 2)


def _put_quad(a: np.ndarray, o: np.ndarray, m: np.ndarray, base: int, ball: Ball,
              bound: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """d^T M d added to the form's linear part a (on the second-order symbols from column
    `base`) and offset o (`_to_quad`); returns them and the error: M's rounding and one
    rounding of every summed coefficient (1e-12 of their sizes, far above u)."""
    coef, off, err = _to_quad(m, ball, bound, k)
    t = coef.shape[-1]
    a = _cols(a, base + t)
    a[..., base:base + t] += coef
    return a, o + off, err + _REL * np.abs(a[..., base:base + t]).sum(axis=-1)


def _cross_budget(x: Aff, y: Aff, lix: np.ndarray, liy: np.ndarray, lsx: np.ndarray,
                  lsy: np.ndarray, ball: Ball, matmul: bool) -> float:
    """>= the sum over a product's entries of |Ix Sy + Sx Iy + Sx Sy| (I the input parts, S
    the noise symbols' parts; |I| <= li, |S| <= ls entrywise): each of the three terms the
    smaller of its entries' sizes summed (what the box pays) and Cauchy-Schwarz over the
    whole (broadcast) tensors with ||I||_F <= `_input_norm` and ||S||_F <= `_symbol_norm`.
    Elementwise: sum_i |Ix_i Sy_i| <= ||Ix|| ||Sy||. MatMul (n, k) @ (k, m):
    sum_ij |sum_k Ix_ik Sy_kj| <= sum_ik |Ix_ik| c_k (c_k = sum_j ls_y,kj) <= sqrt(n) ||c||
    ||Ix||, and <= sum_ij ||Ix_i:|| ||Sy_:j|| <= sqrt(n m) ||Ix|| ||Sy||; likewise the others;
    batches by Cauchy-Schwarz once more."""
    if matmul:
        batch = np.broadcast_shapes(x.c.shape[:-2], y.c.shape[:-2])
        xs = (*batch, *x.c.shape[-2:])
        ys = (*batch, *y.c.shape[-2:])
    else:
        xs = ys = np.broadcast_shapes(x.c.shape, y.c.shape)
    bx, by = np.broadcast_to(lsx, xs), np.broadcast_to(lsy, ys)
    ix, iy = _input_norm(x, xs, ball), _input_norm(y, ys, ball)
    sx, sy = _symbol_norm(x, xs, bx, ball), _symbol_norm(y, ys, by, ball)
    if matmul:
        n, m = xs[-2], ys[-1]
        nm = math.sqrt(n * m)
        t1 = min(float((lix @ lsy).sum()), math.sqrt(n) * _norm2(by.sum(axis=-1)) * ix,
                 nm * ix * sy)
        t2 = min(float((lsx @ liy).sum()), math.sqrt(m) * _norm2(bx.sum(axis=-2)) * iy,
                 nm * sx * iy)
        t3 = min(float((bx @ by).sum()), nm * sx * sy)
    else:
        t1 = min(float((lix * lsy).sum()), ix * sy)
        t2 = min(float((lsx * liy).sum()), sx * iy)
        t3 = min(float((bx * by).sum()), sx * sy)
    return _up(np.asarray(t1 + t2 + t3), 4).item() * (1 + 1e-10)


def _norm2(v: np.ndarray) -> float:
    """>= the Frobenius norm of v."""
    return float(np.sqrt(_up(np.square(v).sum(), v.size + 2))) * (1 + 4 * U)


def _copies(v: float, f: Aff, shape: tuple[int, ...]) -> float:
    """v, a Frobenius-norm bound of f's own entries, for f broadcast to `shape` (rounded up):
    broadcasting repeats every entry the same k = |shape| / |f| times, so a broadcast
    tensor's Frobenius norm is sqrt(k) times its own at every point (and so is its sup over
    the ball and the symbols: the bounds are taken on f's own rows and scaled, not on k
    copies of them)."""
    k = int(np.prod(shape)) // max(1, int(np.prod(f.a.shape[:-1])))
    scale = 1.0 if k <= 1 else math.sqrt(k) * (1 + 4 * U)
    return _up(np.asarray(v * scale), 2).item()


def _input_norm(f: Aff, shape: tuple[int, ...], ball: Ball) -> float:
    """>= sup ||I(X)||_F over the ball for f's input part broadcast to `shape`
    (`affine.input_radius` of all its own rows as one block, times `_copies`)."""
    p = ball.size
    return _copies(float(input_radius(f.a[..., :p].reshape(1, -1, p), ball)[0]), f, shape)


def _symbol_norm(f: Aff, shape: tuple[int, ...], ls: np.ndarray, ball: Ball) -> float:
    """>= sup ||S||_F for f's symbols' part broadcast to `shape`: the smaller of the root
    sum of the entries' sizes `ls` and `affine.symbol_radius` of the whole tensor as one
    block (f's own rows, times `_copies`)."""
    whole = float(symbol_radius(f.a.reshape(1, -1, f.a.shape[-1]), ball)[0])
    return min(_norm2(ls), _copies(whole, f, shape))


# entries of one block of the row-blocked helpers below (as affine.ABS_SUM_BLOCK: ~2 MB)
_BLOCK = 1 << 18


def _lin_of_sum(u: np.ndarray, v: np.ndarray, n: int, sub: bool, ball: Ball) -> np.ndarray:
    """`lin` of the coefficients u + v (`sub`: u - v, `_sum_cols`) for entries without a box
    or offset, a block of rows at a time (`lin` is a function of each row alone: the sum is
    never held whole)."""
    shape = np.broadcast_shapes(u.shape[:-1], v.shape[:-1])
    if reference() or u.shape[:-1] != shape or v.shape[:-1] != shape:
        c = np.zeros(shape)
        return lin(Aff(c, c, c, _sum_cols(u, v, n, sub), c), ball)
    rows = int(np.prod(shape))
    uf, vf = u.reshape(rows, u.shape[-1]), v.reshape(rows, v.shape[-1])
    out = np.empty(rows)
    step = max(1, _BLOCK // max(1, n))
    for i in range(0, rows, step):
        blk = _sum_cols(uf[i:i + step], vf[i:i + step], n, sub)
        z = np.zeros(blk.shape[0])
        li, ls = _split_lin(Aff(z, z, z, blk, z), ball)  # not memoised: a temporary
        out[i:i + step] = _up(li + ls, 2)  # as `lin`
    return out.reshape(shape)


def _rank_one(x: Aff, y: Aff, ball: Ball, lx: np.ndarray, ly: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """An enclosure of Lx Ly = (ax . z)(ay . z) over the ball and the symbols, entrywise
    (broadcast; z = (d, e)): it is ((ax + ay) . z)^2 / 4 - ((ax - ay) . z)^2 / 4, so within
    [-lin(ax - ay)^2 / 4, lin(ax + ay)^2 / 4], and within +-lin(ax) lin(ay)."""
    n = _width(x, y)
    sp = _lin_of_sum(x.a, y.a, n, False, ball)
    sm = _lin_of_sum(x.a, y.a, n, True, ball)
    ii = np.broadcast_to(lx * ly, sp.shape)
    lo = np.maximum(-_up(0.25 * sm * sm, 2), -ii)
    hi = np.minimum(_up(0.25 * sp * sp, 2), ii)
    return lo, hi


def _pairs(x: Aff, y: Aff, ball: Ball, matmul: bool) -> np.ndarray | None:
    """The bilinear part (u_x . d)(v_y . s) + (v_x . s)(u_y . d) of Lx Ly as coefficients of
    the pair symbols psi_pq = d_p s_q / eps (affine.PAIRS), (*out, P, P); None when pairs are
    off or neither operand depends on the direction s."""
    spec = PAIRS.get()
    if spec is None:
        return None
    p = ball.size
    sx = x.a[..., p:2 * p] if x.a.shape[-1] > p else None
    sy = y.a[..., p:2 * p] if y.a.shape[-1] > p else None
    if (sx is None or not np.any(sx)) and (sy is None or not np.any(sy)):
        return None
    sx = np.zeros(x.a.shape[:-1] + (p,)) if sx is None or sx.shape[-1] < p else sx
    sy = np.zeros(y.a.shape[:-1] + (p,)) if sy is None or sy.shape[-1] < p else sy
    ux, uy = x.a[..., :p], y.a[..., :p]
    if matmul:
        out = np.einsum("...ijp,...jkq->...ikpq", ux, sy) + \
            np.einsum("...jkp,...ijq->...ikpq", uy, sx)
    else:
        out = ux[..., :, None] * sy[..., None, :] + uy[..., :, None] * sx[..., None, :]
    return out * ball.eps


def _with_pairs(x: Aff, y: Aff, ball: Ball, matmul: bool, a: np.ndarray, pairs: np.ndarray,
                quad: tuple[np.ndarray, np.ndarray] | None,
                mul: Callable[[np.ndarray, np.ndarray], np.ndarray]
                ) -> tuple[np.ndarray, np.ndarray]:
    """Lx Ly with the pair symbols: with Lx = u_x . d + v_x . s + r_x . e (input, direction,
    the other symbols), Lx Ly - pairs = (u_x . d)(u_y . d) + (v_x . s)(v_y . s)
    + (u_x . d + v_x . s)(r_y . e) + (r_x . e) Ly, the first by the quadratic form (MatMul) or
    the identity of `_rank_one` on the input parts, the rest by their sizes. Returns the
    linear part with the pairs' coefficients added and the rest's half width."""
    p = ball.size
    base = PAIRS.get()[1]  # type: ignore[index]

    def sizes(f: Aff) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        li = _up(ball.eps * np.abs(f.a[..., :p]).sum(axis=-1), p + 2)
        ls = _up(np.abs(f.a[..., p:2 * p]).sum(axis=-1), p + 2)
        lr = _up(np.abs(f.a[..., 2 * p:]).sum(axis=-1), f.a.shape[-1] + 2)
        return li, ls, lr
    lix, lsx, lrx = sizes(x)
    liy, lsy, lry = sizes(y)
    if quad is None:
        if matmul:
            ii = mul(lix, liy)
            quad = (-ii, ii)
        else:
            ux, uy = np.broadcast_arrays(x.a[..., :p], y.a[..., :p])
            sp = _up(ball.eps * np.abs(ux + uy).sum(axis=-1), p + 2)
            sm = _up(ball.eps * np.abs(ux - uy).sum(axis=-1), p + 2)
            ii = np.broadcast_to(lix * liy, sp.shape)
            quad = (np.maximum(-_up(0.25 * sm * sm, 2), -ii),
                    np.minimum(_up(0.25 * sp * sp, 2), ii))
    qhw = np.maximum(np.abs(quad[0]), np.abs(quad[1]))  # symmetric: no offset kept
    err = qhw + mul(lsx, lsy) + mul(lix + lsx, lry) + mul(lrx, liy + lsy + lry)
    # the pairs' own rounding: each coefficient a sum of (MatMul: 2k) products times eps,
    # within gamma of the sum of their sizes, sum_pq eps |u_p| |v_q| = (eps |u|_1) |v|_1
    k = x.c.shape[-1] if matmul else 1
    err = err + gamma(2 * k + 3) * (mul(lix, lsy) + mul(lsx, liy))
    w = max(a.shape[-1], base + p * p)
    out = np.zeros(a.shape[:-1] + (w,))
    out[..., :a.shape[-1]] = a
    out[..., base:base + p * p] += pairs.reshape(pairs.shape[:-2] + (p * p,))
    return out, _up(err, 4)


def _sum_cols(u: np.ndarray, v: np.ndarray, n: int, sub: bool = False) -> np.ndarray:
    """_cols(u, n) + _cols(v, n) (broadcast; `sub`: u - v) into one new array: the columns
    both hold summed, the others copied (negated), the rest 0 (the same numbers without the
    widened copies)."""
    if reference():
        return _cols(u, n) - _cols(v, n) if sub else _cols(u, n) + _cols(v, n)
    out = np.empty((*np.broadcast_shapes(u.shape[:-1], v.shape[:-1]), n))
    _sum_into(u, v, out, sub)
    return out


def _sum_into(u: np.ndarray, v: np.ndarray, out: np.ndarray, sub: bool = False) -> None:
    """`_sum_cols` written into out (..., n)."""
    nu, nv = u.shape[-1], v.shape[-1]
    lo, hi = min(nu, nv), max(nu, nv)
    (np.subtract if sub else np.add)(u[..., :lo], v[..., :lo], out=out[..., :lo])
    if nu > nv:
        out[..., lo:hi] = u[..., lo:]
    elif sub:
        np.negative(v[..., lo:], out=out[..., lo:hi])
    else:
        out[..., lo:hi] = v[..., lo:]
    out[..., hi:] = 0.0


def _product_coefficients(x: Aff, y: Aff, wx: np.ndarray, wy: np.ndarray, matmul: bool
                          ) -> Callable[[np.ndarray], None]:
    """What writes the product's linear part wx Dy + Dx wy (`product`) into an array of the
    output's shape (*S, n >= both widths): MatMul as two BLAS products, elementwise as
    Dx wy then wx Dy added in place (a sum is the same either way round)."""
    def fill_matmul(out: np.ndarray) -> None:
        if reference():
            n = out.shape[-1]
            ay, ax = np.moveaxis(_cols(y.a, n), -1, 0), np.moveaxis(_cols(x.a, n), -1, 0)
            out[...] = np.moveaxis(np.matmul(wx, ay) + np.matmul(ax, wy), 0, -1)
            return
        ay = np.moveaxis(y.a, -1, 0)  # (P, ..., j, k)
        ax = np.moveaxis(x.a, -1, 0)  # (P, ..., i, j)
        _sum_into(np.moveaxis(np.matmul(wx, ay), 0, -1),
                  np.moveaxis(np.matmul(ax, wy), 0, -1), out)

    def fill_mul(out: np.ndarray) -> None:
        if reference():
            n = out.shape[-1]
            out[...] = wx[..., None] * _cols(y.a, n) + _cols(x.a, n) * wy[..., None]
            return
        nx, ny = x.a.shape[-1], y.a.shape[-1]
        np.multiply(x.a, wy[..., None], out=out[..., :nx])
        out[..., nx:] = 0.0
        out[..., :ny] += wx[..., None] * y.a
    return fill_matmul if matmul else fill_mul


def product(x: Aff, y: Aff, ball: Ball, matmul: bool, out_c: np.ndarray | None = None,
            out_m: np.ndarray | None = None) -> Aff:
    """x * y (broadcast) or x @ y. With x = x0 + Dx, x0 = cx + ex (|ex| <= mx) and
    Dx = ox + Lx + bx (Lx = ax z its linear part, |bx| <= its box):
      x y - x0 y0 = cx Dy + Dx cy + ex Dy + Dx ey + Dx Dy,
      Dx Dy = ox oy + ox Ly + Lx oy + Lx Ly + bx Dy + (ox + Lx) by.
    The linear terms stay linear; Lx Ly is the quadratic form of the input parts (MatMul:
    `_quadratic`) plus the products of the symbol parts' sizes; the rest goes to the box."""
    mul: Callable[[np.ndarray, np.ndarray], np.ndarray] = np.matmul if matmul else np.multiply
    if matmul and (x.c.ndim < 2 or y.c.ndim < 2):
        raise NotAffine("MatMul of a vector")
    ycx = y.c  # what x's change multiplies
    if matmul and x.stochastic:
        # sum_j Dx_ij = 0 for the true values, so Dx @ y0 = Dx @ (y0 - mu) for any row mu:
        # the middle of every column of y's centre
        ycx = y.c - 0.5 * (y.c.max(axis=-2, keepdims=True) + y.c.min(axis=-2, keepdims=True))
    lix, lsx = split_lin(x, ball)
    liy, lsy = split_lin(y, ball)
    lx, ly = _up(lix + lsx, 2), _up(liy + lsy, 2)  # lin(x), lin(y)
    dxlo, dxhi = dev(x, ball)
    dylo, dyhi = dev(y, ball)
    fx = np.maximum(np.abs(dxlo), np.abs(dxhi))
    fy = np.maximum(np.abs(dylo), np.abs(dyhi))
    n = _width(x, y)
    wx, wy = x.c + x.o, ycx + y.o  # what the other's linear part multiplies
    fill = _product_coefficients(x, y, wx, wy, matmul)
    k = x.c.shape[-1] if matmul else 2
    o = mul(x.c, y.o) + mul(x.o, ycx) + mul(x.o, y.o)
    a: np.ndarray | None = None  # made here where a rule below reads it, else in `fresh`

    def made() -> np.ndarray:
        shape = o.shape if matmul else np.broadcast_shapes(x.a.shape[:-1], y.a.shape[:-1])
        out = np.empty((*shape, n))
        fill(out)
        return out
    acx, acy = np.abs(x.c), np.abs(ycx)
    aox, aoy = np.abs(x.o), np.abs(y.o)
    g = gamma(k + 3)
    quad = None
    budget: float | None = None
    pp = ball.size
    qbase = QUAD.get()
    qm = None if qbase is None else _quad_matrix(x.a[..., :pp], y.a[..., :pp], matmul)
    if qm is None and matmul:
        quad = _quadratic(x.a[..., :pp], y.a[..., :pp], ball, mul(lix, liy))
    pairs = _pairs(x, y, ball, matmul)
    if pairs is not None:
        # the bilinear (d, s) part on the pair symbols; the (d, d) part on the second-order
        # symbols where they are on (its bound then 0 in the rest), else bounded there
        zq = None if qm is None else (np.zeros(qm.shape[:-2]), np.zeros(qm.shape[:-2]))
        a, err = _with_pairs(x, y, ball, matmul, made(), pairs, quad if zq is None else zq,
                             mul)
        qmid = np.zeros_like(err)
        if qm is not None and qbase is not None:
            a, o, qerr = _put_quad(a, o, qm, qbase, ball, mul(lix, liy), k)
            err = err + qerr
    elif qm is not None and qbase is not None:
        # the input parts' product on the second-order symbols (affine.QUAD); the rest of
        # Lx Ly (input part x the symbols', symbols' x symbols') by their sizes
        a, o, qerr = _put_quad(made(), o, qm, qbase, ball, mul(lix, liy), k)
        qmid = np.zeros_like(qerr)
        err = qerr + mul(lix, lsy) + mul(lsx, liy) + mul(lsx, lsy)
        if GROUPS.get() is not None:
            budget = float(qerr.sum()) + _cross_budget(x, y, lix, liy, lsx, lsy, ball, matmul)
    elif quad is None and not matmul:  # the whole linear parts, symbols included
        lo, hi = _rank_one(x, y, ball, lx, ly)
        qmid = 0.5 * (lo + hi)
        err = 0.5 * (hi - lo) + _REL * np.abs(qmid)
    else:
        if quad is None:
            ii = mul(lix, liy)
            quad = (-ii, ii)
        qmid = 0.5 * (quad[0] + quad[1])
        err = 0.5 * (quad[1] - quad[0]) + _REL * np.abs(qmid) + \
            mul(lix, lsy) + mul(lsx, liy) + mul(lsx, lsy)
    o = o + qmid
    b = mul(acx, y.b) + mul(x.b, acy) + mul(x.m, fy) + mul(fx, y.m) + \
        mul(x.b, aoy + ly + y.b) + mul(aox + lx, y.b)
    # rounding of the products and sums forming o and a (a's change over the ball <= its
    # entries' error times the ball, as for lin)
    b = b + g * (mul(acx + aox, ly) + mul(lx, acy + aoy) + mul(acx, aoy) + mul(aox, acy)
                 + mul(aox, aoy)) + g * np.abs(o)
    b = _up(b, k + 4)
    # Lx Ly: a symbol per output entry
    if a is None:
        a, b = fresh_fill(fill, n, b, _up(err, k + 4), budget)
    else:
        a, b = fresh(a, b, _up(err, k + 4), budget)
    if out_c is None:
        out_c = mul(x.c, y.c)
        out_m = _up(mul(acx, y.m) + mul(x.m, np.abs(y.c)) + mul(x.m, y.m)
                    + g * mul(acx, np.abs(y.c)),
                    k + 4) + TINY
    assert out_m is not None
    return Aff(out_c, out_m, o, a, b)


# --- linear and layout ops (through the op itself, as rules.LinearRule / LayoutRule) ---

def _torch(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(x, dtype=np.float64, order="C"))


def linear(node: Node, args: list, var: list[int], out_c: np.ndarray, out_m: np.ndarray,
           ball: Ball) -> Aff:
    """Ops linear in their input-dependent operands: o and a through the op (constant
    addends dropped: they cancel in T(X) - T0), b through |L| with the rounding of o, a."""
    def run(nd: Node, fixed: list[torch.Tensor | None], xs: list[np.ndarray]) -> np.ndarray:
        ins = list(fixed)
        for i, xx in zip(var, xs, strict=True):
            ins[i] = _torch(xx)
        return OPS[nd.op_type].run(nd, ins, CTX)[0].numpy()

    vals: list[Aff] = [args[i] for i in var]
    fixed, absn = linear_consts(node, args, False, Aff), _abs_node(node)
    fixed_abs = linear_consts(node, args, True, Aff)
    o = run(node, fixed, [v.o for v in vals])
    w = _width(*vals)
    a = _additive(node, args, var, vals, w)
    if a is None:
        a = run_tangents(node, fixed, var, [_cols(v.a, w) for v in vals])
    k = max(int(np.prod(v.shape)) if v is not None else 1 for v in args)
    g = gamma(k)
    spread = run(absn, fixed_abs, [v.b + g * (np.abs(v.o) + rough_lin(v, ball))
                                   for v in vals])
    b = _up(np.broadcast_to(spread, out_c.shape) + g * np.abs(o), k + 4)
    # forms are never written in place; a strided result is copied as the reference walk
    # does: the next product's BLAS kernel (its summation order) follows the layout, and the
    # same layout keeps the numbers bit for bit (both orders are within gamma(k))
    if a.shape[:-1] != out_c.shape or reference() or not a.flags.c_contiguous:
        a = np.broadcast_to(a, (*out_c.shape, a.shape[-1])).copy()
    return Aff(out_c, out_m, np.broadcast_to(o, out_c.shape).copy(), a, b)


def _additive(node: Node, args: list, var: list[int], vals: list[Aff], w: int
              ) -> np.ndarray | None:
    """The linear part of Add / Sub / Neg without the op run on every column, where no
    operand is broadcast: a form plus a constant keeps its coefficients (x + 0 and -x are
    exact), two forms add theirs (the same sums the op forms, into one array instead of
    through widened copies); None for anything else."""
    t = node.op_type
    if reference() or t not in ("Add", "Sub", "Neg") or len(args) > 2:
        return None
    shape = vals[0].shape
    if any(v is None for v in args) or any(v.shape != shape for v in vals) or \
            np.broadcast_shapes(*(v.shape if isinstance(v, Aff) else np.shape(v)
                                  for v in args)) != shape:
        return None
    if t == "Neg":
        return -vals[0].a
    if len(var) == 1:
        return -vals[0].a if t == "Sub" and var == [1] else vals[0].a
    x, y = vals
    out = np.empty((*shape, w))
    nx, ny = x.a.shape[-1], y.a.shape[-1]
    if nx >= ny:
        out[..., nx:] = 0.0
        np.add(x.a[..., :ny], y.a, out=out[..., :ny]) if t == "Add" else \
            np.subtract(x.a[..., :ny], y.a, out=out[..., :ny])
        out[..., ny:nx] = x.a[..., ny:]
    else:
        out[..., ny:] = 0.0
        np.add(x.a, y.a[..., :nx], out=out[..., :nx]) if t == "Add" else \
            np.subtract(x.a, y.a[..., :nx], out=out[..., :nx])
        if t == "Add":
            out[..., nx:ny] = y.a[..., nx:]
        else:
            np.negative(y.a[..., nx:], out=out[..., nx:ny])
    return out


def layout(node: Node, args: list, centers: list[np.ndarray | None], p: int) -> list:
    """Ops that move entries: gathered by index codes (exact)."""
    ins: list[torch.Tensor | None] = []
    p = max([p] + [v.a.shape[-1] for v in args if isinstance(v, Aff)])
    rows_o, rows_a, rows_b = [np.zeros(1)], [np.zeros((1, p))], [np.zeros(1)]
    offset = 1
    for v in args:
        if isinstance(v, Aff):
            n = v.c.size
            ins.append(_torch(np.arange(offset, offset + n, dtype=np.float64).reshape(v.shape)))
            rows_o.append(v.o.reshape(-1))
            rows_a.append(_cols(v.a.reshape(n, -1), p))
            rows_b.append(v.b.reshape(-1))
            offset += n
        elif v is None:
            ins.append(None)
        elif np.issubdtype(v.dtype, np.floating):
            ins.append(_torch(np.zeros_like(v, dtype=np.float64)))
        else:
            ins.append(torch.from_numpy(np.array(v)))
    codes = OPS[node.op_type].run(node, ins, CTX)
    forms = [v for v in args if isinstance(v, Aff)]
    if len(forms) == 1 and forms[0].a.shape[-1] == p and not reference():
        one = _layout_one(forms[0], codes, centers)
        if one is not None:
            return one
    o_all, a_all, b_all = (np.concatenate(rows_o), np.concatenate(rows_a),
                           np.concatenate(rows_b))
    out: list = []
    for code, c in zip(codes, centers, strict=False):
        if c is None or not code.is_floating_point():
            out.append(None)
            continue
        idx = code.numpy().astype(np.int64)
        c = np.asarray(c, dtype=np.float64)
        out.append(Aff(c, center_margin(c), o_all[idx], a_all[idx], b_all[idx]))
    return out


def _layout_one(v: Aff, codes: list[torch.Tensor], centers: list[np.ndarray | None]
                ) -> list | None:
    """`layout` where every output entry is an entry of the one form v (codes 1..n, no
    constant's 0): gathered from v's own rows, and where an output keeps v's order (a
    Reshape, Squeeze, Flatten) its arrays reshaped without a copy; None where a code is 0."""
    n = v.c.size
    out: list = []
    for code, c in zip(codes, centers, strict=False):
        if c is None or not code.is_floating_point():
            out.append(None)
            continue
        idx = code.numpy().astype(np.int64) - 1
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            return None
        c = np.asarray(c, dtype=np.float64)
        w = v.a.shape[-1]
        if idx.size == n and np.array_equal(idx.reshape(-1), np.arange(n)):
            out.append(Aff(c, center_margin(c), v.o.reshape(idx.shape),
                           v.a.reshape(*idx.shape, w), v.b.reshape(idx.shape)))
            continue
        out.append(Aff(c, center_margin(c), v.o.reshape(-1)[idx],
                       v.a.reshape(n, w)[idx], v.b.reshape(-1)[idx]))
    return out


# --- LayerNorm and softmax as chains ---

def _reduce(x: Aff, n: int, mean: bool, ball: Ball) -> Aff:
    """Sum (or mean) over the last axis, kept as a size-1 axis."""
    s = (1.0 / n) if mean else 1.0
    o = x.o.sum(axis=-1, keepdims=True) * s
    a = x.a.sum(axis=-2, keepdims=True) * s
    g = gamma(n + 1)
    b = _up((x.b + g * (np.abs(x.o) + rough_lin(x, ball))).sum(axis=-1, keepdims=True) * s
            + g * np.abs(o), n + 4)
    c = x.c.sum(axis=-1, keepdims=True) * s
    m = _up((x.m + g * np.abs(x.c)).sum(axis=-1, keepdims=True) * s, n + 4) + TINY
    return Aff(c, m, o, a, b)


def _shift(x: Aff, k: np.ndarray) -> Aff:
    """x + k for a constant k: the change is unchanged, the centre moves (rounding in m)."""
    c = x.c + k
    return Aff(c, _up(x.m + 2 * U * np.abs(c), 2) + TINY, x.o, x.a, x.b)


def _scale_const(x: Aff, k: np.ndarray, out_c: np.ndarray, out_m: np.ndarray,
                 ball: Ball) -> Aff:
    """k * x (broadcast) for a constant k."""
    kk = np.broadcast_to(k, out_c.shape)
    return _scaled(Aff(x.c, x.m, np.broadcast_to(x.o, out_c.shape),
                       np.broadcast_to(x.a, (*out_c.shape, x.a.shape[-1])),
                       np.broadcast_to(x.b, out_c.shape)), kk, np.zeros(out_c.shape),
                   out_c, out_m, np.broadcast_to(rough_lin(x, ball), out_c.shape))


def weighted_sum(x: Aff, w: np.ndarray, ball: Ball) -> Aff:
    """sum_i w_i x_i over the last axis (kept as a size-1 axis) for a constant w, its
    rounding in the box and the margin."""
    n = x.shape[-1]
    g = gamma(n + 2)
    aw = np.abs(w)
    o = (w * x.o).sum(axis=-1, keepdims=True)
    a = _weighted_cols(w, x.a)
    b = _up((aw * (x.b + g * (np.abs(x.o) + rough_lin(x, ball)))).sum(axis=-1, keepdims=True)
            + g * np.abs(o), n + 4)
    c = (w * x.c).sum(axis=-1, keepdims=True)
    m = _up((aw * (x.m + g * np.abs(x.c))).sum(axis=-1, keepdims=True) + g * np.abs(c),
            n + 4) + TINY
    return Aff(c, m, o, a, b)


def _weighted_cols(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """(w[..., None] * a).sum(axis=-2, keepdims=True) for a (..., n, Q), a block of rows
    (tokens) at a time: the products of one block stay in cache instead of a whole-tensor
    temporary (each row's sum is the same: the reduction runs down the axis row by row)."""
    shape = a.shape[:-1]
    if reference() or a.ndim < 3 or np.broadcast_shapes(w.shape, shape) != shape:
        return (w[..., None] * a).sum(axis=-2, keepdims=True)
    n, q = a.shape[-2], a.shape[-1]
    af = a.reshape(-1, n, q)
    wf = np.broadcast_to(w, shape).reshape(-1, n)
    out = np.empty((af.shape[0], 1, q))
    step = max(1, _BLOCK // max(1, n * q))
    for i in range(0, af.shape[0], step):
        out[i:i + step] = (wf[i:i + step, :, None] * af[i:i + step]).sum(axis=-2,
                                                                            keepdims=True)
    return out.reshape(*shape[:-1], 1, q)


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
    if np.all(np.isfinite(lo)) and np.all(np.isfinite(hi)):
        p = select(p, _softmax_taylor(x, oc, ball, lo, hi), ball)
    plo, phi = probability_ranges(lo, hi, oc)
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
    holds z0 and z), J = diag(p) - p p^T within sc +- sr there (`_softmax_ranges`, from the
    probability ranges), sc = J at the computed centre. So the change is the linear map sc
    applied to D's form, plus sum_j sr_ij max|D_j| as a new symbol: the logits' shared
    symbols go through sc with their signs (the exp / sum product form multiplies two
    forms that move together)."""
    n = x.shape[-1]
    sc = np.einsum("...i,ij->...ij", oc, np.eye(n)) - oc[..., :, None] * oc[..., None, :]
    _, _, sr = _softmax_ranges(lo, hi, oc, sc)
    dlo, dhi = dev(x, ball)
    dmax = np.maximum(np.abs(dlo), np.abs(dhi))
    o = np.einsum("...ij,...j->...i", sc, x.o)
    a = np.einsum("...ij,...jp->...ip", sc, x.a)
    asc = np.abs(sc)
    g = gamma(n + 2)
    b = _up(np.einsum("...ij,...j->...i", asc, x.b + g * (np.abs(x.o) + rough_lin(x, ball)))
            + g * np.abs(o), n + 4)
    err = _up(np.einsum("...ij,...j->...i", sr, dmax), n + 2) + TINY
    a, b = fresh(a, b, err)
    return Aff(oc, center_margin(oc), o, a, b)


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
        plo, phi = probability_ranges(np.moveaxis(lo, ax, -1), np.moveaxis(hi, ax, -1),
                                  np.moveaxis(c0, ax, -1))
        return interval(c0, m0, np.moveaxis(plo, -1, ax), np.moveaxis(phi, -1, ax), ball.size)


# --- one node ---

LAYOUT = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Slice",
          "Gather", "Concat", "Split", "Expand", "Dropout", "Tile")
LINEAR = ("Add", "Sub", "Neg", "Mul", "Div", "MatMul", "Gemm", "ReduceMean", "ReduceSum",
          "Conv")
SINGLE = FUSABLE_ACTIVATIONS  # smooth activations: as one-node chains (fused.py)


def _arithmetic(node: Node) -> Arithmetic:
    op = arithmetic(node.op_type, node.attrs)
    assert op is not None
    return op


def _power(node: Node, args: list) -> Fn:
    """x^2, sqrt x, 1/x, x^-1/2: Pow by a constant exponent (RMSNorm's x.pow(2))."""
    e = args[1]
    if isinstance(e, Aff):
        raise NotAffine(f"Pow node {node.name}: an input-dependent exponent")
    ev = np.asarray(e, dtype=np.float64).reshape(-1)
    if ev.size != 1:
        raise NotAffine(f"Pow node {node.name}: no affine rule for this exponent")
    return relaxation_fn(Pow("Pow", {"exponent": float(ev[0])}), node.name)


def step(node: Node, args: list, centers: list[np.ndarray | None], ball: Ball,
         ranges_of: Callable[[int], tuple[np.ndarray, np.ndarray] | None],
         chain: fused.Chain | None = None, consts: dict[str, float] | None = None) -> list:
    """The forms of one node's outputs (None where it has no output or no rule).
    `args`: Aff for input-dependent inputs, arrays for constants; `ranges_of(i)`: a known
    range of input i (the Jacobian enclosure's), or None. NotAffine: no rule, or a form
    overflowed (the caller falls back to the interval of the enclosure, or stops)."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = _step(node, args, centers, ball, ranges_of, chain, consts)
    for f in out:
        if f is not None and not (_finite(f.o) and _finite(f.a) and _finite(f.b)):
            raise NotAffine(f"{node.op_type} node {node.name}: a form overflowed")
    return out


def _finite(v: np.ndarray) -> bool:
    """Whether every entry of v is finite: a finite sum says so in one pass without a
    temporary (an inf or nan entry makes the sum inf or nan); only a sum that is not
    finite (an overflow of finite entries, or one that is not) is checked entry by entry."""
    with np.errstate(over="ignore", invalid="ignore"):
        if not reference() and np.isfinite(np.sum(v)):
            return True
    return bool(np.all(np.isfinite(v)))


# a constant logit at or below this is an attention mask's: its softmax weight relative to any
# finite logit of the row is below exp(-1e30), nothing in float64 (HF's masks use the float
# minimum, torch's -inf)
MASKED_BELOW = -1e30


def _guard(node: Node, x: Aff, ball: Ball) -> Aff:
    """IsNaN(x) / IsInf(x) for a form whose ranges over the ball are finite: False
    everywhere, as a constant form (no change), which a Where reads as a constant
    condition; refused where a range is not finite."""
    lo, hi = ranges(x, ball)
    if x.masked is not None or not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
        raise NotAffine(f"{node.op_type} node {node.name}: the input may not be finite")
    return _const_form(np.zeros(x.shape), x)


def _is_constant(f: object) -> bool:
    """A form with no change and an exact centre (a guard's output)."""
    return isinstance(f, Aff) and not (np.any(f.m) or np.any(f.o) or np.any(f.a)
                                       or np.any(f.b))


def _masked_input(node: Node, args: list, var: list[int], c0: np.ndarray | None, ball: Ball
                  ) -> Aff | None:
    """Add/Sub of a form and a constant mask, or Where(constant condition, ...) with a
    constant mask branch: the output's form with the masked entries marked (their parts set
    to 0, never read as values); None where no entry of the output is masked."""
    t = node.op_type
    if c0 is None or np.all(np.isfinite(c0) & (c0 > MASKED_BELOW)):
        return None
    c0 = np.asarray(c0, dtype=np.float64)
    shape = c0.shape
    if t in ("Add", "Sub") and len(var) == 1 and len(args) == 2:
        k = 1 - var[0]
        if t == "Sub" and k == 0:
            raise NotAffine(f"Sub node {node.name}: a form subtracted from a mask")
        const = np.broadcast_to(np.asarray(args[k], dtype=np.float64), shape)
        const = -const if t == "Sub" else const
        mask = const <= MASKED_BELOW
        x = args[var[0]]
        base = _add(_broadcast(x, shape), _const_form(np.where(mask, 0.0, const), x), ball)
    elif t == "Where" and len(args) == 3 and 0 not in var:
        base, mask = _where_branches(args, shape)
    else:
        return None
    if not np.all(mask | (np.isfinite(c0) & (c0 > MASKED_BELOW))):
        raise NotAffine(f"{t} node {node.name}: a centre value is not finite")
    keep = np.where(mask, 0.0, 1.0)
    c = np.where(mask, 0.0, c0)
    return Aff(c, center_margin(c) * keep, base.o * keep, base.a * keep[..., None],
               base.b * keep, masked=mask)


def _broadcast(x: Aff, shape: tuple[int, ...]) -> Aff:
    if x.shape == shape:
        return x
    return Aff(np.broadcast_to(x.c, shape), np.broadcast_to(x.m, shape),
               np.broadcast_to(x.o, shape), np.broadcast_to(x.a, (*shape, x.a.shape[-1])),
               np.broadcast_to(x.b, shape))


def _const_form(v: np.ndarray, like: Aff) -> Aff:
    """A constant as a form: no change, exact."""
    z = np.zeros(v.shape)
    return Aff(np.asarray(v, dtype=np.float64), z, z, np.zeros((*v.shape, like.a.shape[-1])), z)


def _select(cond: np.ndarray, x: Aff, y: Aff) -> Aff:
    """Where(cond, x, y) for a constant cond: each entry's form from its branch."""
    n = max(x.a.shape[-1], y.a.shape[-1])
    return Aff(np.where(cond, x.c, y.c), np.where(cond, x.m, y.m), np.where(cond, x.o, y.o),
               np.where(cond[..., None], _cols(x.a, n), _cols(y.a, n)),
               np.where(cond, x.b, y.b))


def _where_branches(args: list, shape: tuple[int, ...]) -> tuple[Aff, np.ndarray]:
    """Where(cond, x, y) for a constant cond, each entry's form from its branch (a constant
    branch: no change, exact, its entries at or below MASKED_BELOW set to 0), and the entries
    a constant branch masks."""
    cond = np.broadcast_to(np.asarray(args[0]).astype(bool), shape)
    ref = next(a for a in args[1:] if isinstance(a, Aff))
    mask = np.zeros(shape, dtype=bool)
    forms = []
    for i, br in enumerate(args[1:]):
        if isinstance(br, Aff):
            forms.append(_broadcast(br, shape))
            continue
        v = np.broadcast_to(np.asarray(br, dtype=np.float64), shape)
        low = v <= MASKED_BELOW
        mask |= (cond if i == 0 else ~cond) & low
        forms.append(_const_form(np.where(low, 0.0, v), ref))
    return _select(cond, forms[0], forms[1]), mask


def _where(args: list, c0: np.ndarray) -> Aff:
    """Where(cond, x, y) for a constant condition where no entry is masked: each entry's
    form from its branch, the centre the graph's."""
    f, _ = _where_branches(args, c0.shape)
    return Aff(c0, np.maximum(f.m, center_margin(c0)), f.o, f.a, f.b)


def _unmask(x: Aff, axis: int, ball: Ball) -> Aff:
    """A Softmax's masked input with finite stand-ins: each masked entry a constant (no
    change) 1000 below its row's lowest reachable unmasked logit, so its weight relative to
    the row's largest is below exp(-1000) (1e-434, under the TINY = 1e-300 the caller adds to
    every output entry): the probabilities the rules enclose are the masked softmax's. A row
    masked entirely is refused."""
    mask = x.masked
    assert mask is not None
    lo, _ = ranges(x, ball)
    row = np.where(mask, np.inf, lo).min(axis=axis, keepdims=True)
    if not np.all(np.isfinite(row)):
        raise NotAffine("a softmax row masked entirely")
    keep = np.where(mask, 0.0, 1.0)
    stand = np.broadcast_to(row - 1000.0, x.c.shape)
    return Aff(np.where(mask, stand, x.c), x.m * keep, x.o * keep, x.a * keep[..., None],
               x.b * keep)


def _masks(node: Node, args: list, var: list[int], centers: list[np.ndarray | None],
           ball: Ball, chain: fused.Chain | None) -> list | None:
    """The attention masks' rules (a mask put in by Add/Sub/Where, a Where of a constant
    condition), None for any other node; a masked form read by anything but a Softmax is
    refused."""
    t = node.op_type
    if any(args[i].masked is not None for i in var) and t != "Softmax":
        raise NotAffine(f"{t} node {node.name}: reads an attention mask's -inf entries")
    if t in GUARDS and var == [0]:
        return [_guard(node, args[0], ball)]
    if t == "Where" and 0 in var and _is_constant(args[0]):
        # a guard's condition (IsNaN of a finite form): constant over the ball
        args = [args[0].c.astype(bool)] + list(args[1:])
        var = [i for i in var if i != 0]
    if t in ("Add", "Sub", "Where") and chain is None and centers and var:
        m_in = _masked_input(node, args, var, centers[0], ball)
        if m_in is not None:
            return [m_in]
    if t == "Where" and var and 0 not in var and centers and centers[0] is not None:
        return [_where(args, np.asarray(centers[0], dtype=np.float64))]
    return None


def _softmax_node(node: Node, x: Aff, c0: np.ndarray, m0: np.ndarray, ball: Ball,
                  rg: tuple[np.ndarray, np.ndarray] | None) -> Aff:
    ax = int(node.attrs.get("axis", -1))
    if x.masked is None:
        return _softmax_or_interval(x, ax, c0, m0, ball, rg)
    # an attention mask's entries: probability 0 (`_unmask`); the enclosure's ranges of the
    # masked logits (-inf) are not used
    p = _softmax_or_interval(_unmask(x, ax, ball), ax, c0, m0, ball, None)
    p.b = p.b + TINY
    p.m = p.m + TINY
    return p


def _step(node: Node, args: list, centers: list[np.ndarray | None], ball: Ball,
         ranges_of: Callable[[int], tuple[np.ndarray, np.ndarray] | None],
         chain: fused.Chain | None = None, consts: dict[str, float] | None = None) -> list:
    var = [i for i, v in enumerate(args) if isinstance(v, Aff)]
    t = node.op_type
    masks = _masks(node, args, var, centers, ball, chain)
    if masks is not None:
        return masks
    c0 = centers[0] if centers else None
    if chain is not None:
        assert consts is not None and c0 is not None
        rg = ranges_of(0)
        x = args[0]
        return [elementwise(x, chain_fn(chain, consts), ball, xlo=_lo(rg), xhi=_hi(rg),
                            out_c=c0, out_m=center_margin(c0))]
    if t == "Cast" and int(node.attrs.get("to", 0)) in FLOAT_TYPES or t in LAYOUT:
        return layout(node, args, centers, ball.size)
    if c0 is None:
        raise NotAffine(f"{t} node {node.name}: no centre")
    c0 = np.asarray(c0, dtype=np.float64)
    if not np.all(np.isfinite(c0)):  # masks (-inf): the enclosure's own rules handle them
        raise NotAffine(f"{t} node {node.name}: a centre value is not finite")
    m0 = center_margin(c0)
    if t in ("Mul", "MatMul") and len(var) == 2:
        return [product(args[0], args[1], ball, t == "MatMul", c0, m0)]
    if t == "Div" and 1 in var:
        return [_divide(args, var, c0, m0, ball, ranges_of(1))]
    if t in LINEAR:
        if t in ("Gemm", "Conv") and var != [0]:
            raise NotAffine(f"{t} node {node.name}: a variable weight or bias")
        return [linear(node, args, var, c0, m0, ball)]
    if t in SINGLE:
        ch = fused.Chain(node.inputs[0], node.outputs[0], [node])
        rg = ranges_of(0)
        return [elementwise(args[0], chain_fn(ch, {}), ball, xlo=_lo(rg), xhi=_hi(rg), out_c=c0,
                            out_m=m0)]
    if t == RELU_GRAD:
        return [_relu_grad(args, ball, ranges_of(1), c0, m0)]
    op = activation(t, node.attrs)
    if (op is not None or t in ARITHMETIC_TYPES) and var == [0]:
        fn = activation_fn(op, node.name) if op is not None else _power(node, args) \
            if t == "Pow" else relaxation_fn(_arithmetic(node), node.name)
        rg = ranges_of(0)
        return [elementwise(args[0], fn, ball, xlo=_lo(rg), xhi=_hi(rg), out_c=c0, out_m=m0)]
    if t == "Softmax" and var == [0]:
        return [_softmax_node(node, args[0], c0, m0, ball, ranges_of(0))]
    if t == "LayerNormalization" and var == [0]:
        return [_layernorm_node(node, args, c0, m0, ball, ranges_of(0))] + \
            [None] * (len(node.outputs) - 1)
    raise NotAffine(f"{t} node {node.name}: no affine rule")


def _relu_grad(args: list, ball: Ball, rg: tuple[np.ndarray, np.ndarray] | None,
               c0: np.ndarray, m0: np.ndarray) -> Aff:
    """g H(x) (internal_ops.RELU_GRAD) as the product of g's form and H's interval form: H
    is 1 where x's range is above 0, 0 where below, and moves within [0, 1] where the range
    reaches 0 (from H(x0), which is known where x's centre margin leaves out 0; else 1/2 +- 1/2
    at the centre and [-1, 1] for the change)."""
    g, x = args[0], args[1]
    if not isinstance(g, Aff) or not isinstance(x, Aff):
        raise NotAffine("ReluGrad of a constant")
    lo, hi = ranges(x, ball)
    if rg is not None:
        lo, hi = np.maximum(lo, rg[0]), np.minimum(hi, rg[1])
    free = ~((lo > 0) | (hi < 0))
    up, down = x.c - x.m > 0, x.c + x.m < 0
    known = up | down
    hc = np.where(known, np.where(up, 1.0, 0.0), 0.5)
    hm = np.where(known, 0.0, 0.5)
    # the change H(X) - H(X0): 0 where x's sign is fixed; [-1, 0] from H0 = 1, [0, 1] from
    # H0 = 0; [-1, 1] where H0 is not known
    ho = np.where(free & known, 0.5 - hc, 0.0)
    hb = np.where(free, np.where(known, 0.5, 1.0), 0.0)
    # the step's move a symbol per unit (not the box): the product's linear part keeps it,
    # so the units' moves stay shared by every entry the adjoint (tangent) spreads them to
    ha, hbox = fresh(np.zeros((*hc.shape, ball.size)), np.zeros_like(hb), hb)
    h = Aff(hc, hm, ho, ha, hbox)
    return product(g, h, ball, False, c0, m0)


def _layernorm_node(node: Node, args: list, c0: np.ndarray, m0: np.ndarray, ball: Ball,
                    rg: tuple[np.ndarray, np.ndarray] | None) -> Aff:
    if int(node.attrs.get("axis", -1)) % c0.ndim != c0.ndim - 1:
        raise NotAffine("LayerNorm over more than the last axis")
    gam = np.asarray(args[1], dtype=np.float64)
    beta = None if len(args) < 3 or args[2] is None else np.asarray(args[2], np.float64)
    try:
        return layernorm(args[0], gam, beta, decimal_attr(float(node.attrs.get(
            "epsilon", 1e-5))), c0, ball, _lo(rg), _hi(rg))
    except NotAffine:  # |y - beta| <= |gamma| sqrt(D - 1)
        bnd = np.abs(gam) * math.sqrt(c0.shape[-1] - 1) * (1 + 1e-12)
        bb = np.zeros_like(c0) if beta is None else np.broadcast_to(beta, c0.shape)
        return interval(c0, m0, bb - bnd, bb + bnd, ball.size)


def uses(nodes: list[Node], chains: dict[str, fused.Chain], inside: set[str]
         ) -> dict[str, int]:
    """How many steps read each tensor (a chain's root is read once, at its sink): a form
    is dropped after its last reader (`release`), so only live forms are held."""
    out: dict[str, int] = {}
    for node in nodes:
        if node.name in inside:
            chain = chains.get(node.name)
            names = [chain.root] if chain is not None else []
        else:
            names = [i for i in node.inputs if i]
        for i in names:
            out[i] = out.get(i, 0) + 1
    return out


def release(forms: dict[str, Aff], count: dict[str, int], names: list[str],
            keep: str) -> None:
    for i in names:
        if i and i in count:
            count[i] -= 1
            if count[i] <= 0 and i != keep:
                forms.pop(i, None)


def walk(nodes: list[Node], input_name: str, env: dict[str, torch.Tensor], ball: Ball,
         chains: dict[str, fused.Chain], inside: set[str], keep: str | None = None,
         everything: bool = True, seeds: dict[str, Aff] | None = None,
         symbols: int = 0, known: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
         hook: Callable[[Node, dict[str, Aff]], None] | None = None,
         capture: dict[str, Aff | None] | None = None,
         space: list[int] | None = None, quad: bool = False) -> dict[str, Aff]:
    """The forms of every input-dependent tensor, alone (no Jacobian enclosure): an op with
    no rule gives its outputs the interval form of... nothing known, so the walk stops there
    and the tensors after it are missing. `seeds`: more graph inputs given as forms, over the
    first `symbols` noise symbols (tangent.py: the tangent's direction); `known`: ranges some
    tensors are known to lie in (a mean of squares plus eps is at least eps), which `hook`
    (called before every node with the live forms) may add to; `capture`: names whose forms
    are kept there when made (whatever is released later); `space`: receives the symbols
    used, [P, used, reserved] (a later walk over the same symbols passes `symbols=used`);
    `quad`: the products' quadratic parts on second-order symbols (affine.QUAD, reserved
    after the first `symbols`)."""
    forms: dict[str, Aff] = {input_name: input_form(ball)}
    forms.update(seeds or {})
    count = None if everything else uses(nodes, chains, inside)
    reserved = symbols + (quad_size(ball.size) if quad else 0)
    token = SPACE.set([ball.size, reserved, reserved])  # the seeds' symbols: not budgeted
    token_q = QUAD.set(ball.size + symbols if quad else None)
    try:
        _walk(nodes, forms, env, ball, chains, inside, count, keep or "",
              {} if known is None else known, hook, capture)
    finally:
        if space is not None:
            space[:] = list(SPACE.get() or [])
        QUAD.reset(token_q)
        SPACE.reset(token)
    return forms


def _walk(nodes: list[Node], forms: dict[str, Aff], env: dict[str, torch.Tensor], ball: Ball,
          chains: dict[str, fused.Chain], inside: set[str], count: dict[str, int] | None,
          keep: str, known: dict[str, tuple[np.ndarray, np.ndarray]],
          hook: Callable[[Node, dict[str, Aff]], None] | None = None,
          capture: dict[str, Aff | None] | None = None) -> None:
    for node in nodes:
        if node.name in inside and node.name not in chains:
            continue
        chain = chains.get(node.name)
        ins = [chain.root] if chain is not None else node.inputs
        if node.op_type in ("Shape", "Size") or not any(i in forms for i in ins if i):
            continue
        if hook is not None:
            hook(node, forms)
        args = [None if not i else forms[i] if i in forms else
                (env[i].detach().numpy() if i in env else None) for i in ins]
        outs = [chain.sink] if chain is not None else node.outputs
        centers = [None if not o or o not in env else env[o].detach().numpy() for o in outs]
        try:
            res = step(node, args, centers, ball, _known_of(known, ins), chain,
                       fused_consts(chain, env) if chain is not None else None)
        except NotAffine:
            return
        for o, v in zip(outs, res, strict=False):
            if o and v is not None:
                forms[o] = v
                if capture is not None and o in capture:
                    capture[o] = v
        if count is not None:
            release(forms, count, ins, keep)


def _known_of(known: dict[str, tuple[np.ndarray, np.ndarray]], ins: list[str]
              ) -> Callable[[int], tuple[np.ndarray, np.ndarray] | None]:
    return lambda i: known.get(ins[i]) if i < len(ins) else None


def fused_consts(chain: fused.Chain, env: dict[str, torch.Tensor]) -> dict[str, float]:
    inner = {n.outputs[0] for n in chain.nodes}
    return {i: float(env[i].reshape(())) for nd in chain.nodes for i in nd.inputs
            if i and i in env and env[i].numel() == 1 and i != chain.root and i not in inner}
