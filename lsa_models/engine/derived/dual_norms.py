"""Upper bounds on the dual norm of a vector affine form over the ball and its symbols: the
adjoint graph's gradient form (derived/adjoint.py, docs/local-graphs.md) in the l1 norm (the
inf-ball's dual) and the l2 norm (the 2-ball's)."""

from __future__ import annotations

import numpy as np

from lsa_models.bounds.numerics import U
from lsa_models.engine.affine import form as affine
from lsa_models.engine.affine.form import Aff
from lsa_models.engine.affine.linear import weighted_sum
from lsa_models.engine.values import Ball, widen_up


def l1_sup(f: Aff, ball: Ball) -> float:
    """sup sum_p |g_p| over the ball and the symbols, g = the form f: |y| <= lam y + mu on
    y's range [l, u] for any lam in [-1, 1] with mu = max(|l| - lam l, |u| - lam u) (|y| - lam y
    is convex: its max on [l, u] is at an end), lam the sign where it is fixed and the chord's
    slope (u + l) / (u - l) where it is not; then sum_p lam_p g_p is one form, its upper end
    taken (the changes cancel across entries), plus sum_p mu_p. The smaller of that and
    sum_p max(|l_p|, |u_p|) (lam = 0)."""
    lo, hi = affine.ranges(f, ball)
    lo, hi = lo.reshape(-1), hi.reshape(-1)
    plain = float(widen_up(np.maximum(np.abs(lo), np.abs(hi)).sum(), lo.size + 2))
    with np.errstate(invalid="ignore", divide="ignore"):
        lam = np.where(lo >= 0, 1.0, np.where(hi <= 0, -1.0, (hi + lo) / (hi - lo)))
    lam = np.clip(np.nan_to_num(lam), -1.0, 1.0)
    mu = np.maximum(np.abs(lo) - lam * lo, np.abs(hi) - lam * hi)
    mu = widen_up(np.maximum(mu, 0.0) + 4 * U * (np.abs(lo) + np.abs(hi)), 4)
    k = f.c.size
    flat = Aff(f.c.reshape(1, k), f.m.reshape(1, k), f.o.reshape(1, k),
               f.a.reshape(1, k, -1), f.b.reshape(1, k))
    s = weighted_sum(flat, lam.reshape(1, k), ball)
    _, shi = affine.ranges(s, ball)
    relaxed = float(widen_up(np.asarray(float(shi.reshape(-1)[0]) + float(mu.sum())), k + 4))
    return min(plain, relaxed)


def l2_sup(f: Aff, ball: Ball) -> float:
    """sup ||g||_2 over the ball and the symbols: ||c + o|| + ||m|| + sup ||a_in d||
    + ||a_sym||_{box->2} + ||b|| (the input part as `affine.token_radius` bounds it)."""
    k = f.c.size
    flat = Aff(np.zeros((1, k)), np.zeros((1, k)), (f.c + f.o).reshape(1, k),
               f.a.reshape(1, k, -1), f.b.reshape(1, k))
    r = float(affine.token_radius(flat, ball).reshape(-1)[0])
    mn = float(np.sqrt(widen_up(np.square(f.m).sum(), k + 2)))
    return float(widen_up(np.asarray(r + mn + 4 * U * (r + mn)), 2))

