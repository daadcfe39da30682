"""LayerNorm's Jacobian as one matrix enclosed over the ball (docs/local-enclosure.md,
"Rules", LayerNorm directly).

Per token, with u = P x (P = I - 11^T/D), sigma = sqrt(||u||^2/D + eps), z = u / sigma:
    dz/dx = S(x) = (1/sigma) (P - z z^T / D)
and y = gamma z + beta. Over the ball, 1/sigma lies in [1/sigma_hi, 1/sigma_lo] (sigma from the
token's centred norm +- its displacement) and z_i in u_i / sigma intervals, |z_i| < sqrt(D);
every entry of S gets an interval, so S(X) in S(X0) +- sr, and
    J_y(X) = diag(gamma) S(X) J_x(X) in gamma S_c jc +- |gamma| (|S_c| jr + sr (|jc| + jr)).
Unlike the chain u -> u^2 -> mean -> ^-1/2 -> product, the entries of S keep the correlation
of sigma and z (one interval per entry, no product of two separately widened enclosures).
"""

from __future__ import annotations

import numpy as np

from lsa_models.bounds.numerics import U
from lsa_models.engine.remainders.operator_norms import sigma_max_upper
from lsa_models.engine.values import (
    FLOOR,
    PROVEN,
    Ball,
    LocalValue,
    array_key,
    center_margin,
    gamma,
    widen_up,
)
from lsa_models.operators.normalization import REL, LayerNormalization

# relative allowance for the round-to-nearest float64 operations forming one interval end
_REL = REL


def token_radius(v: LocalValue, ball: Ball) -> np.ndarray:
    """Per token (the last axis, D entries): an upper bound on ||v(X) - c_v||_2 over the ball
    (..., 1), from the Jacobian enclosure instead of the entrywise box (docs/local-second-order.md,
    "Token radii"). By the mean value form v(X) - v(X0) = Jbar d with Jbar in jc +- jr, so
    ||v_S(X) - v_S(X0)||_2 <= ||jc_S||_{p->2} eps + ||jr_S |d| ||_2 for the token's rows S:
    p = 2: sigma_max(jc_S) eps + ||jr_S||_F eps; p = inf: min(sqrt(P) sigma_max(jc_S),
    ||row 1-norms of jc_S||_2) eps + ||row sums of jr_S||_2 eps; plus the centre's margin.
    The box gives ||rad_S||_2, up to sqrt(D) times more on a 2-ball (every entry at its own
    extreme at once)."""
    d, p = v.shape[-1], v.jc.shape[-1]
    if not (np.all(np.isfinite(v.jc)) and np.all(np.isfinite(v.jr))):
        return np.full((*v.shape[:-1], 1), np.inf)
    jc = v.jc.reshape(-1, d, p)
    jr = v.jr.reshape(-1, d, p)
    sig = sigma_max_upper(jc)  # (T,)
    if ball.norm == "2":
        a = sig
        b = np.sqrt(widen_up(np.square(jr).sum(axis=(1, 2)), d * p)) * (1 + 4 * U)
    else:
        rows = widen_up(np.abs(jc).sum(axis=-1), p)  # (T, D)
        a = np.minimum(sig * np.sqrt(p) * (1 + 4 * U),
                       np.sqrt(widen_up(np.square(rows).sum(axis=-1), d)) * (1 + 4 * U))
        rj = widen_up(jr.sum(axis=-1), p)
        b = np.sqrt(widen_up(np.square(rj).sum(axis=-1), d)) * (1 + 4 * U)
    m = center_margin(v.center).reshape(-1, d)
    mn = np.sqrt(widen_up(np.square(m).sum(axis=-1), d)) * (1 + 4 * U)
    rho = widen_up(ball.eps * (a + b) + mn, 4)
    return rho.reshape(*v.shape[:-1], 1)


# sigma^2's range, the entries of S and z's interval, S at the centre: the op's own
# (lsa_models/operators/normalization.py)
_bounds_of_s = LayerNormalization.variance_range
jacobian_ranges = LayerNormalization.jacobian_ranges
center_jacobian = LayerNormalization.jacobian_center


