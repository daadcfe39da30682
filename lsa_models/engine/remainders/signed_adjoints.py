"""Telescoped terms with the adjoint's signs kept (docs/local-second-order.md, "Signed adjoints").

The telescoped remainder term (remainders/telescope.py) of an op k is `G_k (D_k(X) - D_k(X0))
J_in(X)`; the rules bound it from `|G_k|`, so the signs of the adjoint are lost before the op's
Jacobian change is bounded. For an op whose local Jacobian acts on one token at a time (LayerNorm),
the row vector `phi_i(x) = G_k,i D_k(x)` is the gradient of the scalar `h_i(x) = G_k,i . op(x)`, and
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
from contextvars import ContextVar
from dataclasses import replace
from typing import Any

import numpy as np

from lsa_models.engine.remainders.second_order import SecondFn, eps_part, gradient_second
from lsa_models.engine.remainders.structured_norms import PartsChoice, Structured, alternatives
from lsa_models.engine.values import (
    Ball,
    LocalValue,
    OpRemainder,
    Parts,
    dual_row_norms,
    gamma,
    widen_up,
)

Term = Callable[[np.ndarray], np.ndarray]
PartsFn = Callable[[np.ndarray], list[Parts]]
SignedFn = Callable[[np.ndarray, np.ndarray], np.ndarray | list[np.ndarray]]

# `gamma` is LayerNorm's scale inside layernorm_rules
_gamma_k = gamma

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
    |G| bound the telescope passes to the term). Both bounds hold, so their entrywise minimum
    does."""
    rem = u.remainder
    st = None if rem is None else rem.term
    if rem is None or not isinstance(st, SignedTerm):
        return u
    ps = st.parts(ga)
    if isinstance(ps, PartsChoice):
        return u
    got = st.signed(g, ga)
    news = got if isinstance(got, list) else [got]
    if len(news) != len(ps):
        return u
    combined: list[Parts] = []
    fixed = np.zeros(())
    for (c_old, jc_in, jr_in), c_new in zip(ps, news, strict=True):
        if c_new.shape != c_old.shape or not np.all(np.isfinite(c_new)):
            return u
        c = np.minimum(c_old, c_new)
        combined.append((c, jc_in, jr_in))
        fixed = fixed + widen_up(c @ (np.abs(jc_in) + jr_in), c.shape[1] + 2)
    fixed = np.minimum(st.term(ga), widen_up(fixed, 2 * len(ps)))

    def term(ga2: np.ndarray) -> np.ndarray:
        return fixed if ga2 is ga else st.term(ga2)

    def parts(ga2: np.ndarray) -> list[Parts]:
        return combined if ga2 is ga else st.parts(ga2)

    # the operator-norm and second-order rules bound the same op's term: they stay
    return replace(u, remainder=OpRemainder(term, parts, rem.opnorm, rem.second))


# the relational form's arrays hold K * numel(jc_x) entries each (K adjoint rows; its |L| jr
# product K T D^2 P flops): beyond this it is skipped and the box form stands. HF GPT-2 (D 32,
# N 8, P 256) on the inf-ball at eps 1e-2: without a cap 5.7 s per LayerNorm at its FFN
# checkpoints (K = 1024), upper / lower 1.038; with a 2e7 cap (K <= 256) 205 s, 1.038; 1e7
# (K <= 128) 112-126 s, 1.069. Models of N D = 128 inputs stay under it (K <= 256,
# numel(jc_x) = 16384)
RELATIONAL_MAX_ENTRIES = 10_000_000
# the same for the output's own rows, bound a few times per certificate rather than at every
# checkpoint (telescope.Telescope sets RELATIONAL_CAP while it binds them): GPT-2 1.069 -> 1.038
# in the same time (55 s), x-transformers 21.76 -> 21.30
RELATIONAL_OUTPUT_MAX_ENTRIES = 20_000_000
RELATIONAL_CAP: ContextVar[int | None] = ContextVar("relational_cap", default=None)


