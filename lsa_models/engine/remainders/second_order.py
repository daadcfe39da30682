"""Second-order signed output rows on the inf-ball (docs/local-second-order.md, "Second-order
signed rows").

The signed rows (remainders/signed_adjoints.py) bound `sum_p |J_ip(X)|` with, per telescoped op k,
an O(eps) bound on its term `T_k(X) = G_k (D_k(X) - D_k(X0)) J_in(X)` taken in absolute value: the
first-order changes of different ops (and of one op's entries) cannot cancel, and an entry's sign is
only known where the first-order enclosure is narrower than the entry. The true first-order change
of row i is `H_i d` (H_i the Hessian of output i at X0, d = X - X0): signed, and summed over all ops
before any norm is taken.

An op with a second-order rule (`OpRemainder.second`, values.py) returns its share of the rows'
Hessians and an entrywise O(eps^2) rest:
    |T_k,ip(X) - H_k,i[p] . d| <= r_k,ip                      (every X in the ball),
an op without one puts its entrywise term bound into the rest. With H = sum_k H_k and
r = sum_k r_k + the centre's rounding, every entry of the row moves by at most
h_ip = min(eps ||H_i[p]||_1 + r_ip, jrr_ip); where h_ip < |jc_ip| its sign is fixed (F), so
    sum_p |J_ip(X)| <= sum_F (|jc_ip| + r_ip) + eps ||sum_F sign(jc_ip) H_i[p]||_1
                       + sum_not F (|jc_ip| + h_ip).

Elementwise y = f(u), with dD_b = f'(u_b(X)) - f'(u_b(X0)), du_b = u_b(X) - u_b(X0):
    dD_b = m_b du_b + e_b,      |e_b| <= sup |f'' - m_b| |du_b|  (mean value, any m_b)
    du_b = jc_u,b . d + eps_b,  |eps_b| <= eps ||jr_u,b||_1       (mean value, inf-ball)
    J_u,b(X) = jc_u,b + R_b,    |R_b| <= jr_u,b
so  T_ip = sum_b G_ib dD_b J_u,bp(X) = sum_b G_ib m_b jc_u,bp (jc_u,b . d) + rest, the rest
bounded by sum_b |G_ib| ((|m_b| |eps_b| + |e_b|) |jc_u,bp| + |dD_b| jr_u,bp), plus the
adjoint's error (ga - |g|) |dD_b| |J_u,bp(X)|. Without an f'' enclosure (ReLU, erf, sigmoid)
m_b = 0 and |e_b| <= sup |dD_b|: first order, still sound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from lsa_models.engine.elementwise_chains import iv_mul
from lsa_models.engine.remainders.structured_norms import Structured, _inf_to_one
from lsa_models.engine.values import FLOOR, LocalValue, gamma, widen_up

# (g signed adjoint (M, *S), ga >= |G| (M, *S), eps) -> (H_k (M, P, P), r_k (M, P)) with
# |T_k,ip(X) - H_k,i[p] . (X - X0)| <= r_k,ip on the inf-ball (T_k the op's term)
SecondFn = Callable[[np.ndarray, np.ndarray, float], tuple[np.ndarray, np.ndarray]]
# the rows' Hessians held at once (M P^2 float64 entries): beyond, the signed rows stand
MAX_HESSIAN_ENTRIES = 4_000_000
# the same for the entrywise enclosures of intermediate tensors (telescope.Telescope.tighten): each
# checkpoint pays it again. 4.3e6 reaches the FFN hidden layer of an 8-token, D = 16
# Transformer (N D_FF = 256 rows, P = 128), not only its residual stream: 4% tighter on a
# 2-layer one's inf-ball for 1.3x the time, peak RSS 0.8 GB
MAX_TENSOR_HESSIAN_ENTRIES = 4_300_000
# signed f'' enclosure over [lo, hi] entrywise, or None where unknown
Curv2 = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None]


def elementwise_second(v: LocalValue, dm: np.ndarray, mc: np.ndarray,
                       curv2: Curv2 | None) -> SecondFn:
    """The second-order rule of y = f(u) entrywise. `v` is u's value, `dm` (*S) bounds
    |f'(u(X)) - f'(u(X0))| over the ball, `mc` the centre's margin, `curv2(lo, hi)` a signed
    enclosure of f'' on [lo, hi] (None: m_b = 0 and |e_b| <= dm_b, first order only)."""
    p = v.jc.shape[-1]
    jc = v.jc.reshape(-1, p)  # (B, P)
    jr = v.jr.reshape(-1, p)
    fac = None if v.jfac is None else (v.jfac[0].reshape(jc.shape[0], -1), v.jfac[1],
                                       v.jfac[2], v.jfac[3].reshape(-1, p))
    ajc = np.abs(jc)
    dmf = dm.reshape(-1)
    du = widen_up(v.rad + mc, 2).reshape(-1)  # |u_b(X) - u_b(X0)| over the ball
    # |eps_b| = |du_b - jc_u,b . d| <= eps ||jr_u,b||_1 (mean value), or the checkpoint's
    # second-order bound on it (second.value_radius) where Telescope.tighten set one
    epsb = eps_part(v)
    jc1 = widen_up(ajc.sum(axis=1), p)  # ||jc_u,b||_1
    m = np.zeros_like(dmf)
    e = dmf.copy()  # |dD_b - m_b du_b| <= e_b
    at = None if curv2 is None else curv2(v.center, v.center)
    if curv2 is not None and at is not None:
        alo, ahi = (np.asarray(a, dtype=np.float64).reshape(-1) for a in at)
        if np.all(np.isfinite(alo)) and np.all(np.isfinite(ahi)):
            mid = 0.5 * (alo + ahi)  # f''(u0) estimated; any m_b is sound (kappa bounds it)
            # |dD_b - m_b du_b| <= kappa_b |du_b| (the integral form; its last piece is the
            # whole range's kappa), and <= |dD_b| + |m_b| |du_b|
            nested = _nested_kappa(v, mc, du, mid, curv2)
            if nested is not None:
                m = mid
                e = np.minimum(widen_up(nested * du, 2), widen_up(dmf + np.abs(m) * du, 3))

    def fn(g: np.ndarray, ga: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
        k = g.shape[0]
        gs = g.reshape(k, -1)  # (M, B)
        gab = ga.reshape(k, -1)
        gerr = np.maximum(gab - np.abs(gs), 0.0)  # |G - g|
        gm = gs * m  # (M, B)
        # H_k,i = sum_b G_ib m_b jc_u,b (x) jc_u,b: the op's share of the Hessian of row i
        hess = np.swapaxes(gm[:, :, None] * jc[None], 1, 2) @ jc  # (M, P, P), BLAS
        agm = np.abs(gm)
        # per entry p, |T_k,ip(X) - H_k,i[p] . d| <= r_ip:
        #   G_ib (m_b eps_b + e_b) jc_u,bp + G_ib dD_b R_bp, |R_bp| <= jr_u,bp, and the
        #   adjoint's error (ga - |g|) dm_b |J_u,bp(X)|
        c = widen_up(agm * epsb(eps) + np.abs(gs) * e, 4)  # (M, B): the per-b scalars' part
        # the adjoint's error, and the rounding of hess: each entry a B-term sum of
        # |G m| |jc| |jc|, times |d| <= eps
        base = (gerr * dmf) @ (ajc + jr) + \
            gamma(jc.shape[0] + 4) * eps * ((agm @ ajc) * jc1.max())
        gd = np.abs(gs) * dmf  # (M, B): |G_ib| sup|dD_b|, what R_b is multiplied by
        other = widen_up(gd @ jr + base, jc.shape[0] + 8)
        rest = widen_up(c @ ajc + other, jc.shape[0] + 8)
        if fac is None:
            return Factored(hess, rest, [(c, jc)], other)
        # R = J_u(X) - jc = M diag(delta) src + R', |delta| <= dmb, |R'| <= rest_u
        # (LocalValue.jfac): sum_c G_ic dD_c R_cp's first part is one scalar per source entry
        fm, dmb, src, frest = fac
        c2 = widen_up((gd @ np.abs(fm)) * dmb, fm.shape[1] + 4)  # (M, Bs)
        c2 = np.minimum(c2, _signed_c2(gs, fm, m, jc, ajc, c, dmb, eps))
        other2 = widen_up(gd @ frest + base, jc.shape[0] + 8)
        rest2 = widen_up(c @ ajc + c2 @ np.abs(src) + other2, jc.shape[0] + src.shape[0] + 8)
        return Factored(hess, np.minimum(rest, rest2), [(c, jc), (c2, src)], other2)

    return fn


# (M, Bs, P) entries of the signed first-order parts in _signed_c2; beyond, the absolute c2
MAX_SIGNED_C2_ENTRIES = 4_000_000


def _signed_c2(gs: np.ndarray, fm: np.ndarray, m: np.ndarray, jc: np.ndarray,
               ajc: np.ndarray, c: np.ndarray, dmb: np.ndarray, eps: float) -> np.ndarray:
    """|beta_ib| for the jfac part with the op's first-order change kept signed over b:
    beta_ib = delta_b sum_c G_ic fm_cb dD_c, and dD_c = m_c jc_c . d + w_c with
    |w_c| <= |m_c| |eps_c| + |e_c|, whose bound per (i, c) is `c` (the per-b scalars' part /
    |G_ic|, here used with G), so
      |sum_c G_ic fm_cb dD_c| <= eps ||sum_c G_ic fm_cb m_c jc_c||_1 + sum_c |fm_cb| c_ic
    (the first sum signed: cancellations over c kept, unlike sum_c |G_ic| sup|dD_c| |fm_cb|).
    inf where the (M, Bs, P) array would be too large."""
    k, b = gs.shape
    bs, p = fm.shape[1], jc.shape[1]
    if k * bs * p > MAX_SIGNED_C2_ENTRIES:
        return np.full((k, bs), np.inf)
    gm = gs * m  # (M, B)
    lin = np.swapaxes(gm[:, :, None] * fm[None], 1, 2) @ jc  # (M, Bs, P), BLAS
    err = gamma(b + 2) * ((np.abs(gm) * ajc.sum(axis=1)) @ np.abs(fm))
    first = widen_up(eps * (widen_up(np.abs(lin).sum(axis=2), p) + err), 2)
    w = widen_up(c @ np.abs(fm), b + 2)  # c_ic >= |G_ic| (|m_c| |eps_c| + |e_c|)
    return widen_up((first + w) * dmb, 3)


def eps_part(v: LocalValue) -> Callable[[float], np.ndarray]:
    """eps -> a bound on |u_b(X) - u_b(X0) - jc_b . d| per entry b (B,): eps ||jr_b||_1, or
    smaller where a checkpoint set `nonlin` (Telescope.tighten, second.value_radius)."""
    p = v.jc.shape[-1]
    jr1 = widen_up(v.jr.reshape(-1, p).sum(axis=1), p)
    nl = v.nonlin

    def at(eps: float) -> np.ndarray:
        out = widen_up(eps * jr1, 1)
        if nl is not None and nl[1].size == out.size and eps == nl[0]:
            out = np.minimum(out, nl[1].reshape(-1))
        return out

    return at


# pieces of the segment for the integral form of the elementwise rest (_nested_kappa):
# MLP inf-ball eps 0.1 9.29 (4) -> 8.41 (8) -> 8.00 (16), at no measurable cost
KAPPA_PIECES = 16


def _nested_kappa(v: LocalValue, mc: np.ndarray, du: np.ndarray, m: np.ndarray,
                  curv2: Curv2) -> np.ndarray | None:
    """(1/n) sum_j sup |f'' - m| over the points within (j/n) |du| of the true centre (and in
    the box): dD_b - m du_b = int_0^1 (f''(u0 + t du_b) - m) du_b dt, and the sup over the
    nested intervals grows with t, so the right Riemann sum bounds the integral."""
    lo = np.minimum(v.lo, v.center - mc).reshape(-1)
    hi = np.maximum(v.hi, v.center + mc).reshape(-1)
    c, mcf = v.center.reshape(-1), mc.reshape(-1)
    total = np.zeros_like(du)
    for j in range(1, KAPPA_PIECES + 1):
        r = du * (j / KAPPA_PIECES) * (1 + 1e-15)
        got = curv2(np.maximum(c - mcf - r, lo), np.minimum(c + mcf + r, hi))
        if got is None:
            return None
        clo, chi = (np.asarray(a, dtype=np.float64).reshape(-1) for a in got)
        if not (np.all(np.isfinite(clo)) and np.all(np.isfinite(chi))):
            return None
        pad = 4e-12 * np.maximum(np.abs(clo), np.abs(chi)) + FLOOR
        total = total + np.maximum(np.maximum(chi - m, m - clo), 0.0) + pad
    return widen_up(total / KAPPA_PIECES, KAPPA_PIECES + 2)


def second_rows(st: Structured, terms: list, zr: np.ndarray, jcm: np.ndarray,
                jrr: np.ndarray, eps: float) -> Structured:
    """rows_abs from the second-order rules: `terms` is a list of (g, ga, value, bound) per
    telescoped op, `bound` (M, P) its entrywise term bound (used for ops without a
    second-order rule), `zr` (M, P) bounds |J(X0) - jcm| (rounding), jcm the centre
    rows, `jrr` the entrywise enclosure |J(X) - jcm| <= jrr. Keeps the smaller of this and
    st.rows_abs. Per row i, with H = sum_k H_k (the rows' Hessians at X0, from the ops'
    shares) and r (M, P) the entrywise rest (|Delta_ip - H_i[p] . d| <= r_ip):
      |Delta_ip| <= h_ip = min(eps ||H_i[p]||_1 + r_ip, jrr_ip); F = {p : h_ip < |jcm_ip|};
      sum_p |J_ip| <= sum_F (|jcm_ip| + r_ip) + eps ||sum_F s_p H_i[p]||_1
                      + sum_not F (|jcm_ip| + h_ip)."""
    p = jcm.shape[1]
    got = hessian_rest_factored(terms, zr, eps)
    if got is None:
        return st
    hess, rest, facs, other = got
    ah = np.abs(hess)
    hrow = hessian_rows(ah)  # (M, P): ||H_i[p]||_1
    h = np.minimum(entry_bounds(hrow, rest, eps), jrr)
    ajc = np.abs(jcm)
    fixed = h < ajc
    s = np.where(fixed, np.sign(jcm), 0.0)  # (M, P)
    lin = (s[:, None, :] @ hess)[:, 0]  # (M, P)
    lin_err = gamma(p) * (np.abs(s)[:, None, :] @ ah)[:, 0]
    lin1 = widen_up(eps * widen_up((np.abs(lin) + lin_err).sum(axis=1), p), 2)
    inside = np.where(fixed, ajc + rest, ajc + h)
    full = widen_up(widen_up(inside.sum(axis=1), p) + lin1, 2)
    if facs:  # the fixed entries' rest with the factored parts' signs kept
        rest_f = widen_up(np.where(fixed, other, 0.0).sum(axis=1), p)
        for c, jcu in facs:
            proj = s @ jcu.T  # (M, B): sum_{p in F} s_p jc_bp
            err = gamma(p + 2) * (np.abs(s) @ np.abs(jcu).T)
            rest_f = rest_f + widen_up((c * (np.abs(proj) + err)).sum(axis=1), c.shape[1] + 2)
        unfixed = widen_up(np.where(fixed, 0.0, h).sum(axis=1), p)
        unfixed = np.minimum(unfixed, _unfixed_factored(hess, hrow, facs, other, fixed, eps))
        part = widen_up(ajc.sum(axis=1) + unfixed, p + 2)
        full = np.minimum(full, widen_up(part + widen_up(rest_f, len(facs) + 2) + lin1, 4))
    else:
        rest_f = widen_up(np.where(fixed, rest, 0.0).sum(axis=1), p)
    full = np.minimum(full, _unfixed_signs(hess, ah, lin, lin_err, ajc, rest, fixed, rest_f,
                                           eps))
    if not np.all(np.isfinite(full)):
        return st
    best = full if st.rows_abs is None else np.minimum(st.rows_abs, full)
    return replace(st, rows_abs=best)


def _unfixed_factored(hess: np.ndarray, hrow: np.ndarray,
                      facs: list[tuple[np.ndarray, np.ndarray]], other: np.ndarray,
                      fixed: np.ndarray, eps: float) -> np.ndarray:
    """Per row, a bound on sum_{p in U} |J_ip(X) - jcm_ip| over the entries U of unfixed sign
    from the factored rest (Factored): J_ip - jcm_ip = H_i[p] . d + sum_facs sum_b beta_ib jc_bp
    + omega_ip, so the sum is at most max_{|d| <= eps} ||H_U d||_1 + sum_facs
    max_{|beta| <= c_i} ||sum_b beta_b jc_b,U||_1 + sum_U other_ip, both maxima by
    structured._inf_to_one (the entrywise sums or the box's l2 bound, ||v||_1 <= sqrt(|U|)
    ||v||_2, which keeps the cancellations between the b's that the entrywise sums drop)."""
    m, p = fixed.shape
    hess_t = np.swapaxes(hess, 1, 2)  # (M, P, P): column q of H_i as row q
    out = np.full(m, np.inf)
    for i in range(m):
        u = ~fixed[i]
        if not u.any():
            out[i] = 0.0
            continue
        # sum_U |H_i[p] . d| = ||H_U d||_1 with |d_q| <= eps: the same box bound, d as beta
        hu = float(widen_up(eps * hrow[i][u].sum(), p))
        hu = _inf_to_one(np.full(p, eps), np.ascontiguousarray(hess_t[i][:, u]), hu)
        tot = widen_up(hu + other[i][u].sum(), 2 * p)
        for c, jcu in facs:
            ju = jcu[:, u]
            plain = float(widen_up((c[i] * np.abs(ju).sum(axis=1)).sum(), ju.size + 2))
            tot = widen_up(tot + _inf_to_one(c[i], ju, plain), 2)
        out[i] = tot
    return out


# rows with at most this many entries of unfixed sign get them enumerated (_unfixed_signs)
MAX_UNFIXED = 12


def _unfixed_signs(hess: np.ndarray, ah: np.ndarray, lin: np.ndarray, lin_err: np.ndarray,
                   ajc: np.ndarray, rest: np.ndarray, fixed: np.ndarray, rest_f: np.ndarray,
                   eps: float) -> np.ndarray:
    """Rows whose unfixed entries U are few: sum_U |J_ip(X)| <= sum_U (|jc_ip| + r_ip) +
    max_sigma sum_U sigma_p H_i[p] . d, so with the fixed entries' linear part v_i = sum_F s_p
    H_i[p] the row's first-order change is at most eps max_sigma ||v_i + sum_U sigma_p H_i[p]||_1
    (the 2^|U| sign patterns enumerated) instead of eps ||v_i||_1 + sum_U eps ||H_i[p]||_1.
    `rest_f` bounds the fixed entries' rests (entrywise or factored). inf where not used."""
    m, p = ajc.shape
    out = np.full(m, np.inf)
    for i in range(m):
        u = np.flatnonzero(~fixed[i])
        if u.size > MAX_UNFIXED:
            continue
        signs = np.array(np.meshgrid(*[[-1.0, 1.0]] * u.size)).reshape(u.size, -1).T \
            if u.size else np.ones((1, 0))  # (2^|U|, |U|)
        tot = lin[i][None, :] + signs @ hess[i][u]  # (2^|U|, P)
        err = lin_err[i] + gamma(u.size + 2) * ah[i][u].sum(axis=0)
        first = widen_up(eps * widen_up((np.abs(tot) + err).sum(axis=1).max(), p), 2)
        base = widen_up(ajc[i][~fixed[i]].sum() + rest[i][~fixed[i]].sum()
                        + ajc[i][fixed[i]].sum(), p)
        out[i] = widen_up(base + rest_f[i] + first, 4)
    return out


class Factored(tuple):
    """What the elementwise and row ops' SecondFns return: (H_k, r_k) like every SecondFn
    (r_k an entrywise bound of the residual rho = T_k(X) - H_k . d), plus a second, factored
    description of the same residual: rho_ip = sum over `facs` (c, jc) of
    sum_b beta_ib(X) jc_bp + omega_ip with |beta_ib| <= c_ib (one scalar per row i and source
    entry b) and |omega| <= `other`. A signed sum over p, sum_p s_p rho_ip, is then at most
    sum_facs sum_b c_ib |sum_p s_p jc_bp| + sum_p |s_p| other_ip (second_rows keeps those
    signs)."""

    facs: list[tuple[np.ndarray, np.ndarray]]  # (c (M, B) >= 0, jc (B, P))
    other: np.ndarray  # (M, P) >= 0

    def __new__(cls, hess: np.ndarray, rest: np.ndarray,
                facs: list[tuple[np.ndarray, np.ndarray]], other: np.ndarray) -> Factored:
        out = super().__new__(cls, (hess, rest))
        out.facs, out.other = facs, other
        return out


def hessian_rest_factored(terms: list, zr: np.ndarray, eps: float,
                          cap: int = MAX_HESSIAN_ENTRIES) -> tuple[
                              np.ndarray, np.ndarray, list[tuple[np.ndarray, np.ndarray]],
                              np.ndarray] | None:
    """(H, r): the rows' Hessians at X0 (M, P, P) summed over the ops with a second-order rule
    and the entrywise rest (M, P): |J_ip(X) - jc_ip - H_i[p] . d| <= r_ip over the ball.
    `terms` as in second_rows; `zr` bounds |J(X0) - jc|. None: no op has a rule, or the
    Hessians would exceed `cap` entries."""
    m, p = zr.shape
    if not terms or m * p * p > cap:
        return None
    hess = np.zeros((m, p, p))
    rest = zr.copy()
    other = zr.copy()  # the rest less the factored parts (Factored)
    facs: list[tuple[np.ndarray, np.ndarray]] = []
    used = 0
    for g, ga, u, bound in terms:
        sec = None if u.remainder is None else u.remainder.second
        if sec is not None:
            got = sec(g, ga, eps)
            hk, rk = got
            hess += hk
            rest = rest + rk
            if isinstance(got, Factored):
                facs.extend(got.facs)
                other = other + got.other
            else:
                other = other + rk
            used += 1
        else:
            rest = rest + bound
            other = other + bound
    if used == 0:
        return None
    n = len(terms) + 2
    return hess, widen_up(rest, n), facs, widen_up(other, n)


def hessian_rows(ah: np.ndarray) -> np.ndarray:
    """||H_i[p]||_1 rounded up (M, P) from |H| (M, P, P): entry_bounds and value_radius
    both read it, so |H| is formed once."""
    return widen_up(ah.sum(axis=2), ah.shape[-1])


def entry_bounds(hrow: np.ndarray, rest: np.ndarray, eps: float) -> np.ndarray:
    """|J_ip(X) - jc_ip| <= eps ||H_i[p]||_1 + r_ip on the inf-ball (M, P); `hrow` from
    hessian_rows."""
    return widen_up(eps * hrow + rest, 2)


def value_radius(hrow: np.ndarray, rest: np.ndarray, jc: np.ndarray, eps: float
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(radius, nonlin) (M,) on the inf-ball from the second-order form, the centre's
    forward margin not included: with d = X - X0 and J_ip(X0 + t d) = jc_ip + t H_i[p] . d
    + rho_ip(t), |rho_ip| <= r_ip, T_i(X) - T_i(X0) = int_0^1 J_i(X0 + t d) . d dt
    = jc_i . d + d^T H_i d / 2 + int rho(t) . d dt, so
    |T_i(X) - T_i(X0) - jc_i . d| <= nonlin_i = eps^2 sum |H_i| / 2 + eps ||r_i||_1 and
    |T_i(X) - T_i(X0)| <= eps ||jc_i||_1 + nonlin_i. `hrow` from hessian_rows (sum |H_i| is
    its row sum: nonnegative terms, rounded up once more)."""
    m, p = rest.shape
    lin = widen_up(np.abs(jc.reshape(m, p)).sum(axis=1), p)
    quad = widen_up(hrow.sum(axis=1), p)
    r1 = widen_up(rest.sum(axis=1), p)
    nonlin = widen_up((0.5 * eps * eps) * quad + eps * r1, 4)
    return widen_up(eps * lin + nonlin, 2), nonlin


def matmul_second(a: LocalValue, b: LocalValue, ar2: np.ndarray, br2: np.ndarray,
                  term: Callable[[np.ndarray], np.ndarray]) -> SecondFn:
    """The second-order rule of y = A @ B, both input-dependent, same batch shape: the op's
    Jacobian is bilinear, (D(X) - D(X0))[J_A, J_B] = J_A dB + dA J_B, so with
    dA = jc_A . d + eps_A (|eps_A| <= eps ||jr_A||_1), J_A(X) = jc_A + R_A (|R_A| <= jr_A):
      J_A dB = jc_A (jc_B . d) + jc_A eps_B + R_A dB, and the same for dA J_B;
    H_i = M_i + M_i^T, M_i[p, q] = sum_{x,y,z} G_i,xz jc_A,xy,p jc_B,yz,q; the rest
    sum_xz |G_xz| sum_y (|jc_A,xy,p| eps ||jr_B,yz||_1 + jr_A,xy,p |dB_yz| + ...), plus the
    entrywise term with the adjoint's error |G - g|. `ar2`, `br2` bound |A(X) - A(X0)| and
    |B(X) - B(X0)|; `term` is the op's entrywise term bound."""
    p = a.jc.shape[-1]
    ja, jb = a.jc, b.jc  # (..., X, Y, P), (..., Y, Z, P)
    aja, ajb = np.abs(ja), np.abs(jb)
    # |eps_A| <= eps ||jr_A||_1 or the checkpoint's bound (eps_part), (..., X, Y)
    epsa, epsb = eps_part(a), eps_part(b)
    y, z = b.shape[-2], b.shape[-1]
    # jc_B as (..., Z, Y * P) for one BLAS product with G
    jbz = np.swapaxes(jb, -3, -2).reshape(*b.shape[:-2], z, y * p)
    ajbz = np.abs(jbz)
    jaf = ja.reshape(-1, p)  # (batch X Y, P)

    def sw(m: np.ndarray) -> np.ndarray:
        return np.swapaxes(m, -1, -2)

    def fn(g: np.ndarray, ga: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
        k = g.shape[0]
        ag = np.abs(g)  # (K, ..., X, Z)
        t1 = (g @ jbz).reshape(k, -1, p)  # (K, batch X Y, P): sum_z G_xz jc_B,yz,q
        m1 = np.swapaxes(jaf, 0, 1)[None] @ t1  # (K, P, P)
        hess = m1 + np.swapaxes(m1, 1, 2)
        # the row and column sums of |jc_A|^T (|G| |jc_B|) (K, P, P), for hess's rounding,
        # without forming it: sum_q (A Y)_pq = A (Y 1), sum_p (A Y)_pq = (1^T A) Y
        yab = (ag @ ajbz).reshape(k, -1, p)  # (K, batch X Y, P)
        n_in = yab.shape[1]
        m1rows = widen_up(yab.sum(axis=2) @ np.abs(jaf), n_in + p)  # (K, P)
        m1cols = widen_up(np.einsum("n,knp->kp", np.abs(jaf).sum(axis=1), yab), n_in + p)
        rest = (
            (ag @ sw(epsb(eps).reshape(b.shape))).reshape(k, -1) @ aja.reshape(-1, p)
            + (ag @ sw(br2)).reshape(k, -1) @ a.jr.reshape(-1, p)
            + (sw(epsa(eps).reshape(a.shape)) @ ag).reshape(k, -1) @ ajb.reshape(-1, p)
            + (sw(ar2) @ ag).reshape(k, -1) @ b.jr.reshape(-1, p)
            + term(np.maximum(ga - ag, 0.0))
            # the rounding of the sums forming hess, times |d| <= eps
            + gamma(a.shape[-2] * y * z + 4) * eps * (m1rows + m1cols)
        )
        return hess, widen_up(rest, a.shape[-2] * y * z + p + 8)

    return fn


def mul_second(a: LocalValue, b: LocalValue, shape: tuple[int, ...], ar2: np.ndarray,
               br2: np.ndarray, term: Callable[[np.ndarray], np.ndarray]) -> SecondFn:
    """The second-order rule of y = A * B entrywise (numpy broadcasting to `shape`), both
    input-dependent: as for MatMul, (D(X) - D(X0))[J_A, J_B] = dB J_A + dA J_B entry by entry,
    so with dA = jc_A . d + eps_A (|eps_A| <= eps_part), J_A(X) = jc_A + R_A (|R_A| <= jr_A),
    per output entry y (A and B read at y's broadcast entry):
      dB_y J_A,y = jc_A,y (jc_B,y . d) + jc_A,y eps_B,y + R_A,y dB_y;
    H_i = M_i + M_i^T, M_i = sum_y G_iy jc_A,y (x) jc_B,y; the rest sum_y |G_iy| (|jc_A,yp|
    |eps_B,y| + jr_A,yp |dB_y| + |eps_A,y| |jc_B,yp| + |dA_y| jr_B,yp), plus the entrywise term
    with the adjoint's error |G - g| and the rounding of the Y-term sums forming M. `ar2`,
    `br2` bound |A(X) - A(X0)| and |B(X) - B(X0)|; `term` is the op's entrywise term bound."""
    p = a.jc.shape[-1]

    def wide(x: np.ndarray) -> np.ndarray:  # an operand's (*S_x, P) array at y's entries
        return np.broadcast_to(x, (*shape, p)).reshape(-1, p)

    def at_y(x: np.ndarray) -> np.ndarray:  # an operand's (*S_x,) array at y's entries
        return np.broadcast_to(x, shape).reshape(-1)

    ja, jb = wide(a.jc), wide(b.jc)  # (Y, P)
    aja, ajb = np.abs(ja), np.abs(jb)
    jra, jrb = wide(a.jr), wide(b.jr)
    da, db = at_y(ar2), at_y(br2)  # (Y,)
    epsa, epsb = eps_part(a), eps_part(b)
    ny = ja.shape[0]

    def fn(g: np.ndarray, ga: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
        k = g.shape[0]
        gs = g.reshape(k, ny)
        ag = np.abs(gs)
        m1 = np.swapaxes(gs[:, :, None] * ja[None], 1, 2) @ jb  # (K, P, P)
        hess = m1 + np.swapaxes(m1, 1, 2)
        # row and column sums of sum_y |G_iy| |jc_A,y| (x) |jc_B,y| for hess's rounding
        m1rows = widen_up((ag * ajb.sum(axis=1)) @ aja, ny + p)  # (K, P)
        m1cols = widen_up((ag * aja.sum(axis=1)) @ ajb, ny + p)
        ea = at_y(epsa(eps).reshape(a.shape))
        eb = at_y(epsb(eps).reshape(b.shape))
        rest = ((ag * eb) @ aja + (ag * db) @ jra + (ag * ea) @ ajb + (ag * da) @ jrb
                + term(np.maximum(ga - np.abs(g), 0.0))
                # the rounding of the sums forming hess, times |d| <= eps
                + gamma(ny + 4) * eps * (m1rows + m1cols))
        return hess, widen_up(rest, ny + p + 8)

    return fn


def gradient_second(jc: np.ndarray, jr: np.ndarray, lmat: np.ndarray, labs: np.ndarray,
                    dev: np.ndarray, c_all: np.ndarray, extra: np.ndarray, eps: float,
                    epsx: np.ndarray) -> Factored:
    """The second-order rule of an op acting on rows of its input x (LayerNorm per token,
    Softmax per row) through h_i(x) = G_i . op(x): its term is T_i = sum_k (grad h_k(x(X)) -
    grad h_k(x0)) J_x,k(X), and grad h(x) - grad h(x0) = L dx + rho with L (K, T, n, n) a
    fixed matrix per row (the Hessian at the centre), |rho_k| <= dev_k (K, T, n), |L| <= labs.
    With dx = jc d + eps_x (|eps_x| <= epsx (T, n): eps ||jr||_1 or the checkpoint's bound,
    eps_part) and J_x(X) = jc + R (|R| <= jr), jc and jr (T, n, P): H_i = sum_T jc^T L jc,
    rest (|L| epsx + dev + L's rounding) |jc| +
    c_all jr (c_all (K, T n) >= |grad h(x) - grad h(x0)|) + extra (K, P) (the adjoint's
    error, bounded by the caller)."""
    k, tok, n, _ = lmat.shape
    p = jc.shape[-1]
    ajc = np.abs(jc)
    jc1 = widen_up(ajc.sum(axis=-1), p)  # (T, n)
    lj = lmat @ jc[None]  # (K, T, n, P)
    hess = np.swapaxes(jc.reshape(tok * n, p), 0, 1)[None] @ lj.reshape(k, tok * n, p)
    # |L| epsx + dev per row entry (one scalar per entry b: the factored part, second.Factored)
    # and |L| (1e-12 + gamma) eps ||jc||_1 for the rounding of H (entrywise, `other`)
    v1 = (labs @ epsx[None, :, :, None])[..., 0] + dev
    vr = (labs @ (eps * (1e-12 + gamma(2 * n + 4)) * jc1)[None, :, :, None])[..., 0]
    ajf = ajc.reshape(tok * n, p)
    other = widen_up(vr.reshape(k, tok * n) @ ajf
                     + c_all.reshape(k, tok * n) @ jr.reshape(tok * n, p) + extra, tok * n + 8)
    c = widen_up(v1.reshape(k, tok * n), 4)
    return Factored(hess, widen_up(c @ ajf + other, tok * n + 8),
                    [(c, jc.reshape(tok * n, p))], other)


def softmax_second(v: LocalValue, plo: np.ndarray, phi: np.ndarray, pc: np.ndarray,
                   margin: np.ndarray, term: Callable[[np.ndarray], np.ndarray],
                   signed_fn: Callable[[np.ndarray, np.ndarray], Any]) -> SecondFn:
    """The second-order rule of s = softmax(z) over the last axis. Per row, h(z) = a . s(z)
    has grad h_k = s_k u_k, u = a - a.s, and Hessian hess_kj = delta_kj s_k u_k -
    s_k s_j (u_k + u_j). L is it at the computed centre; over the logit box s lies in
    [plo, phi] (the rule's probability ranges) and a.s in [sum min(a plo, a phi), sum max]
    (within [min a, max a]), so interval products bound |hess(xi) - L| entrywise, times
    R = |z - z0| (rad + margin) for dev. c_all is the signed rule's bound (signed_fn), the
    adjoint's error goes through the entrywise term with |G - g|."""
    p = v.jc.shape[-1]
    n = v.shape[-1]
    tok = v.center.size // n
    jc = v.jc.reshape(tok, n, p)
    jr = v.jr.reshape(tok, n, p)
    r = widen_up(v.rad + margin, 2).reshape(tok, n)
    epsx = eps_part(v)
    slo, shi, s0 = (np.asarray(t, dtype=np.float64).reshape(tok, n) for t in (plo, phi, pc))
    eye = np.eye(n)

    def fn(g: np.ndarray, ga: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
        k = g.shape[0]
        a = g.reshape(k, tok, n)
        u0 = a - (a * s0).sum(axis=-1, keepdims=True)
        lmat = s0[..., :, None] * (eye * u0[..., :, None]
                                   - s0[..., None, :] * (u0[..., :, None] + u0[..., None, :]))
        ab_lo = np.maximum(np.minimum(a * slo, a * shi).sum(axis=-1, keepdims=True),
                           a.min(axis=-1, keepdims=True))
        ab_hi = np.minimum(np.maximum(a * slo, a * shi).sum(axis=-1, keepdims=True),
                           a.max(axis=-1, keepdims=True))
        ulo, uhi = a - ab_hi, a - ab_lo  # (K, T, n)
        dlo, dhi = iv_mul((slo, shi), (ulo, uhi))  # s_k u_k
        sslo = slo[..., :, None] * slo[..., None, :]  # s_k s_j >= 0
        sshi = shi[..., :, None] * shi[..., None, :]
        olo, ohi = iv_mul((sslo, sshi), (ulo[..., :, None] + ulo[..., None, :],
                                         uhi[..., :, None] + uhi[..., None, :]))
        hlo = eye * dlo[..., :, None] - ohi
        hhi = eye * dhi[..., :, None] - olo
        pad = 1e-12 * (np.abs(hlo) + np.abs(hhi) + np.abs(lmat)) + FLOOR
        wide = np.maximum(hhi - lmat, lmat - hlo) + pad
        dev = widen_up((wide * r[None, :, None, :]).sum(axis=-1), n + 2)  # (K, T, n)
        labs = np.abs(lmat) * (1 + 1e-12)
        c_all = np.asarray(signed_fn(g, ga), dtype=np.float64)
        extra = term(np.maximum(np.asarray(ga) - np.abs(g), 0.0))
        return gradient_second(jc, jr, lmat, labs, dev, c_all, extra, eps,
                               epsx(eps).reshape(tok, n))

    return fn
