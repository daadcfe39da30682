"""The affine forms' elementwise functions (affine/form.py has the form): value, slope and
curvature enclosures of an op over an interval (`Fn`: the activations', the arithmetic ops'
relaxations, fused chains') and `elementwise`, y = f(x) as a form by the narrowest of its
first-order, second-order, chord and interval candidates; derivations in
docs/local-affine.md, "Affine value forms"."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lsa_models.bounds.numerics import U
from lsa_models.engine import elementwise_chains as fused
from lsa_models.engine.affine.form import (
    _REL,
    COLLAPSE,
    TINY,
    Aff,
    NotAffine,
    _up,
    dev,
    fresh_fill,
    lin,
)
from lsa_models.engine.values import Ball
from lsa_models.operators import ModeNotImplemented
from lsa_models.operators.activation import Activation, Relu
from lsa_models.operators.arithmetic import Arithmetic, Exp, Pow, Reciprocal, Sqrt
from lsa_models.operators.arithmetic import near_far as _near_far

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
    """A fused elementwise chain (elementwise_chains.py) through its interval differentiation."""
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
