"""Margins through a final LayerNorm and a linear head, the LayerNorm's product deferred past
the head (docs/local-bounds.md, "Margins past the final LayerNorm").

Classifiers end in `y = LayerNorm(x)` followed by ops linear in y (pooling, the head): every
margin is `m_j(X) = m_j(X0) + sum_ti C_ti (y_ti(X) - y_ti(X0))` with C the head's row
difference, exactly (the tail is affine in y). With `y_ti = gamma_i u_ti r_t + beta_i`
(u = x - mean x, r = (mean u^2 + eps)^-1/2 per token t),

    sum_ti C_ti (y_ti - y0_ti) = sum_t (s_t r_t - s0_t r0_t),   s_t = sum_i C_ti gamma_i u_ti,

so each token needs ONE product of two scalar forms, s_t (linear in u: exact) and r_t,
instead of D products `u_ti r_t` whose quadratic parts are bounded one by one and then summed
with |C_ti gamma_i| (the affine route's largest loss on the issue-15 Transformers).
"""

from __future__ import annotations

import numpy as np
import torch

from ..bounds.numerics import U
from ..onnx.ops import Node, decimal_attr
from . import affine
from .affine import Aff, select
from .affine_rules import (
    LAYOUT,
    RSQRT,
    SQUARE,
    _add,
    _reduce,
    _shift,
    elementwise,
    product,
    variance,
    weighted_sum,
)
from .rules import _abs_node, linear_consts, run_tangents
from .values import Ball, gamma

# ops a tail may hold: linear in their one input-dependent operand
_TAIL_LINEAR = ("ReduceMean", "ReduceSum", "Gemm", "MatMul", "Mul", "Div", "Add", "Sub", "Neg")


class _Var:
    """Marks the input-dependent operand for `linear_consts`."""


def find_tail(nodes: list[Node], output: str, env: dict[str, torch.Tensor]
              ) -> tuple[Node, list[Node]] | None:
    """The LayerNorm (last axis) whose output reaches the graph's output through linear ops
    only, each with one input-dependent operand and read by the next op alone; (the
    LayerNorm, the tail in graph order) or None."""
    producer = {o: n for n in nodes for o in n.outputs if o}
    readers: dict[str, int] = {}
    for n in nodes:
        for i in n.inputs:
            if i:
                readers[i] = readers.get(i, 0) + 1
    dynamic = {o for n in nodes for o in n.outputs if o}
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
        ok_op = node.op_type in LAYOUT or node.op_type in _TAIL_LINEAR
        if not ok_op or len(dep) != 1 or len([o for o in node.outputs if o]) != 1:
            return None
        if node.op_type == "Gemm" and dep != [0] or node.op_type == "Div" and dep != [0]:
            return None
        src = node.inputs[dep[0]]
        if readers.get(src, 0) != 1:
            return None
        tail.append(node)
        name = src


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
    gam = np.broadcast_to(np.asarray(env[ln.inputs[1]].detach().numpy(), np.float64), shape)
    d = shape[-1]
    # |y_ti(X) - y_ti(X0)| <= 2 |gamma_i| sqrt(D - 1): both within beta_i +- |gamma_i| sqrt(D-1)
    dy = 2.0 * np.abs(gam) * np.sqrt(d - 1) * (1 + 1e-12)
    ln_eps = decimal_attr(float(ln.attrs.get("epsilon", 1e-5)))
    mu = _reduce(x, d, True, ball)
    u = _add(x, Aff(-mu.c, mu.m, -mu.o, -mu.a, mu.b), ball)  # (..., T, D)
    q = elementwise(u, SQUARE, ball)
    v = _shift(_reduce(q, d, True, ball), np.asarray(ln_eps))  # (..., T, 1)
    v = select(v, variance(u, v, ball), ball)
    vlo = np.full(v.shape, ln_eps * (1 - 1e-12))
    r = elementwise(v, RSQRT, ball, vlo, np.full(v.shape, np.inf))
    c = out.c.reshape(k)
    m = out.m.reshape(k)
    res: dict[int, float] = {}
    for j in range(k):
        if j == label:
            continue
        w = (a_hat[label] - a_hat[j]).reshape(shape) * gam  # C_ti gamma_i
        s = weighted_sum(u, w, ball)  # (..., T, 1): s_t = sum_i w_ti u_ti
        ch = product(s, r, ball, matmul=False)  # s_t r_t - s0_t r0_t
        lo = affine.dev_low(_combine_all(ch, ball), ball)  # summed over the tokens
        # the coefficients used, W = fl(fl(a_l - a_j) gamma), against the exact C gamma:
        # |C - fl(a_l - a_j)| <= err_l + err_j + u |a_l - a_j|, and u |W| for the product,
        # each times |n_ti(X) - n_ti(X0)| <= 2 sqrt(D - 1)
        cdiff = np.abs(a_hat[label] - a_hat[j]).reshape(shape)
        coef = (err[label] + err[j]).reshape(shape) + 2 * U * cdiff
        slack = float((coef * dy + 2 * U * np.abs(w) * 2 * np.sqrt(d - 1)).sum()) * (1 + 1e-9)
        base = float(c[label] - c[j] - (m[label] + m[j])
                     - 2 * U * abs(c[label] - c[j]))
        res[j] = base + float(lo.reshape(-1)[0]) - slack - affine.TINY
    return res


def _combine_all(x: Aff, ball: Ball) -> Aff:
    """The sum of every entry of x, as one entry."""
    flat = Aff(x.c.reshape(1, -1), x.m.reshape(1, -1), x.o.reshape(1, -1),
               x.a.reshape(1, x.c.size, -1), x.b.reshape(1, -1))
    return weighted_sum(flat, np.ones((1, x.c.size)), ball)


