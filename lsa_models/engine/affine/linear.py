"""The affine forms' linear and layout ops (through the op itself, as rules.LinearRule /
LayoutRule): linear maps, additive ops, layout moves, reductions and weighted sums."""

from __future__ import annotations

import numpy as np
import torch

from lsa_models.bounds.numerics import U
from lsa_models.engine.affine.elementwise import _scaled
from lsa_models.engine.affine.form import TINY, Aff, _cols, _up, _width, reference, rough_lin
from lsa_models.engine.affine.products import _BLOCK
from lsa_models.engine.enclosure.rules import _abs_node, linear_consts, run_tangents
from lsa_models.engine.values import Ball, center_margin, gamma
from lsa_models.onnx.ops import OPS, Node, RunContext

CTX = RunContext(torch.float64)


# --- linear and layout ops (through the op itself, as rules.LinearRule / LayoutRule) ---

def _torch(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(x, dtype=np.float64, order="C"))


def linear(node: Node, args: list, var: list[int], out_c: np.ndarray, out_m: np.ndarray,
           ball: Ball) -> Aff:
    """Ops linear in their input-dependent operands: o and a through the op (constant
    addends dropped: they cancel in T(X) - T0), b through |L| with the rounding of o, a."""
    def run(nd: Node, fixed: list[torch.Tensor | None], xs: list[np.ndarray]) -> np.ndarray:
        ins = list(fixed)
        for i, xx in zip(var, xs, strict=True):
            ins[i] = _torch(xx)
        return OPS[nd.op_type].run(nd, ins, CTX)[0].numpy()

    vals: list[Aff] = [args[i] for i in var]
    fixed, absn = linear_consts(node, args, False, Aff), _abs_node(node)
    fixed_abs = linear_consts(node, args, True, Aff)
    o = run(node, fixed, [v.o for v in vals])
    w = _width(*vals)
    a = _additive(node, args, var, vals, w)
    if a is None:
        a = run_tangents(node, fixed, var, [_cols(v.a, w) for v in vals])
    k = max(int(np.prod(v.shape)) if v is not None else 1 for v in args)
    g = gamma(k)
    spread = run(absn, fixed_abs, [v.b + g * (np.abs(v.o) + rough_lin(v, ball))
                                   for v in vals])
    b = _up(np.broadcast_to(spread, out_c.shape) + g * np.abs(o), k + 4)
    # forms are never written in place; a strided result is copied as the reference walk
    # does: the next product's BLAS kernel (its summation order) follows the layout, and the
    # same layout keeps the numbers bit for bit (both orders are within gamma(k))
    if a.shape[:-1] != out_c.shape or reference() or not a.flags.c_contiguous:
        a = np.broadcast_to(a, (*out_c.shape, a.shape[-1])).copy()
    return Aff(out_c, out_m, np.broadcast_to(o, out_c.shape).copy(), a, b)


def _additive(node: Node, args: list, var: list[int], vals: list[Aff], w: int
              ) -> np.ndarray | None:
    """The linear part of Add / Sub / Neg without the op run on every column, where no
    operand is broadcast: a form plus a constant keeps its coefficients (x + 0 and -x are
    exact), two forms add theirs (the same sums the op forms, into one array instead of
    through widened copies); None for anything else."""
    t = node.op_type
    if reference() or t not in ("Add", "Sub", "Neg") or len(args) > 2:
        return None
    shape = vals[0].shape
    if any(v is None for v in args) or any(v.shape != shape for v in vals) or \
            np.broadcast_shapes(*(v.shape if isinstance(v, Aff) else np.shape(v)
                                  for v in args)) != shape:
        return None
    if t == "Neg":
        return -vals[0].a
    if len(var) == 1:
        return -vals[0].a if t == "Sub" and var == [1] else vals[0].a
    x, y = vals
    out = np.empty((*shape, w))
    nx, ny = x.a.shape[-1], y.a.shape[-1]
    if nx >= ny:
        out[..., nx:] = 0.0
        np.add(x.a[..., :ny], y.a, out=out[..., :ny]) if t == "Add" else \
            np.subtract(x.a[..., :ny], y.a, out=out[..., :ny])
        out[..., ny:nx] = x.a[..., ny:]
    else:
        out[..., ny:] = 0.0
        np.add(x.a, y.a[..., :nx], out=out[..., :nx]) if t == "Add" else \
            np.subtract(x.a, y.a[..., :nx], out=out[..., :nx])
        if t == "Add":
            out[..., nx:ny] = y.a[..., nx:]
        else:  # a new array, then copied (affine_products._sum_into says why)
            out[..., nx:ny] = -y.a[..., nx:]
    return out


def layout(node: Node, args: list, centers: list[np.ndarray | None], p: int) -> list:
    """Ops that move entries: gathered by index codes (exact)."""
    ins: list[torch.Tensor | None] = []
    p = max([p] + [v.a.shape[-1] for v in args if isinstance(v, Aff)])
    rows_o, rows_a, rows_b = [np.zeros(1)], [np.zeros((1, p))], [np.zeros(1)]
    offset = 1
    for v in args:
        if isinstance(v, Aff):
            n = v.c.size
            ins.append(_torch(np.arange(offset, offset + n, dtype=np.float64).reshape(v.shape)))
            rows_o.append(v.o.reshape(-1))
            rows_a.append(_cols(v.a.reshape(n, -1), p))
            rows_b.append(v.b.reshape(-1))
            offset += n
        elif v is None:
            ins.append(None)
        elif np.issubdtype(v.dtype, np.floating):
            ins.append(_torch(np.zeros_like(v, dtype=np.float64)))
        else:
            ins.append(torch.from_numpy(np.array(v)))
    codes = OPS[node.op_type].run(node, ins, CTX)
    forms = [v for v in args if isinstance(v, Aff)]
    if len(forms) == 1 and forms[0].a.shape[-1] == p and not reference():
        one = _layout_one(forms[0], codes, centers)
        if one is not None:
            return one
    o_all, a_all, b_all = (np.concatenate(rows_o), np.concatenate(rows_a),
                           np.concatenate(rows_b))
    out: list = []
    for code, c in zip(codes, centers, strict=False):
        if c is None or not code.is_floating_point():
            out.append(None)
            continue
        idx = code.numpy().astype(np.int64)
        c = np.asarray(c, dtype=np.float64)
        out.append(Aff(c, center_margin(c), o_all[idx], a_all[idx], b_all[idx]))
    return out


