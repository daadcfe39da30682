"""Margins through a ReLU head (docs/local-affine.md, "Margins through a ReLU head").

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
A residual branch that joins the tail by an Add or Sub (a pre-norm block's FFN with no final
norm: `x + W2 ReLU(z)`) is a side: its form enters the same combined form with its own
coefficients (its change is exact, its symbols shared).
"""

from __future__ import annotations

import numpy as np
import torch

from lsa_models.bounds.numerics import U
from lsa_models.engine.affine import form as affine
from lsa_models.engine.affine.form import Aff, _up
from lsa_models.engine.affine.walk import weighted_sum
from lsa_models.engine.heads.final_layernorm import graph_index, step_back, tail_matrix
from lsa_models.engine.values import Ball, gamma
from lsa_models.onnx.ops import Node

# supergradient steps on each margin's alphas (H-vector products of the forms: cheap)
ALPHA_STEPS = 40
# residual joins a tail may pass (each a side branch)
MAX_SIDES = 4

Tail = tuple[Node, list[Node], list[tuple[str, int]]]


def find_relu_tail(nodes: list[Node], output: str, env: dict[str, torch.Tensor],
                   input_name: str) -> Tail | None:
    """The Relu whose output reaches the graph's output through ops linear in it (as
    deferred.find_tail's: one input-dependent operand each, read once), where an Add or Sub
    of two input-dependent tensors is passed along the branch that leads to the Relu, the
    other branch becoming a side; (the Relu, the tail in graph order, [(side tensor, index
    of its Add in the tail)]) or None."""
    producer, readers, dynamic = graph_index(nodes, input_name)
    got = _walk_back(output, producer, readers, dynamic, 0)
    if got is None:
        return None
    relu, back, sides = got
    last = len(back) - 1
    return relu, back[::-1], [(name, last - pos) for name, pos in sides]


def _walk_back(name: str, producer: dict[str, Node], readers: dict[str, int],
               dynamic: set[str], depth: int
               ) -> tuple[Node, list[Node], list[tuple[str, int]]] | None:
    """From `name` back to a Relu: (the Relu, the tail from the output back, sides with
    their Add's index in that list)."""
    back: list[Node] = []
    while True:
        node = producer.get(name)
        if node is None:
            return None
        if node.op_type == "Relu":
            return (node, back, []) if back else None
        dep = [i for i, x in enumerate(node.inputs) if x and x in dynamic]
        if len([o for o in node.outputs if o]) != 1:
            return None
        if node.op_type in ("Add", "Sub") and len(dep) == 2 and depth < MAX_SIDES:
            for k in (0, 1):
                branch, other = node.inputs[dep[k]], node.inputs[dep[1 - k]]
                if branch == other or readers.get(branch, 0) != 1:
                    continue
                sub = _walk_back(branch, producer, readers, dynamic, depth + 1)
                if sub is not None:
                    relu, rest, sides = sub
                    at = len(back)
                    return relu, back + [node] + rest, \
                        [(other, at)] + [(n, p + at + 1) for n, p in sides]
            return None
        src = step_back(node, dep, readers)
        if src is None:
            return None
        back.append(node)
        name = src


def _flat(x: Aff, width: int) -> Aff:
    """x as one row of entries (1, n) over `width` columns."""
    n = x.c.size
    return Aff(x.c.reshape(1, n), x.m.reshape(1, n), x.o.reshape(1, n),
               affine._cols(x.a.reshape(1, n, -1), width), x.b.reshape(1, n))


def _joined(parts: list[Aff]) -> Aff:
    """The entries of several forms of one walk side by side, (1, sum n)."""
    width = max(p.a.shape[-1] for p in parts)
    fl = [_flat(p, width) for p in parts]
    def cat(k: str) -> np.ndarray:
        return np.concatenate([getattr(f, k) for f in fl], axis=1)
    return Aff(cat("c"), cat("m"), cat("o"), cat("a"), cat("b"))


