"""Margins through a final LayerNorm and a linear head, the LayerNorm's product deferred past
the head (docs/local-affine.md, "Margins past the final LayerNorm").

Classifiers end in `y = LayerNorm(x)` followed by ops linear in y (pooling, the head): every
margin is `m_j(X) = m_j(X0) + sum_ti C_ti (y_ti(X) - y_ti(X0))` with C the head's row
difference, exactly (the tail is affine in y). With `y_ti = gamma_i u_ti r_t + beta_i`
(u = x - mean x, r = (mean u^2 + eps)^-1/2 per token t),

    sum_ti C_ti (y_ti - y0_ti) = sum_t (s_t r_t - s0_t r0_t),   s_t = sum_i C_ti gamma_i u_ti,

so each token needs ONE product of two scalar forms, s_t (linear in u: exact) and r_t,
instead of D products `u_ti r_t` whose quadratic parts are bounded one by one and then summed
with |C_ti gamma_i| (on Transformer classifiers the affine route's largest loss).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lsa_models.bounds.numerics import U
from lsa_models.engine.affine import form as affine
from lsa_models.engine.affine.form import Aff, _up, reference, rough_lin
from lsa_models.engine.affine.walk import FLOAT_TYPES, LAYOUT, norm_parts, product, weighted_sum
from lsa_models.engine.elementwise_chains import scalar
from lsa_models.engine.enclosure.rules import _abs_node, linear_consts, run_tangents
from lsa_models.engine.values import Ball, gamma
from lsa_models.onnx.ops import Node, decimal_attr

# entries of one block of `weighted_sums`' products (~2 MB, as affine_rules' row blocks)
_BLOCK = 1 << 18

# ops a tail may hold: linear in their one input-dependent operand
_TAIL_LINEAR = ("ReduceMean", "ReduceSum", "Gemm", "MatMul", "Mul", "Div", "Add", "Sub", "Neg")


class _Var:
    """Marks the input-dependent operand for `linear_consts`."""


def _dynamic(nodes: list[Node], input_name: str | None) -> set[str]:
    """The input-dependent tensors: those computed from `input_name`, or without it every
    node's output."""
    if input_name is None:
        return {o for n in nodes for o in n.outputs if o}
    dynamic = {input_name}
    for n in nodes:
        if any(i in dynamic for i in n.inputs if i):
            dynamic.update(o for o in n.outputs if o)
    return dynamic


def graph_index(nodes: list[Node], input_name: str | None
                ) -> tuple[dict[str, Node], dict[str, int], set[str]]:
    """(each tensor's producing node, each tensor's number of readers, the input-dependent
    tensors `_dynamic` finds)."""
    producer = {o: n for n in nodes for o in n.outputs if o}
    readers: dict[str, int] = {}
    for n in nodes:
        for i in n.inputs:
            if i:
                readers[i] = readers.get(i, 0) + 1
    return producer, readers, _dynamic(nodes, input_name)


def find_tail(nodes: list[Node], output: str, env: dict[str, torch.Tensor],
              rms: bool = False, input_name: str | None = None
              ) -> tuple[Node, list[Node]] | None:
    """The LayerNorm (last axis) whose output reaches the graph's output through linear ops
    only, each with one input-dependent operand and read by the next op alone; (the
    LayerNorm, the tail in graph order) or None. With `rms`, an RMSNorm spelled out
    (`x * (mean x^2 + eps)^-1/2` or `x / sqrt(mean x^2 + eps)`, `rms_node`) ends a tail too,
    as a node of type RMS_NORM (inputs [x], output the normalised x, its eps). `input_name`:
    the graph's input, whose dependents alone count as input-dependent (else every node's
    output does, Constant nodes' included)."""
    producer, readers, dynamic = graph_index(nodes, input_name)
    tail: list[Node] = []
    name = output
    while True:
        node = producer.get(name)
        if node is None:
            return None
        if node.op_type == "LayerNormalization":
            rank = env[node.inputs[0]].dim()
            if not tail or int(node.attrs.get("axis", -1)) % rank != rank - 1 or \
                    any(i in dynamic for i in node.inputs[1:] if i):
                return None
            return node, tail[::-1]
        dep = [i for i, x in enumerate(node.inputs) if x and x in dynamic]
        if rms and tail and len(dep) == 2 and node.op_type in ("Mul", "Div"):
            norm = rms_node(node, producer, env)
            if norm is not None:
                return norm, tail[::-1]
        src = step_back(node, dep, readers)
        if src is None:
            return None
        tail.append(node)
        name = src