def direct(x: LocalValue, u: LocalValue, g: np.ndarray, beta: np.ndarray | None,
           eps: float, norm0: np.ndarray, rho: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                      np.ndarray]:
    """The direct enclosure of y = LayerNorm(x): (jc, jr, y_lo, y_hi, S_c, sr, sr0) with
    sr0 the entries' radius over the centre's own forward margin (docs/local-enclosure.md)."""
    d = x.shape[-1]
    uc = u.center
    sc = np.square(uc).sum(axis=-1, keepdims=True) / d + eps  # (..., 1)
    s_lo, s_hi = _bounds_of_s(norm0, rho, d, eps)
    s_lo, s_hi = np.minimum(s_lo, sc), np.maximum(s_hi, sc)
    s_c = center_jacobian(uc, sc)  # (..., D, D)
    lo, hi, mag, zr = jacobian_ranges(u.lo, u.hi, s_lo, s_hi)
    sr = np.maximum(np.maximum(hi - s_c, s_c - lo), 0.0) + 4 * _REL * mag + FLOOR
    # the true centre: u(X0) within |P| (centre margin of x) of uc
    mx = center_margin(x.center)
    mu = widen_up(mx + mx.mean(axis=-1, keepdims=True), 4)  # |P| m <= (I + 11^T/D) m
    rho0 = np.sqrt(np.square(mu).sum(axis=-1, keepdims=True)) * (1 + _REL)
    s0_lo, s0_hi = _bounds_of_s(norm0, rho0, d, eps)
    s0_lo, s0_hi = np.minimum(s0_lo, sc), np.maximum(s0_hi, sc)
    lo0, hi0, mag0, _ = jacobian_ranges(uc - mu, uc + mu, s0_lo, s0_hi)
    sr0 = np.maximum(np.maximum(hi0 - s_c, s_c - lo0), 0.0) + 4 * _REL * mag0 + FLOOR
    ag = np.abs(g)[:, None]  # (D, 1): scales the output rows
    ajc = np.abs(x.jc)
    asc = np.abs(s_c)
    jc = g[:, None] * (s_c @ x.jc)  # (..., D, P)
    jr = widen_up(ag * (asc @ x.jr + sr @ (ajc + x.jr) + gamma(d) * (asc @ ajc)), 4 * d)
    b = np.zeros(d) if beta is None else np.broadcast_to(np.asarray(beta, np.float64), (d,))
    z_lo, z_hi = zr[0], zr[1]
    y_a, y_b = g * z_lo + b, g * z_hi + b
    y_lo, y_hi = np.minimum(y_a, y_b), np.maximum(y_a, y_b)
    pad = _REL * (np.abs(y_lo) + np.abs(y_hi)) + FLOOR
    return jc, jr, y_lo - pad, y_hi + pad, s_c, sr, sr0


def chain_errors(x: LocalValue, uc: np.ndarray, sqc: np.ndarray, sc: np.ndarray,
                 rc: np.ndarray, zc: np.ndarray, eps: float) -> None:
    """In a run with proven forward errors, the proven errors of the centres the chain forms
    (u = P x, u^2, s = mean(u^2) + eps, r = s^-1/2, z = u r) from x's (docs/local-rounding.md,
    "The forward margin, checked"): errors propagate through each link's derivative plus its
    own rounding."""
    known = PROVEN.get()
    if known is None:
        return
    d = uc.shape[-1]
    ex = center_margin(x.center)
    ax = np.abs(x.center)
    e_u = ex + ex.mean(axis=-1, keepdims=True) + gamma(d + 2) * (ax + ax.mean(
        axis=-1, keepdims=True))
    e_sq = 2 * np.abs(uc) * e_u + e_u * e_u + 4 * U * sqc
    e_s = e_sq.mean(axis=-1, keepdims=True) + gamma(d + 2) * (sc + eps)
    if np.any(sc - e_s <= 0):
        return  # no proven error for r: the run's margin m stays (docs: the open gap)
    e_r = 0.5 * np.power(sc - e_s, -1.5) * e_s + 8 * U * np.abs(rc)
    e_z = np.abs(uc) * e_r + e_u * np.abs(rc) + e_u * e_r + 4 * U * np.abs(zc)
    for arr, err in ((uc, e_u), (sqc, e_sq), (sc, e_s), (rc, e_r), (zc, e_z)):
        known[array_key(arr)] = (arr, widen_up(err, 8))