def _layout_one(v: Aff, codes: list[torch.Tensor], centers: list[np.ndarray | None]
                ) -> list | None:
    """`layout` where every output entry is an entry of the one form v (codes 1..n, no
    constant's 0): gathered from v's own rows, and where an output keeps v's order (a
    Reshape, Squeeze, Flatten) its arrays reshaped without a copy; None where a code is 0."""
    n = v.c.size
    out: list = []
    for code, c in zip(codes, centers, strict=False):
        if c is None or not code.is_floating_point():
            out.append(None)
            continue
        idx = code.numpy().astype(np.int64) - 1
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            return None
        c = np.asarray(c, dtype=np.float64)
        w = v.a.shape[-1]
        if idx.size == n and np.array_equal(idx.reshape(-1), np.arange(n)):
            out.append(Aff(c, center_margin(c), v.o.reshape(idx.shape),
                           v.a.reshape(*idx.shape, w), v.b.reshape(idx.shape)))
            continue
        out.append(Aff(c, center_margin(c), v.o.reshape(-1)[idx],
                       v.a.reshape(n, w)[idx], v.b.reshape(-1)[idx]))
    return out


# --- LayerNorm and softmax as chains ---

def _reduce(x: Aff, n: int, mean: bool, ball: Ball) -> Aff:
    """Sum (or mean) over the last axis, kept as a size-1 axis."""
    s = (1.0 / n) if mean else 1.0
    o = x.o.sum(axis=-1, keepdims=True) * s
    a = x.a.sum(axis=-2, keepdims=True) * s
    g = gamma(n + 1)
    b = _up((x.b + g * (np.abs(x.o) + rough_lin(x, ball))).sum(axis=-1, keepdims=True) * s
            + g * np.abs(o), n + 4)
    c = x.c.sum(axis=-1, keepdims=True) * s
    m = _up((x.m + g * np.abs(x.c)).sum(axis=-1, keepdims=True) * s, n + 4) + TINY
    return Aff(c, m, o, a, b)


def _shift(x: Aff, k: np.ndarray) -> Aff:
    """x + k for a constant k: the change is unchanged, the centre moves (rounding in m)."""
    c = x.c + k
    return Aff(c, _up(x.m + 2 * U * np.abs(c), 2) + TINY, x.o, x.a, x.b)


def _scale_const(x: Aff, k: np.ndarray, out_c: np.ndarray, out_m: np.ndarray,
                 ball: Ball) -> Aff:
    """k * x (broadcast) for a constant k."""
    kk = np.broadcast_to(k, out_c.shape)
    return _scaled(Aff(x.c, x.m, np.broadcast_to(x.o, out_c.shape),
                       np.broadcast_to(x.a, (*out_c.shape, x.a.shape[-1])),
                       np.broadcast_to(x.b, out_c.shape)), kk, np.zeros(out_c.shape),
                   out_c, out_m, np.broadcast_to(rough_lin(x, ball), out_c.shape))


def weighted_sum(x: Aff, w: np.ndarray, ball: Ball) -> Aff:
    """sum_i w_i x_i over the last axis (kept as a size-1 axis) for a constant w, its
    rounding in the box and the margin."""
    n = x.shape[-1]
    g = gamma(n + 2)
    aw = np.abs(w)
    o = (w * x.o).sum(axis=-1, keepdims=True)
    a = _weighted_cols(w, x.a)
    b = _up((aw * (x.b + g * (np.abs(x.o) + rough_lin(x, ball)))).sum(axis=-1, keepdims=True)
            + g * np.abs(o), n + 4)
    c = (w * x.c).sum(axis=-1, keepdims=True)
    m = _up((aw * (x.m + g * np.abs(x.c))).sum(axis=-1, keepdims=True) + g * np.abs(c),
            n + 4) + TINY
    return Aff(c, m, o, a, b)


def _weighted_cols(w: np.ndarray, a: np.ndarray) -> np.ndarray:
    """(w[..., None] * a).sum(axis=-2, keepdims=True) for a (..., n, Q), a block of rows
    (tokens) at a time: the products of one block stay in cache instead of a whole-tensor
    temporary (each row's sum is the same: the reduction runs down the axis row by row)."""
    shape = a.shape[:-1]
    if reference() or a.ndim < 3 or np.broadcast_shapes(w.shape, shape) != shape:
        return (w[..., None] * a).sum(axis=-2, keepdims=True)
    n, q = a.shape[-2], a.shape[-1]
    af = a.reshape(-1, n, q)
    wf = np.broadcast_to(w, shape).reshape(-1, n)
    out = np.empty((af.shape[0], 1, q))
    step = max(1, _BLOCK // max(1, n * q))
    for i in range(0, af.shape[0], step):
        out[i:i + step] = (wf[i:i + step, :, None] * af[i:i + step]).sum(axis=-2,
                                                                            keepdims=True)
    return out.reshape(*shape[:-1], 1, q)