def step_back(node: Node, dep: list[int], readers: dict[str, int]) -> str | None:
    """The input a tail passes `node` by (its one input-dependent operand, read by it alone)
    where the node is linear in it (layout, a float Cast, `_TAIL_LINEAR` with a constant
    weight), else None; `dep`: the node's input-dependent operands."""
    ok_op = node.op_type in LAYOUT or node.op_type in _TAIL_LINEAR or \
        node.op_type == "Cast" and int(node.attrs.get("to", 0)) in FLOAT_TYPES
    if not ok_op or len(dep) != 1 or len([o for o in node.outputs if o]) != 1:
        return None
    if node.op_type in ("Gemm", "Div") and dep != [0]:
        return None
    src = node.inputs[dep[0]]
    return src if readers.get(src, 0) == 1 else None


RMS_NORM = "RMSNorm"  # the pseudo-op find_tail(rms=True) returns for a spelled-out RMSNorm


def _last_axis_mean(node: Node, env: dict[str, torch.Tensor]) -> bool:
    """A ReduceMean over the last axis alone, the axis kept."""
    if node.op_type != "ReduceMean" or int(node.attrs.get("keepdims", 1)) != 1:
        return False
    rank = env[node.inputs[0]].dim()
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1 and node.inputs[1]:
        axes = [int(a) for a in env[node.inputs[1]].reshape(-1).tolist()]
    return axes is not None and [int(a) % rank for a in axes] == [rank - 1]


_Graph = tuple[dict[str, Node], dict[str, torch.Tensor]]  # producers, centre values


def _rms_var(name: str, g: _Graph) -> tuple[str, float] | None:
    """m = mean(x^2) + eps produced at `name` (Pow(x, 2) or Mul(x, x), ReduceMean over the
    last axis, Add of a constant eps >= 0): (x, eps), or None."""
    producer, env = g
    add = producer.get(name)
    if add is None or add.op_type != "Add" or len(add.inputs) != 2:
        return None
    for i in (0, 1):
        eps = scalar(env, add.inputs[1 - i])
        mean = producer.get(add.inputs[i])
        if eps is None or eps < 0 or mean is None or not _last_axis_mean(mean, env):
            continue
        sq = producer.get(mean.inputs[0])
        if sq is not None and (sq.op_type == "Pow" and scalar(env, sq.inputs[1]) == 2.0
                               or sq.op_type == "Mul" and sq.inputs[0] == sq.inputs[1]):
            return sq.inputs[0], eps
    return None


def _rms_sqrt(name: str, g: _Graph) -> tuple[str, float] | None:
    """sqrt(m) produced at `name`."""
    sq = g[0].get(name)
    return _rms_var(sq.inputs[0], g) if sq is not None and sq.op_type == "Sqrt" else None


def _rms_rsqrt(name: str, g: _Graph) -> tuple[str, float] | None:
    """m^-1/2 produced at `name`: Div(1, sqrt m), Reciprocal(sqrt m) or Pow(m, -0.5)."""
    producer, env = g
    r = producer.get(name)
    if r is None:
        return None
    if r.op_type == "Div" and scalar(env, r.inputs[0]) == 1.0:
        return _rms_sqrt(r.inputs[1], g)
    if r.op_type == "Reciprocal":
        return _rms_sqrt(r.inputs[0], g)
    if r.op_type == "Pow" and scalar(env, r.inputs[1]) == -0.5:
        return _rms_var(r.inputs[0], g)
    return None