def margins(tail: list[Node], env: dict[str, torch.Tensor], ball: Ball, relu: Node,
            z: Aff, y: Aff, out: Aff, label: int,
            sides: list[tuple[str, int, Aff]] | None = None) -> dict[int, float]:
    """Lower bounds of f_label - f_j over the ball with the head's ReLU relaxed per margin:
    z and y the forms of the ReLU's input and output, `out` the output's (its centre and
    margin give m_j(X0)), `tail` the linear ops from the ReLU's output to the output,
    `sides` the residual branches (tensor, index of its Add in the tail, its form)."""
    a_hat, err = tail_matrix(tail, env, relu.outputs[0])  # (K, H)
    h = z.c.size
    side_rows = [(tail_matrix(tail[pos:], env, name), f) for name, pos, f in sides or []]
    zf = _joined([z] + [f for _, f in side_rows])  # (1, H + sum of the sides' sizes)
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
    # the sides: |s(X) - s(X0)| from their forms' deviations
    side_dev = [np.maximum(*(np.abs(v) for v in affine.dev(f, ball))).reshape(-1)
                for _, f in side_rows]
    for j in range(k):
        if j == label:
            continue
        c = a_hat[label] - a_hat[j]
        # |C - c| <= err_l + err_j + u |c|, times |y(X) - y(X0)|; the same for each side
        slack = float(_up((err[label] + err[j] + 2 * U * np.abs(c)) * dy, 2).sum()) * \
            (1 + 1e-9)
        cs = [am[label] - am[j] for (am, _), _f in side_rows]
        for ((_, ae), _f), ci, dv in zip(side_rows, cs, side_dev, strict=True):
            slack += float(_up((ae[label] + ae[j] + 2 * U * np.abs(ci)) * dv, 2).sum()) * \
                (1 + 1e-9)
        base = float(c_out[label] - c_out[j] - (m_out[label] + m_out[j])
                     - 2 * U * abs(c_out[label] - c_out[j]))
        # sup sum_h c_h y_h(X0): y0 within yc +- ym; the sum's rounding gamma_H sum |c yc|
        y0 = float((c * yc).sum()) + float(_up(np.abs(c) * ym, 2).sum()) * (1 + 1e-9) + \
            gamma(h + 2) * float(np.abs(c * yc).sum()) * (1 + 1e-9)
        for ((_, _), f), ci in zip(side_rows, cs, strict=True):  # sup sum_i c_i s_i(X0)
            fc, fm = f.c.reshape(-1), f.m.reshape(-1)
            y0 += float((ci * fc).sum()) + float(_up(np.abs(ci) * fm, 2).sum()) * \
                (1 + 1e-9) + gamma(fc.size + 2) * float(np.abs(ci * fc).sum()) * (1 + 1e-9)
        cside = np.concatenate(cs) if cs else np.zeros(0)
        lower = unstable & (c > 0)
        upper = unstable & (c < 0)
        fixed = np.where(active, 1.0, 0.0) + np.where(upper, slope, 0.0)
        const = float(-_up(np.abs(c) * np.where(upper, chord_c, 0.0), 2).sum()) * (1 + 1e-9)

        def bound(alpha: np.ndarray, c: np.ndarray = c, fixed: np.ndarray = fixed,
                  lower: np.ndarray = lower, cside: np.ndarray = cside) -> float:
            beta = fixed + np.where(lower, alpha, 0.0)
            w = c * beta
            g = weighted_sum(zf, np.concatenate([w, cside])[None], ball)
            low = float(g.c[0, 0] - g.m[0, 0] + affine.dev_low(g, ball).reshape(-1)[0])
            # the weights fl(c beta) within u |w| of c beta, times |z| (the sides' are exact)
            werr = float(_up(2 * U * np.abs(w) * zmax, 2).sum()) * (1 + 1e-9)
            return low - werr

        start = np.where(hi >= -lo, 1.0, 0.0)  # CROWN's choice
        best = max(bound(np.where(unstable, hi / width, 0.0)), bound(start))
        if np.any(lower):
            best = max(best, bound(_ascend(zf, c, cside, fixed, lower, start, ball)))
        total = base - slack - y0 + const + best
        res[j] = total - 8 * U * (abs(base) + abs(y0) + abs(const) + abs(best)) - affine.TINY
    return res


def _ascend(zf: Aff, c: np.ndarray, cside: np.ndarray, fixed: np.ndarray, lower: np.ndarray,
            alpha: np.ndarray, ball: Ball) -> np.ndarray:
    """Projected supergradient ascent on the alphas of the `lower` units: at the minimiser
    (d, e) of the combined form's linear part, d/d alpha_h = c_h z_h(d, e); the alphas of the
    best linear-part value seen (a choice: the caller bounds it rigorously)."""
    p, h = ball.size, c.size
    a = zf.a[0]  # (H + sides, cols)
    zc = zf.c[0] + zf.o[0]
    best, best_v = alpha.copy(), -np.inf
    for step in range(ALPHA_STEPS):
        w = np.concatenate([c * (fixed + np.where(lower, alpha, 0.0)), cside])
        g = w @ a
        gi, gs = g[:p], g[p:]
        if ball.norm == "inf":
            d = -ball.eps * np.sign(gi)
        else:
            n = float(np.linalg.norm(gi))
            d = -ball.eps * gi / n if n > 0 else np.zeros(p)
        pt = np.concatenate([d, -np.sign(gs)])
        zstar = (zc + a @ pt)[:h]  # z at the minimiser
        v = float(w @ zc + g @ pt)
        if v > best_v:
            best, best_v = alpha.copy(), v
        grad = np.where(lower, c * zstar, 0.0)
        top = float(np.abs(grad).max())
        if top == 0:
            break
        alpha = np.clip(alpha + grad / top / (step + 2), 0.0, 1.0)
    return best
