"""Margins through a ReLU head (docs/local-bounds.md, "Margins through a ReLU head").

Classifiers often end `logits = L(ReLU(z))` with L linear (DistilBERT's pre-classifier,
an MLP's last hidden layer): every margin is exactly
`m_j(X) = m_j(X0) + sum_h C_h (y_h(X) - y_h(X0))`, y = ReLU(z), C the tail's row difference.
Only one side of each y_h matters for a lower bound: `y_h >= alpha_h z_h` for any alpha_h in
[0, 1] where C_h > 0, and `y_h <= s_h (z_h - l_h)` (the chord, s = u / (u - l)) where C_h < 0,
on the range [l_h, u_h] of z_h. The affine forms' ReLU keeps a symmetric band around one slope
(the chord's) with a symbol per unit; its lower side is the line with alpha_h = s_h. Here every
margin gets its own alphas (alpha-CROWN's choice at the last layer): the bound
`min over the ball of sum_h C_h beta_h z_h(X) + const` is concave in the alphas (a minimum of
functions linear in them), so projected supergradient steps raise it; any alphas are sound.
"""

from __future__ import annotations

import numpy as np
import torch

from ..bounds.numerics import U
from ..onnx.ops import Node
from . import affine
from .affine import Aff, _up
from .affine_rules import weighted_sum
from .deferred import tail_matrix
from .values import Ball, gamma

# supergradient steps on each margin's alphas (H-vector products of the forms: cheap)
ALPHA_STEPS = 40


def margins(tail: list[Node], env: dict[str, torch.Tensor], ball: Ball, relu: Node,
            z: Aff, y: Aff, out: Aff, label: int) -> dict[int, float]:
    """Lower bounds of f_label - f_j over the ball with the head's ReLU relaxed per margin:
    z and y the forms of the ReLU's input and output, `out` the output's (its centre and
    margin give m_j(X0)), `tail` the linear ops from the ReLU's output to the output."""
    a_hat, err = tail_matrix(tail, env, relu.outputs[0])  # (K, H)
    h = z.c.size
    zf = Aff(z.c.reshape(1, h), z.m.reshape(1, h), z.o.reshape(1, h),
             z.a.reshape(1, h, -1), z.b.reshape(1, h))
    lo, hi = (v.reshape(h) for v in affine.ranges(z, ball))
    # y lies in [max(lo, 0), max(hi, 0)] at X and at X0 (ReLU is monotone): |dy| <= the width
    dy = _up(np.maximum(hi, 0.0) - np.maximum(lo, 0.0), 2)
    zmax = np.maximum(np.abs(lo), np.abs(hi))
    yc, ym = y.c.reshape(h), y.m.reshape(h)
    k = a_hat.shape[0]
    c_out, m_out = out.c.reshape(k), out.m.reshape(k)
    active, dead = lo >= 0, hi <= 0
    unstable = ~active & ~dead
    # the chord above y on [lo, hi] for unstable units, its slope rounded up (z - lo >= 0)
    width = np.where(unstable, hi - lo, 1.0)
    slope = np.where(unstable, hi / width, 0.0) * (1 + 4 * U)
    chord_c = _up(slope * np.maximum(-lo, 0.0), 2)  # >= -s lo
    res: dict[int, float] = {}
    for j in range(k):
        if j == label:
            continue
        c = a_hat[label] - a_hat[j]
        # |C - c| <= err_l + err_j + u |c|, times |y(X) - y(X0)|
        slack = float(_up((err[label] + err[j] + 2 * U * np.abs(c)) * dy, 2).sum()) * \
            (1 + 1e-9)
        base = float(c_out[label] - c_out[j] - (m_out[label] + m_out[j])
                     - 2 * U * abs(c_out[label] - c_out[j]))
        # sup sum_h c_h y_h(X0): y0 within yc +- ym; the sum's rounding gamma_H sum |c yc|
        y0 = float((c * yc).sum()) + float(_up(np.abs(c) * ym, 2).sum()) * (1 + 1e-9) + \
            gamma(h + 2) * float(np.abs(c * yc).sum()) * (1 + 1e-9)
        lower = unstable & (c > 0)
        upper = unstable & (c < 0)
        fixed = np.where(active, 1.0, 0.0) + np.where(upper, slope, 0.0)
        const = float(-_up(np.abs(c) * np.where(upper, chord_c, 0.0), 2).sum()) * (1 + 1e-9)

        def bound(alpha: np.ndarray, c: np.ndarray = c, fixed: np.ndarray = fixed,
                  lower: np.ndarray = lower) -> tuple[float, Aff]:
            beta = fixed + np.where(lower, alpha, 0.0)
            w = c * beta
            g = weighted_sum(zf, w[None], ball)
            low = float(g.c[0, 0] - g.m[0, 0] + affine.dev_low(g, ball).reshape(-1)[0])
            # the weights fl(c beta) within u |w| of c beta, times |z|
            werr = float(_up(2 * U * np.abs(w) * zmax, 2).sum()) * (1 + 1e-9)
            return low - werr, g

        start = np.where(hi >= -lo, 1.0, 0.0)  # CROWN's choice
        best = max(bound(np.where(unstable, hi / width, 0.0))[0], bound(start)[0])
        if np.any(lower):
            best = max(best, bound(_ascend(zf, c, fixed, lower, start, ball))[0])
        total = base - slack - y0 + const + best
        res[j] = total - 8 * U * (abs(base) + abs(y0) + abs(const) + abs(best)) - affine.TINY
    return res


def _ascend(zf: Aff, c: np.ndarray, fixed: np.ndarray, lower: np.ndarray, alpha: np.ndarray,
            ball: Ball) -> np.ndarray:
    """Projected supergradient ascent on the alphas of the `lower` units: at the minimiser
    (d, e) of the combined form's linear part, d/d alpha_h = c_h z_h(d, e); the alphas of the
    best linear-part value seen (a choice: the caller bounds it rigorously)."""
    p = ball.size
    a = zf.a[0]  # (H, cols)
    zc = zf.c[0] + zf.o[0]
    best, best_v = alpha.copy(), -np.inf
    for step in range(ALPHA_STEPS):
        w = c * (fixed + np.where(lower, alpha, 0.0))
        g = w @ a
        gi, gs = g[:p], g[p:]
        if ball.norm == "inf":
            d = -ball.eps * np.sign(gi)
        else:
            n = float(np.linalg.norm(gi))
            d = -ball.eps * gi / n if n > 0 else np.zeros(p)
        pt = np.concatenate([d, -np.sign(gs)])
        zstar = zc + a @ pt  # z at the minimiser
        v = float(w @ zc + g @ pt)
        if v > best_v:
            best, best_v = alpha.copy(), v
        grad = np.where(lower, c * zstar, 0.0)
        top = float(np.abs(grad).max())
        if top == 0:
            break
        alpha = np.clip(alpha + grad / top / (step + 2), 0.0, 1.0)
    return best
