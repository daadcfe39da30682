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
from lsa_models.operators.linear import axes_of

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
    a = _additive(node, args, var, vals, w, out_c.shape)
    if a is None and var == [0]:
        a = _reduced(node, fixed, vals[0])
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
    if a.shape[:-1] != out_c.shape or reference():
        a = np.broadcast_to(a, (*out_c.shape, a.shape[-1])).copy()
    elif not a.flags.c_contiguous:
        a = _column_last(a)
    return Aff(out_c, out_m, np.broadcast_to(o, out_c.shape).copy(), a, b)


# rows x columns of one tile of `_column_last` (two tiles of 512 KB stay in cache)
TILE = 256


def _column_last(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of a (..., P) (the same floats): where a's column axis is its
    slowest in memory (vmap's result, its columns moved from the front), the transposition
    tile by tile (a copy in a's order reads or writes across memory by strides: twice
    slower), else numpy's copy."""
    front = np.moveaxis(a, -1, 0)
    if a.ndim < 2 or not front.flags.c_contiguous:
        return np.ascontiguousarray(a)
    p = a.shape[-1]
    r = a.size // max(p, 1)
    src = front.reshape(p, r)  # a view: column q of a's rows is src[q]
    out = np.empty((r, p))
    for i in range(0, r, TILE):
        for j in range(0, p, TILE):
            out[i:i + TILE, j:j + TILE] = src[j:j + TILE, i:i + TILE].T
    return out.reshape(a.shape)


def _additive(node: Node, args: list, var: list[int], vals: list[Aff], w: int,
              shape: tuple[int, ...] | None = None) -> np.ndarray | None:
    """The linear part of Add / Sub / Neg, and of Mul / Div by a constant, without the op run
    on every column (through vmap on widened copies), operands broadcast to the output's
    `shape` or not: each coefficient is one correctly rounded operation on the operands'
    (x + 0 and -x exact, two forms' sums, x * k, x / k), the same floats the op gives on the
    widened columns, into one array (a form plus a constant keeps its coefficients); None
    for anything else."""
    t = node.op_type
    if reference() or t not in ("Add", "Sub", "Neg", "Mul", "Div") or len(args) > 2 or \
            any(v is None for v in args):
        return None
    shape = vals[0].shape if shape is None else tuple(shape)
    if np.broadcast_shapes(*(v.shape if isinstance(v, Aff) else np.shape(v)
                             for v in args)) != shape:
        return None
    if t in ("Mul", "Div"):
        return _by_constant(t, args, var, shape)
    if t == "Neg":
        return -vals[0].a
    if len(var) == 1:
        return -vals[0].a if t == "Sub" and var == [1] else vals[0].a
    x, y = vals
    out = np.empty((*shape, w))
    nx, ny = x.a.shape[-1], y.a.shape[-1]
    # the right-hand sides broadcast over the output's entries (numpy's rules, as the op's)
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


def _by_constant(t: str, args: list, var: list[int], shape: tuple[int, ...]
                 ) -> np.ndarray | None:
    """x * k (either order) or x / k for one form x and a float constant k, entrywise on
    x's coefficients (k in float64, as the op runs on changes); None otherwise."""
    if len(var) != 1 or (t == "Div" and var != [0]):
        return None
    k = np.asarray(args[1 - var[0]])
    if not np.issubdtype(k.dtype, np.floating):
        return None
    x = args[var[0]]
    k = k.astype(np.float64)[..., None]
    out = np.multiply(x.a, k) if t == "Mul" else np.divide(x.a, k)
    return out if out.shape[:-1] == shape else None


def _reduced(node: Node, fixed: list[torch.Tensor | None], x: Aff) -> np.ndarray | None:
    """The linear part of ReduceSum / ReduceMean of one form over axes of its entries, the
    floats the op gives run through vmap over the columns without vmap's copies: vmap runs
    the op on the coefficients with their column axis moved to the front (a view), so the
    same torch reduction on the same view, its result copied back column-last once
    (`_row_sums` where the sums' order is known); None for anything else."""
    t = node.op_type
    if reference() or t not in ("ReduceSum", "ReduceMean") or len(fixed) > 2:
        return None
    nd = len(x.shape)
    axes = axes_of(fixed, node.attrs)
    keep = bool(node.attrs.get("keepdims", 1))
    if not axes:
        if node.attrs.get("noop_with_empty_axes", 0):
            return x.a
        axes = list(range(nd))
    dims = tuple(sorted({int(i) % nd for i in axes}))
    fast = _row_sums(x.a, dims, keep, t == "ReduceMean")
    if fast is not None:
        return fast
    ta = torch.from_numpy(x.a if x.a.flags.c_contiguous else np.ascontiguousarray(x.a))
    front = ta.movedim(-1, 0)
    red = tuple(d + 1 for d in dims)
    out = front.mean(dim=red, keepdim=keep) if t == "ReduceMean" else \
        front.sum(dim=red, keepdim=keep)
    res = torch.empty((*out.shape[1:], out.shape[0]), dtype=out.dtype)
    res.copy_(out.movedim(0, -1))
    return res.numpy()


# `_row_sums` up to this many terms per sum (one level of torch's cascade: its blocks of
# 16 rows per partial sum start at 4 x 16 terms)
ROW_SUM_MAX = 63


def _row_sums(a: np.ndarray, dims: tuple[int, ...], keep: bool, mean: bool
              ) -> np.ndarray | None:
    """The sums (means) over one entry axis of the coefficients a (*S, P) in the order
    torch's reduction of vmap's column-first view adds them (its scalar row sum, the summed
    axis strided: four partial sums p_k = x_k + x_{k+4} + ... from 0, the n mod 4 last terms
    onto p_0, then ((p_0 + p_1) + p_2) + p_3; a mean divided by n after), as whole slices of
    a; None outside the layouts tests/test_affine_fast.py pins against vmap (the last entry
    axis, at most ROW_SUM_MAX terms, more than one sum per column, more than one column:
    elsewhere torch iterates the axes after it innermost, another order, and with one
    column the summed axis is contiguous, which torch sums vectorised)."""
    if dims != (a.ndim - 2,):
        return None
    ax = dims[0]
    n = a.shape[ax]
    if not 1 <= n <= ROW_SUM_MAX or a.shape[-1] < 2 or a.size // (n * a.shape[-1]) < 2:
        return None
    xs = np.moveaxis(a, ax, 0)  # a view: xs[i] is the i-th term of every sum
    quads = n // 4
    parts = []
    for k in range(min(4, n)):
        acc = np.zeros(xs.shape[1:])
        for i in range(quads):
            acc += xs[k + 4 * i]
        parts.append(acc)
    for i in range(4 * quads, n):
        parts[0] += xs[i]
    out = parts[0]
    for k in range(1, len(parts)):
        out += parts[k]
    if mean:
        out /= n
    return np.expand_dims(out, ax) if keep else out


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
    constant's 0): gathered from v's own rows, and where an output is a run of v's entries
    in v's order (a Reshape, Squeeze, Flatten; a Slice of the leading axes) views of its
    arrays without a copy; None where a code is 0."""
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
        flat = idx.reshape(-1)
        lo = int(flat[0]) if flat.size else 0
        if flat.size and np.array_equal(flat, np.arange(lo, lo + flat.size)):
            # a run of v's entries in order (all of them: a Reshape, Squeeze, Flatten; a
            # block of the leading axes: a Slice, Split, Gather there): views of v's rows,
            # C-contiguous as the gathered copies were (the forms are never written in place)
            hi = lo + flat.size
            out.append(Aff(c, center_margin(c), v.o.reshape(-1)[lo:hi].reshape(idx.shape),
                           v.a.reshape(n, w)[lo:hi].reshape(*idx.shape, w),
                           v.b.reshape(-1)[lo:hi].reshape(idx.shape)))
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