def rms_node(node: Node, producer: dict[str, Node], env: dict[str, torch.Tensor]
             ) -> Node | None:
    """`node` as the product of an RMSNorm over the last axis, spelled Mul(x, r) with r =
    1 / sqrt(m) (Div of 1, or Reciprocal) or m^-0.5 (Pow), or Div(x, sqrt(m)); m = mean(x^2)
    + eps: a node of type RMS_NORM (inputs [x], outputs node's, attribute epsilon) or None."""
    g = (producer, env)
    a, b = node.inputs[0], node.inputs[1]
    found: tuple[str, float] | None = None
    if node.op_type == "Div":
        hit = _rms_sqrt(b, g)
        found = hit if hit is not None and hit[0] == a else None
    else:
        for x, r in ((a, b), (b, a)):
            hit = _rms_rsqrt(r, g)
            if hit is not None and hit[0] == x:
                found = hit
                break
    if found is None:
        return None
    return Node(node.name, RMS_NORM, [found[0]], list(node.outputs), {"epsilon": found[1]})


def push_linear(tail: list[Node], env: dict[str, torch.Tensor], start: str, cols: np.ndarray,
          absolute: bool) -> np.ndarray:
    """The tail's linear part applied to the columns (*y.shape, S) (constant addends
    dropped); with `absolute`, the op |L| of every node."""
    name = start
    for node in tail:
        dep = next(i for i, x in enumerate(node.inputs) if x == name)
        args: list = [None if not x else _Var() if i == dep else env[x].detach().numpy()
                      for i, x in enumerate(node.inputs)]
        nd = _abs_node(node) if absolute else node
        fixed = linear_consts(node, args, absolute, _Var)
        cols = run_tangents(nd, fixed, [dep], [cols])
        name = node.outputs[0]
    return cols


def tail_matrix(tail: list[Node], env: dict[str, torch.Tensor], y: str
                ) -> tuple[np.ndarray, np.ndarray]:
    """The tail's matrix A (K x size of y), computed, and err >= |A - computed| entrywise:
    every entry is a sum of at most size-of-y products of the tail's constants, one per node,
    so within gamma_n of the same sums with absolute constants."""
    shape = tuple(env[y].shape)
    size = int(np.prod(shape))
    eye = np.eye(size).reshape(*shape, size)
    a_hat = push_linear(tail, env, y, eye, False).reshape(-1, size)
    a_abs = push_linear(tail, env, y, eye, True).reshape(-1, size)
    return a_hat, gamma(size + 2 * len(tail) + 8) * a_abs


