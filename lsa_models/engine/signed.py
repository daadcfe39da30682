"""Telescoped terms with the adjoint's signs kept (docs/local-bounds.md, "Signed adjoints").

The driver's remainder term of an op k is `G_k (D_k(X) - D_k(X0)) J_in(X)`; the rules bound it
from `|G_k|`, so the signs of the adjoint are lost before the op's Jacobian change is bounded.
For an op whose local Jacobian acts on one token at a time (LayerNorm), the row vector
`phi_i(x) = G_k,i D_k(x)` is the gradient of the scalar `h_i(x) = G_k,i . op(x)`, and
  |phi_i(x) - phi_i(x0)| <= sup_box |hess h_i| |x - x0|                  (entrywise)
by the mean value theorem on the segment (inside the input's value box, which is convex and
holds x0 and x). The Hessian of one scalar keeps the cancellations of the sum over the op's
outputs that `sum_j |G_ij| |dD_jk|` loses.

A rule attaches `signed(g, ga) -> c` to its output: `g` the signed adjoint at X0 (K, *S),
`ga >= |G|` its bound with the adjoint margin (so `|G - g| <= ga - |g|`), `c` (K, n) >= 0 with
`|G (D(X) - D(X0))|_kb <= c_kb` on the op's input entries b, the same layout as the first of
its `parts` (whose c bounds the same quantity: the two are combined by an entrywise min).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from .values import LocalValue, Parts, widen_up

Term = Callable[[np.ndarray], np.ndarray]
PartsFn = Callable[[np.ndarray], list[Parts]]
SignedFn = Callable[[np.ndarray, np.ndarray], np.ndarray]

# relative allowance per interval end formed with a few round-to-nearest float64 operations
_REL = 1e-12


class SignedTerm:
    """An op's remainder term (called with the |G| bound, as any term) that also carries the
    signed form: `bind` gives the value whose term and parts use both for one adjoint."""

    def __init__(self, term: Term, parts: PartsFn, signed: SignedFn) -> None:
        self.term, self.parts, self.signed = term, parts, signed

    def __call__(self, ga: np.ndarray) -> np.ndarray:
        return self.term(ga)


def bind(u: LocalValue, g: np.ndarray, ga: np.ndarray) -> LocalValue:
    """u with its term and parts tightened by the signed bound for the adjoint g (ga: the
    |G| bound the driver passes to the term). Both bounds hold, so their entrywise minimum
    does."""
    st = u.term
    if not isinstance(st, SignedTerm):
        return u
    ps = st.parts(ga)
    if len(ps) != 1:
        return u
    c_old, jc_in, jr_in = ps[0]
    c_new = st.signed(g, ga)
    if c_new.shape != c_old.shape or not np.all(np.isfinite(c_new)):
        return u
    c = np.minimum(c_old, c_new)
    base = st.term(ga)
    fixed = np.minimum(base, widen_up(c @ (np.abs(jc_in) + jr_in), c.shape[1] + 2))

    def term(ga2: np.ndarray) -> np.ndarray:
        return fixed if ga2 is ga else st.term(ga2)

    def parts(ga2: np.ndarray) -> list[Parts]:
        return [(c, jc_in, jr_in)] if ga2 is ga else st.parts(ga2)

    return replace(u, term=term, parts=parts)


def layernorm_signed(x: LocalValue, gamma: np.ndarray, ln_eps: float, margin: np.ndarray
                     ) -> SignedFn:
    """The signed bound for y = LayerNorm(x) (last axis, D), y = gamma z + beta.

    Per output row i and token t: a = G_i,t * gamma, b = P a, h(x) = a . z(x) = (b . u)/sigma,
    hess h = (1/(D sigma^3)) (-(b u^T + u b^T) - s P) + 3 s u u^T / (D^2 sigma^5), s = b . u.
    Over the box: |u_j| <= U_j = |(P m)_j| + (|P| r)_j (m, r the box's midpoint and radius),
    |s| <= |b . m| + |b| . r, sigma >= sqrt((||P m|| - ||r||)_+^2 / D + eps); so with
    R = rad + margin (|x - x0| for the true centre x0):
      c_k = (1/(D sigma_lo^3)) (|b_k| U.R + U_k |b|.R + |s| (|P| R)_k)
            + 3 |s| U_k U.R / (D^2 sigma_lo^5)."""
    d = x.shape[-1]
    lo, hi = x.lo, x.hi
    mid = 0.5 * (lo + hi)
    r = widen_up(np.maximum(hi - mid, mid - lo), 2)  # (..., D)
    rad = widen_up(x.rad + margin, 2)  # |x - x0| for the true x0

    def absp(v: np.ndarray) -> np.ndarray:  # |P| v for v >= 0, rounded up
        return widen_up(v * (1.0 - 2.0 / d) + v.sum(axis=-1, keepdims=True) / d, d + 2)

    pm = mid - mid.mean(axis=-1, keepdims=True)
    uabs = widen_up(np.abs(pm) * (1 + _REL) + absp(r), 4)  # (..., D) >= |u_j| on the box
    nc = np.sqrt(np.square(pm).sum(axis=-1, keepdims=True)) * (1 - _REL)
    rho = np.sqrt(widen_up(np.square(r).sum(axis=-1, keepdims=True), d)) * (1 + _REL)
    s2lo = (np.square(np.maximum(nc - rho, 0.0)) / d + ln_eps) * (1 - _REL)
    w3 = np.power(s2lo, -1.5) * (1 + _REL)  # >= 1/sigma^3 on the box
    w5 = np.power(s2lo, -2.5) * (1 + _REL)
    ur = widen_up((uabs * rad).sum(axis=-1, keepdims=True), d)  # U . R
    pr = absp(rad)  # |P| R
    xabs = np.maximum(np.abs(lo), np.abs(hi))
    gam = np.asarray(gamma, dtype=np.float64)

    def signed(g: np.ndarray, ga: np.ndarray) -> np.ndarray:
        k = g.shape[0]
        a = g * gam
        b = a - a.mean(axis=-1, keepdims=True)  # (K, ..., D)
        # |G - g| <= ga - |g|: b moves by at most |P| (|gamma| (ga - |g|)), s by that . |x|
        e = absp(np.abs(gam) * np.maximum(ga - np.abs(g), 0.0))
        e = widen_up(e + _REL * (np.abs(b) + np.abs(a).mean(axis=-1, keepdims=True)), 4)
        babs = np.abs(b) + e
        sabs = widen_up(np.abs((b * mid).sum(axis=-1, keepdims=True))
                        + (np.abs(b) * r).sum(axis=-1, keepdims=True)
                        + (e * xabs).sum(axis=-1, keepdims=True)
                        + _REL * (np.abs(b) * np.abs(mid)).sum(axis=-1, keepdims=True), d + 4)
        br = widen_up((babs * rad).sum(axis=-1, keepdims=True), d)
        c = w3 / d * (babs * ur + uabs * br + sabs * pr) + 3.0 * w5 / (d * d) * sabs * uabs * ur
        return widen_up(c, 8).reshape(k, -1)

    return signed