def layernorm_rules(x: LocalValue, gamma: np.ndarray, ln_eps: float, margin: np.ndarray,
                    ball: Ball | None = None) -> tuple[SignedFn, SecondFn | None]:
    """The signed bound for y = LayerNorm(x) (last axis, D), y = gamma z + beta, and with a
    ball its second-order rule (remainders/second_order.py; None without one: it needs the
    relational form).

    Per output row i and token t: a = G_i,t * gamma, b = P a, h(x) = a . z(x) = (b . u)/sigma,
    hess h = (1/(D sigma^3)) (-(b u^T + u b^T) - s P) + 3 s u u^T / (D^2 sigma^5), s = b . u,
    and phi = grad h moves by at most sum_j sup_box |hess_kj| R_j (R = rad + margin: |x - x0|
    for the true centre x0). Two bounds of that sup (docs/local-second-order.md, "Signed adjoints"):
    the box form (every factor at its largest magnitude over the box) and, with a ball, the
    relational form: hess(xi) = L + (hess(xi) - L), L = hess at the computed centre c, so
    |phi_k(x) - phi_k(x0)| <= |L_k . (x - x0)| + sum_j |hess(xi) - L|_kj R_j, the first by the
    mean value form of the linear functional L_k . x(X) (Jacobian L_k (jc +- jr)), the second
    by the products' deviations over the box."""
    d = x.shape[-1]
    c = x.center
    rad = widen_up(x.rad + margin, 2)  # |x - x0| for the true x0
    rb = widen_up(x.rad, 2)  # |xi - c| for xi in the box

    def absp(v: np.ndarray) -> np.ndarray:  # |P| v for v >= 0, rounded up
        return widen_up(v * (1.0 - 2.0 / d) + v.sum(axis=-1, keepdims=True) / d, d + 2)

    def dot(u: np.ndarray, v: np.ndarray) -> np.ndarray:  # nonnegative sums over the axis
        return widen_up((u * v).sum(axis=-1, keepdims=True), d)

    uc = c - c.mean(axis=-1, keepdims=True)  # P c (computed)
    ru = widen_up(absp(rb) + _REL * (np.abs(c) + np.abs(c).mean(axis=-1, keepdims=True)), 2)
    uabs = widen_up(np.abs(uc) + ru, 2)  # (..., D) >= |u_j| on the box
    nc = np.sqrt(np.square(uc).sum(axis=-1, keepdims=True))
    # ||P xi - uc|| <= ||xi - c|| (P an orthogonal projection) + the rounding of uc
    rho = widen_up(np.sqrt(widen_up(np.square(rb).sum(axis=-1, keepdims=True), d))
                   + _REL * np.sqrt(np.square(np.abs(c) + np.abs(c).mean(
                       axis=-1, keepdims=True)).sum(axis=-1, keepdims=True)), 2)
    s2lo = (np.square(np.maximum(nc * (1 - _REL) - rho, 0.0)) / d + ln_eps) * (1 - _REL)
    s2hi = (np.square(nc * (1 + _REL) + rho) / d + ln_eps) * (1 + _REL)
    w3 = np.power(s2lo, -1.5) * (1 + _REL)  # >= 1/sigma^3 on the box
    w5 = np.power(s2lo, -2.5) * (1 + _REL)
    s2c = np.square(uc).sum(axis=-1, keepdims=True) / d + ln_eps
    w3c, w5c = np.power(s2c, -1.5), np.power(s2c, -2.5)
    rw3 = np.maximum(w3 - w3c, w3c - np.power(s2hi, -1.5) * (1 - _REL)) + _REL * w3
    rw5 = np.maximum(w5 - w5c, w5c - np.power(s2hi, -2.5) * (1 - _REL)) + _REL * w5
    ur = dot(uabs, rad)  # U . R
    pr = absp(rad)  # |P| R
    cabs = np.abs(c) + rb  # >= |x| on the box
    gam = np.asarray(gamma, dtype=np.float64)
    pmat = np.eye(d) - 1.0 / d
    rel = ball is not None and x.jc.shape[-1] > 0
    if rel:
        pdim = x.jc.shape[-1]
        jcx = x.jc  # (..., D, P)
        ju = np.einsum("...j,...jp->...p", uc, jcx)  # uc^T J per token (..., P)
        pj = jcx - jcx.mean(axis=-2, keepdims=True)  # P J
        jrow = widen_up(np.abs(jcx).sum(axis=-1), pdim)  # (..., D): row sums of |J|

    # the box form about the box's midpoint m (radius r), tighter than about c where the box
    # is lopsided: |u_j| <= |(P m)_j| + (|P| r)_j, sigma from ||P m|| -+ ||r||
    mid = 0.5 * (x.lo + x.hi)
    rm = widen_up(np.maximum(x.hi - mid, mid - x.lo), 2)
    um = mid - mid.mean(axis=-1, keepdims=True)
    uabs_m = widen_up(np.abs(um) + absp(rm) + _REL * (np.abs(mid) + np.abs(mid).mean(
        axis=-1, keepdims=True)), 2)
    rho_m = widen_up(np.sqrt(widen_up(np.square(rm).sum(axis=-1, keepdims=True), d))
                     + _REL * np.sqrt(np.square(np.abs(mid) + np.abs(mid).mean(
                         axis=-1, keepdims=True)).sum(axis=-1, keepdims=True)), 2)
    ncm = np.sqrt(np.square(um).sum(axis=-1, keepdims=True))
    s2m = (np.square(np.maximum(ncm * (1 - _REL) - rho_m, 0.0)) / d + ln_eps) * (1 - _REL)
    w3m, w5m = np.power(s2m, -1.5) * (1 + _REL), np.power(s2m, -2.5) * (1 + _REL)
    w3, w5 = np.minimum(w3, w3m), np.minimum(w5, w5m)  # both bound 1/sigma on the box
    uabs = np.minimum(uabs, uabs_m)
    ur = dot(uabs, rad)

    def box(babs: np.ndarray, sabs: np.ndarray) -> np.ndarray:
        br = dot(babs, rad)
        return w3 / d * (babs * ur + uabs * br + sabs * pr) + 3.0 * w5 / (d * d) * sabs * uabs * ur

    def relational(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(full, dev, labs, lmat) for the computed b (K, ..., D): full = |L_k . dx| +
        sum_j |hess(xi) - L|_kj R_j, dev the second sum alone (rounding of L included), labs
        a bound on |L| entrywise and lmat L itself (K, ..., D, D). Needs the ball (`rel`)."""
        assert rel and ball is not None
        ab = np.abs(b)
        sc = (b * uc).sum(axis=-1, keepdims=True)
        asc = np.abs(sc)
        rs = widen_up(dot(ab, ru) + _REL * dot(ab, np.abs(uc)), 2)
        # L = (w3c/D)(-(b uc^T + uc b^T) - sc P) + 3 sc w5c uc uc^T / D^2; |L| R:
        lmag = (w3c / d) * (ab * dot(np.abs(uc), rad) + np.abs(uc) * dot(ab, rad)
                            + asc * pr) + 3.0 * w5c / (d * d) * asc * np.abs(uc) \
            * dot(np.abs(uc), rad)  # >= sum_j |L_kj| R_j up to rounding
        lmag = widen_up(lmag, 8)
        jb = np.einsum("...j,...jp->...p", b, jcx)  # b^T J (K, ..., P)
        lj = (w3c / d)[..., None] * (-(b[..., :, None] * ju[..., None, :]
                                       + uc[..., :, None] * jb[..., None, :])
                                     - sc[..., None] * pj) \
            + (3.0 * w5c / (d * d) * sc)[..., None] * uc[..., :, None] * ju[..., None, :]
        # rounding of L J: 1e-12 of the magnitudes of its terms
        ljmag = (w3c / d) * (ab * dot(np.abs(uc), jrow) + np.abs(uc) * dot(ab, jrow)
                             + asc * absp(jrow)) + 3.0 * w5c / (d * d) * asc \
            * np.abs(uc) * dot(np.abs(uc), jrow)
        labs = (w3c / d)[..., None] * (ab[..., :, None] * np.abs(uc)[..., None, :]
                                       + np.abs(uc)[..., :, None] * ab[..., None, :]
                                       + asc[..., None] * np.abs(pmat)) \
            + (3.0 * w5c / (d * d))[..., None] * asc[..., None] \
            * np.abs(uc)[..., :, None] * np.abs(uc)[..., None, :]  # >= |L| entrywise
        ljr = labs @ x.jr  # |L| jr (K, ..., D, P), batched BLAS
        mv = widen_up(ball.eps * (dual_row_norms(np.abs(lj), ball.norm)
                                  + dual_row_norms(ljr, ball.norm))
                      + _REL * ljmag * ball.eps * (1 + np.sqrt(pdim))
                      + dot(labs, widen_up(margin, 2)[..., None, :])[..., 0], 8)
        first = np.minimum(lmag, mv)
        # deviations over the box: |prod f - prod f0| <= prod(|f0| + r) - prod |f0|
        auc = np.abs(uc)
        d3u = (w3c + rw3) * (auc + ru) * (1 + _REL) - w3c * auc * (1 - _REL)  # w3 u_j
        d3s = (w3c + rw3) * (asc + rs) * (1 + _REL) - w3c * asc * (1 - _REL)  # w3 s
        a5 = (w5c + rw5) * (asc + rs) * (auc + ru)  # w5 s u_k times (|u_j| + ru_j)
        b5 = w5c * asc * auc
        dev = (ab * dot(d3u, rad) + d3u * dot(ab, rad) + d3s * pr) / d \
            + 3.0 / (d * d) * (a5 * dot(auc + ru, rad) * (1 + _REL)
                               - b5 * dot(auc, rad) * (1 - _REL))
        dev = dev + _REL * lmag  # the rounding of L
        lmat = (w3c / d)[..., None] * (-(b[..., :, None] * uc[..., None, :]
                                         + uc[..., :, None] * b[..., None, :])
                                       - sc[..., None] * pmat) \
            + (3.0 * w5c / (d * d) * sc)[..., None] * uc[..., :, None] * uc[..., None, :]
        return widen_up(first + np.maximum(dev, 0.0), 8), widen_up(np.maximum(dev, 0.0), 8), \
            labs, lmat

    # the last adjoint's pieces, for `second` (called with the same g after `signed`)
    memo: dict[str, Any] = {}
    epsx = eps_part(x)

    def signed(g: np.ndarray, ga: np.ndarray, force: bool = False) -> np.ndarray:
        """The signed bound; the relational form where it fits RELATIONAL_MAX_ENTRIES (or
        `force`: the second-order rule needs its pieces)."""
        k = g.shape[0]
        cap = RELATIONAL_CAP.get()
        use_rel = rel and (force or k * x.jc.size <= (RELATIONAL_MAX_ENTRIES if cap is None
                                                       else cap))
        a = g * gam
        b = a - a.mean(axis=-1, keepdims=True)  # (K, ..., D)
        # |G - g| <= ga - |g|: b moves by at most |P| (|gamma| (ga - |g|)), s by that . |x|;
        # plus the rounding of b
        e = absp(np.abs(gam) * np.maximum(ga - np.abs(g), 0.0))
        e = widen_up(e + _REL * (np.abs(b) + np.abs(a).mean(axis=-1, keepdims=True)), 4)
        se = dot(e, cabs)
        babs = np.abs(b) + e
        sabs = widen_up(np.minimum(
            np.abs((b * c).sum(axis=-1, keepdims=True)) + dot(np.abs(b), rb)
            + _REL * dot(np.abs(b), np.abs(c)),
            np.abs((b * mid).sum(axis=-1, keepdims=True)) + dot(np.abs(b), rm)
            + _REL * dot(np.abs(b), np.abs(mid))) + se, 4)
        out = box(babs, sabs)
        if use_rel:
            full, dev, labs, lmat = relational(b)
            out = np.minimum(out, full + box(e, se))
            memo.clear()
            memo.update(g=g, ga=ga, dev=dev, labs=labs, lmat=lmat, e=e, se=se)
        out = widen_up(out, 8).reshape(k, -1)
        if use_rel:
            memo["out"] = out
        return out

    def second(g: np.ndarray, ga: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
        """The second-order rule (remainders/second_order.py) on the inf-ball: grad h(x) - grad
        h(x0) = L dx + rho, |rho| <= dev (the relational form's deviation), dx = jc d + eps_x with
        |eps_x| <= eps ||jr_x||_1, J_x(X) = jc + R: H_i = jc^T L_i jc per token, and the rest (|L|
        eps ||jr_x||_1 + dev) |jc| + c jr_x (c = the signed bound, the true adjoint's) + the
        adjoint's error part (|jc| + jr_x) + L's rounding times eps |jc| rows."""
        k = g.shape[0]
        pdim = x.jc.shape[-1]
        if memo.get("g") is not g or memo.get("ga") is not ga or "out" not in memo:
            signed(g, ga, force=True)
        # c_all (K, n) bounds |grad h_k(x) - grad h_k(x0)| for the true adjoint
        c_all, dev, labs, lmat, e, se = (memo[n] for n in ("out", "dev", "labs", "lmat", "e",
                                                             "se"))
        tok = int(np.prod(x.shape[:-1], dtype=np.int64))
        jt = x.jc.reshape(tok, d, pdim)  # (T, D, P)
        jrt = x.jr.reshape(tok, d, pdim)
        extra = box(e, se).reshape(k, tok * d) @ (np.abs(jt) + jrt).reshape(tok * d, pdim)
        return gradient_second(jt, jrt, lmat.reshape(k, tok, d, d),
                               labs.reshape(k, tok, d, d), dev.reshape(k, tok, d), c_all,
                               extra, eps, epsx(eps).reshape(tok, d))

    return signed, (second if rel else None)


def signed_rows(st: Structured, terms: list[tuple[np.ndarray, list[Parts] | None]],
                zr: np.ndarray, v: object, combos: np.ndarray | None,
                rem: np.ndarray | None, norm: str) -> Structured:
    """Inf-ball output rows with the signs of the row's own Jacobian kept, in `rows_abs`
    (docs/local-second-order.md, "Signed output rows"). With jc +- jr the rows' enclosure (jr the
    smaller of the forward and the telescoped one), D the entries whose sign the enclosure
    fixes (jr < |jc|), s their signs and U the others:
      sum_p |J_ip(X)| <= ||jc_i||_1 + sum_p zr_ip + sum_k [sum_D s_p T_k,ip + sum_U |T_k,ip|],
    and for a factored term T_k,i = sum_b beta_b J_in,b(X) (|beta_b| <= c_ib)
      sum_D s_p T_k,ip + sum_U |T_k,ip| <= sum_b c_ib (|jc_in,b,D . s| + |jc_in,b,U|_1
                                                        + ||jr_in,b||_1),
    or its plain row sum."""
    if norm != "inf" or not isinstance(v, LocalValue) or not terms:
        return st
    jcm, base, s, und = row_signs(v, zr, combos, rem)
    p = jcm.shape[1]
    total = base + sum(op_row_bounds(terms, s, und))
    total = widen_up(total, 2 * len(terms) + 2)
    full = widen_up(widen_up(np.abs(jcm).sum(axis=1), p) + total, 2)
    if not np.all(np.isfinite(full)):
        return st
    return replace(st, rows_abs=full)


def row_enclosure(v: LocalValue, combos: np.ndarray | None, rem: np.ndarray | None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rows of v (or combos @ v): their centre jcm (M, P), jrr >= |J(X) - jcm| over the
    ball, and the rounding of combos @ jc (zero without combos)."""
    m = v.center.size
    jc = v.jc.reshape(m, -1)
    jr = v.jr.reshape(m, -1)
    if combos is None:
        jcm, jrr, err = jc, jr, np.zeros_like(jc)
    else:
        jcm = combos @ jc
        err = gamma(m) * (np.abs(combos) @ np.abs(jc))  # the rounding of combos @ jc
        jrr = np.abs(combos) @ jr
    if rem is not None and rem.shape == jrr.shape:
        jrr = np.minimum(jrr, rem)
    return jcm, widen_up(jrr + err, m + 2), err


def row_signs(v: LocalValue, zr: np.ndarray, combos: np.ndarray | None, rem: np.ndarray | None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For the rows of v (or combos @ v): their centre jcm (M, P), the rounding terms of
    their row sums (M,), the signs s of the entries D the enclosure fixes (jr < |jc|) and
    the mask of the others U, both (M, P)."""
    jcm, jrr, err = row_enclosure(v, combos, rem)
    p = jcm.shape[1]
    det = jrr < np.abs(jcm)
    s = np.where(det, np.sign(jcm), 0.0)  # (M, P)
    und = (~det).astype(np.float64)
    return jcm, widen_up(zr.sum(axis=1) + err.sum(axis=1), p), s, und


def op_row_bounds(terms: list[tuple[np.ndarray, list[Parts] | None]], s: np.ndarray,
                  und: np.ndarray) -> list[np.ndarray]:
    """Per op: (M,) bounds on sum_D s_p T_k,ip + sum_U |T_k,ip| from its term and parts."""
    out = []
    for mk, parts in terms:
        p = mk.shape[1]
        plain = widen_up(mk.sum(axis=1), p)
        if parts is None:
            out.append(plain)
            continue
        best = plain
        for alt in alternatives(parts):
            sg = np.zeros(plain.shape)
            for c, jci, jri in alt:
                ajc = np.abs(jci)
                a = np.abs(jci @ s.T) + gamma(p) * (ajc @ np.abs(s).T)  # (n, M)
                b = ajc @ und.T
                rr = widen_up(jri.sum(axis=1), p)
                sg = sg + widen_up((c * (a + b).T).sum(axis=1) + c @ rr, c.shape[1] + 2)
            best = np.minimum(best, widen_up(sg, 4 * len(alt)))
        out.append(best)
    return out