def margins(nodes: list[Node], output: str, env: dict[str, torch.Tensor], ball: Ball,
            forms: dict[str, Aff], out: Aff, label: int, tail: tuple[Node, list[Node]]
            ) -> dict[int, float] | None:
    """Lower bounds of f_label - f_j over the ball with the final LayerNorm's product deferred
    past the tail; `forms` holds the LayerNorm input's form, `out` the output's (its centre
    and margin give m_j(X0)). None where the LayerNorm's chain has no form."""
    ln, nodes_tail = tail
    x = forms.get(ln.inputs[0])
    if x is None:
        return None
    shape = tuple(env[ln.outputs[0]].shape)
    a_hat, err = tail_matrix(nodes_tail, env, ln.outputs[0])
    k = a_hat.shape[0]
    d = shape[-1]
    rms = ln.op_type == RMS_NORM
    if rms:  # y = x r: gamma is a Mul of the tail, no centring, |y_ti| < sqrt(D)
        gam = np.ones(shape)
        dy = 2.0 * np.sqrt(d) * np.ones(shape) * (1 + 1e-12)
        nmax = 2 * math.sqrt(d)  # |n_ti(X) - n_ti(X0)|
        ln_eps = float(ln.attrs["epsilon"])
    else:
        gam = np.broadcast_to(np.asarray(env[ln.inputs[1]].detach().numpy(), np.float64),
                              shape)
        # |y_ti(X) - y_ti(X0)| <= 2 |gamma_i| sqrt(D - 1): both within beta_i +- |gamma_i|
        # sqrt(D - 1)
        dy = 2.0 * np.abs(gam) * np.sqrt(d - 1) * (1 + 1e-12)
        nmax = 2 * math.sqrt(d - 1)
        ln_eps = decimal_attr(float(ln.attrs.get("epsilon", 1e-5)))
    u, r = norm_parts(x, ln_eps, ball, centre=not rms)
    c = out.c.reshape(k)
    m = out.m.reshape(k)
    res: dict[int, float] = {}
    others = [j for j in range(k) if j != label]
    ws = [(a_hat[label] - a_hat[j]).reshape(shape) * gam for j in others]  # C_ti gamma_i
    sums = weighted_sums(u, ws, ball)  # (..., T, 1) each: s_t = sum_i w_ti u_ti
    tokens: dict[int, tuple[Aff, Aff]] = {}
    for j, w, s in zip(others, ws, sums, strict=True):
        ch = product(s, r, ball, matmul=False)  # s_t r_t - s0_t r0_t
        lo = affine.dev_low(_combine_all(ch, ball), ball)  # summed over the tokens
        # the coefficients used, W = fl(fl(a_l - a_j) gamma), against the exact C gamma:
        # |C - fl(a_l - a_j)| <= err_l + err_j + u |a_l - a_j|, and u |W| for the product,
        # each times |n_ti(X) - n_ti(X0)| <= 2 sqrt(D - 1)
        cdiff = np.abs(a_hat[label] - a_hat[j]).reshape(shape)
        coef = (err[label] + err[j]).reshape(shape) + 2 * U * cdiff
        slack = float((coef * dy + 2 * U * np.abs(w) * nmax).sum()) * (1 + 1e-9)
        base = float(c[label] - c[j] - (m[label] + m[j])
                     - 2 * U * abs(c[label] - c[j]))
        res[j] = base + float(lo.reshape(-1)[0]) - slack - affine.TINY
        one = _one_token(w, (err[label] + err[j]).reshape(shape))
        if one is not None:
            if one not in tokens:  # one form per token for all the margins: their sizes
                tokens[one] = (_token(u, one), _token(r, one))  # are computed once (memo)
            alt = signed_margin(*tokens[one], _token_w(w, one), base - slack, d, ln_eps,
                                ball)
            if alt is not None and alt > res[j]:
                res[j] = alt
    return res


def weighted_sums(x: Aff, ws: list[np.ndarray], ball: Ball) -> list[Aff]:
    """[affine_rules.weighted_sum(x, w, ball) for w in ws], the same numbers, in one pass:
    the weights (each of x's shape) stacked, every elementwise term and every sum over the
    last axis computed as weighted_sum computes it for one w (the same operations per
    entry), the coefficients token row by token row for all the weights at once (each
    reads x.a's row once, not once per margin); a row every weight leaves out (a margin
    that reads one token) is 0 without its products."""
    shape = x.shape
    if not ws or reference() or x.a.ndim < 3 or any(w.shape != shape for w in ws):
        return [weighted_sum(x, w, ball) for w in ws]
    n, q = shape[-1], x.a.shape[-1]
    g = gamma(n + 2)
    wk = np.stack(ws)  # (K, *S)
    aw = np.abs(wk)
    o = (wk * x.o).sum(axis=-1, keepdims=True)
    spread = x.b + g * (np.abs(x.o) + rough_lin(x, ball))
    b = _up((aw * spread).sum(axis=-1, keepdims=True) + g * np.abs(o), n + 4)
    c = (wk * x.c).sum(axis=-1, keepdims=True)
    m = _up((aw * (x.m + g * np.abs(x.c))).sum(axis=-1, keepdims=True) + g * np.abs(c),
            n + 4) + affine.TINY
    a = _stacked_cols(wk.reshape(len(ws), -1, n), x.a.reshape(-1, n, q))
    a = a.reshape(len(ws), *shape[:-1], 1, q)
    return [Aff(c[i], m[i], o[i], a[i], b[i]) for i in range(len(ws))]


def _stacked_cols(wk: np.ndarray, a: np.ndarray) -> np.ndarray:
    """(wk[:, r, :, None] * a[r]).sum(axis=-2) for every row r, (K, R, Q), for weights wk (K,
    R, n) and coefficients a (R, n, Q): each sum runs down the n axis as `weighted_sum`'s
    (affine_rules._weighted_cols) does; rows whose weights are all 0 are left 0."""
    k, rows, n = wk.shape
    q = a.shape[-1]
    out = np.zeros((k, rows, q))
    live = np.flatnonzero(np.any(wk != 0, axis=(0, 2)))
    step = max(1, _BLOCK // max(1, n * q))
    for r in live:
        for j in range(0, k, step):
            out[j:j + step, r] = (wk[j:j + step, r, :, None] * a[r]).sum(axis=-2)
    return out


def _one_token(w: np.ndarray, err: np.ndarray) -> int | None:
    """The flat index of the one token (over the leading axes and T) the margin reads, or
    None where it reads several (mean pooling) or none."""
    rows = (np.any(w != 0, axis=-1) | np.any(err != 0, axis=-1)).reshape(-1)
    idx = np.flatnonzero(rows)
    return int(idx[0]) if idx.size == 1 else None


def _token(x: Aff, t: int) -> Aff:
    """Token t (a flat index over the leading axes and T) of a (..., T, D) form, (1, D)."""
    d = x.shape[-1]
    return Aff(x.c.reshape(-1, d)[t:t + 1], x.m.reshape(-1, d)[t:t + 1],
               x.o.reshape(-1, d)[t:t + 1], x.a.reshape(-1, d, x.a.shape[-1])[t:t + 1],
               x.b.reshape(-1, d)[t:t + 1])


def _token_w(w: np.ndarray, t: int) -> np.ndarray:
    return w.reshape(-1, w.shape[-1])[t:t + 1]


def signed_margin(u: Aff, r: Aff, w: np.ndarray, k0: float, d: int, ln_eps: float,
                   ball: Ball) -> float | None:
    """A lower bound of a margin that reads the final LayerNorm at one token only (a CLS or
    last token): with s = w . u (u the centred token, w = C gamma) and r = (|u|^2/D +
    eps)^-1/2 > 0, m(X) >= K + s(X) r(X) for K = k0 - sup s0 r0 (k0 a lower bound of
    m(X0) less the coefficients' slack), and K + s r = r (s + K f(u)) with f(u) = sqrt(|u|^2
    / D + eps): the sign of the margin is that of g = s + K f, and f is convex, so
    K >= 0: f(u) >= p . u / sqrt(D) + q sqrt(eps) for any |(p, q)| <= 1 (f is the norm of
        (u / sqrt(D), sqrt(eps))): g is bounded below by a LINEAR form of u (no product, no
        rsqrt: the LayerNorm's nonlinearity is gone from the margin);
    K < 0: f(c + D) <= f(c) + f'(c) . D + |D|^2 / (2 D f_min) (f's Hessian is at most
        I / (D f), f >= f_min on the segment), so g >= s + K (f(c) + f'(c) . D) + K
        rho^2 / (2 D f_min) with rho >= |u(X) - c|: linear in u, one second-order term.
    Then m >= r_lo g_lo (g_lo >= 0) or r_hi g_lo. None where a quantity is not finite.
    (docs/local-affine.md, "One token's margin by its sign")"""
    cu = u.c.reshape(-1)
    nrm2 = float(np.dot(cu, cu))
    fc = math.sqrt(nrm2 / d + ln_eps)  # f at the computed centre c
    if not (fc > 0 and math.isfinite(fc)):
        return None
    # sup s0 r0: s0 within s.c +- s.m, r0 within r.c +- r.m (the forms' centres)
    s = weighted_sum(u, w, ball)
    s_c, s_m = float(s.c.reshape(-1)[0]), float(s.m.reshape(-1)[0])
    r_c, r_m = float(r.c.reshape(-1)[0]), float(r.m.reshape(-1)[0])
    prod = max((s_c + e1 * s_m) * (r_c + e2 * r_m) for e1 in (-1, 1) for e2 in (-1, 1))
    kk = k0 - prod - 4 * U * abs(prod) - affine.TINY
    if kk >= 0:
        # (p, q) = (c / sqrt(D), sqrt(eps)) / f(c), shrunk so that |(p, q)| <= 1 after rounding
        shrink = 1 - 64 * (d + 4) * U
        p = cu / (math.sqrt(d) * fc) * shrink
        q = math.sqrt(ln_eps) / fc * shrink
        coef = p / math.sqrt(d)  # K f >= K (coef . u + q sqrt(eps))
        const = kk * q * math.sqrt(ln_eps) * (1 - 8 * U)
        second = 0.0
    else:
        # f'(c) = c / (D f(c)); K (f(c) - f'(c) . c) = K eps / f(c); rho >= |u(X) - c|
        coef = cu / (d * fc)
        rho = float(affine.token_radius(u, ball).reshape(-1)[0]) + \
            math.sqrt(float(np.dot(u.m.reshape(-1), u.m.reshape(-1)))) * (1 + 4 * U)
        fmin = math.sqrt(max(0.0, math.sqrt(nrm2) * (1 - (d + 8) * U) - rho) ** 2 / d
                         + ln_eps) * (1 - 8 * U)
        const = kk * ln_eps / fc * (1 + 64 * (d + 4) * U)
        second = -kk * rho * rho / (2 * d * fmin) * (1 + 16 * U) if fmin > 0 else math.inf
    # the computed w' = fl(w + K coef) against the exact w + K f'(c) (or + K p / sqrt(D)):
    # within 4u |w'| + (2D + 32) u |K coef| entrywise (coef's own rounding: f(c)'s is (D/2 +
    # 2) u relative), times |u_i(X)| <= its range's magnitude
    wk = w.reshape(-1) + kk * coef
    lo_u, hi_u = affine.ranges(u, ball)
    umax = np.maximum(np.abs(lo_u), np.abs(hi_u)).reshape(-1)
    werr = float(((4 * U * np.abs(wk) + (2 * d + 32) * U * np.abs(kk * coef)) * umax).sum()) \
        * (1 + 1e-9)
    g = weighted_sum(u, wk.reshape(1, -1), ball)
    g_lo = float(g.c.reshape(-1)[0] - g.m.reshape(-1)[0]
                 + affine.dev_low(g, ball).reshape(-1)[0])
    total = g_lo + const - second - werr
    g_lo = total * (1 - 4 * U if total >= 0 else 1 + 4 * U) - 4 * U * abs(const) - affine.TINY
    r_lo, r_hi = affine.ranges(r, ball)
    rl, rh = float(r_lo.reshape(-1)[0]), float(r_hi.reshape(-1)[0])
    if not (math.isfinite(g_lo) and math.isfinite(rh)):
        return None
    return g_lo * max(rl, 0.0) * (1 - 4 * U) if g_lo >= 0 else g_lo * rh * (1 + 4 * U)


def _combine_all(x: Aff, ball: Ball) -> Aff:
    """The sum of every entry of x, as one entry."""
    flat = Aff(x.c.reshape(1, -1), x.m.reshape(1, -1), x.o.reshape(1, -1),
               x.a.reshape(1, x.c.size, -1), x.b.reshape(1, -1))
    return weighted_sum(flat, np.ones((1, x.c.size)), ball)


