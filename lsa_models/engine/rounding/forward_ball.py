"""The centre's forward error by ball arithmetic (FLINT's arb at PREC bits; docs/local-rounding.md,
"The forward margin by ball arithmetic").

`forward_error.check` bounds |T(X0) - c_T| (c_T the float64 forward pass) by one interval
evaluation in float64. Intervals forget which rounding errors cancel: each op's radius goes
through |L| (the absolute matrix), so the bound grows by every layer's absolute row sums.
On four pre-norm sublayers at D = 32 (x-transformers) that is 0.085 relative, where the true
error is ~1e-15; every Jacobian range of the enclosure then carries it, amplified once more
(the output's ranges 36 at a ball of radius 0, against the Jacobian's 3.9).

Here the same graph runs in ball arithmetic at PREC = 256 bits: every value is a midpoint and
a radius that FLINT keeps rigorous through every operation (outward rounding, libm-free
elementary functions), so each tensor's ball contains the exact T(X0) and is ~1e-60 wide
even after the same amplification. The proven error of c_T is then |c_T - mid| + rad,
entrywise, rounded up: the float64 pass's actual error, a few units in the last place.

An op this evaluation does not know (or a centre with infinities, a graph past the
MAX_OPS budget) returns None: the interval bound stands alone. Both bounds are proven, so
forward_error.check keeps the smaller one per entry.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lsa_models.onnx.ops import OPS, Node, RunContext
from lsa_models.operators import ACTIVATION_TYPES, ARITHMETIC_TYPES, make
from lsa_models.operators.normalization import LayerNormalization
from lsa_models.operators.softmax import Softmax

PREC = 256
# elementary ball operations one evaluation may take (~0.1 us each: x-transformers' 1.9e6 in
# 0.18 s, and every enclosure run of a radius job checks its centre): past this the graph is
# left to the interval bound (a 12-layer D = 768 encoder would take minutes)
MAX_OPS = 10_000_000
_LOCK = threading.Lock()  # FLINT's precision is one process-wide setting
_CTX = RunContext(torch.float64)
_LAYOUT = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Slice",
           "Gather", "Concat", "Split", "Expand", "Tile", "Dropout")
Balls = np.ndarray  # an object array of flint.arb


class _Unknown(Exception):
    """An op (or a value) this evaluation does not handle."""


def errors(nodes: list[Node], input_name: str, x: np.ndarray,
           env: dict[str, torch.Tensor]) -> dict[str, np.ndarray] | None:
    """Every input-dependent tensor's proven entrywise |T(X0) - c_T| (c_T = env's float64
    value), or None where the evaluation does not apply."""
    try:
        import flint
    except ImportError:  # an optional refinement
        return None
    if not np.all(np.isfinite(x)) or _cost(nodes, input_name, env) > MAX_OPS:
        return None
    with _LOCK:
        old = flint.ctx.prec
        flint.ctx.prec = PREC
        try:
            return _evaluate(flint, nodes, input_name, x, env)
        except Exception:  # noqa: BLE001
            # _Unknown, or arguments an op's rule cannot take: an optional refinement, the
            # interval bound stands
            return None
        finally:
            flint.ctx.prec = old


def _cost(nodes: list[Node], input_name: str, env: dict[str, torch.Tensor]) -> int:
    dyn = {input_name}
    total = 0
    for node in nodes:
        if not any(a in dyn for a in node.inputs if a):
            continue
        dyn.update(o for o in node.outputs if o)
        out = env.get(node.outputs[0]) if node.outputs and node.outputs[0] else None
        n = int(out.numel()) if isinstance(out, torch.Tensor) else 0
        if node.op_type in ("MatMul", "Gemm"):
            a = env.get(node.inputs[0])
            inner = int(a.shape[-1]) if isinstance(a, torch.Tensor) and a.dim() else 1
            if node.op_type == "Gemm" and int(node.attrs.get("transA", 0)) and \
                    isinstance(a, torch.Tensor):
                inner = int(a.shape[0])
            n *= max(inner, 1)
        if node.op_type == "Conv" and len(node.inputs) > 1:
            w = env.get(node.inputs[1])
            n *= int(np.prod(w.shape[1:])) if isinstance(w, torch.Tensor) else 1
        total += 4 * n
    return total


def _evaluate(flint: object, nodes: list[Node], input_name: str, x: np.ndarray,
              env: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    arb = flint.arb  # type: ignore[attr-defined]
    to_ball = np.frompyfunc(arb, 1, 1)
    vals: dict[str, Balls] = {input_name: to_ball(np.asarray(x, dtype=np.float64))}
    out_err: dict[str, np.ndarray] = {}

    def const(name: str) -> np.ndarray:
        return env[name].detach().numpy()

    def ball(name: str) -> Balls:
        if name in vals:
            return vals[name]
        c = const(name)
        if not np.all(np.isfinite(c)):
            raise _Unknown("a constant is not finite")
        return to_ball(np.asarray(c, dtype=np.float64))

    for node in nodes:
        if node.op_type in ("Shape", "Size") or not any(a in vals for a in node.inputs if a):
            continue
        outs = _node(arb, node, vals, env, ball, const)
        for name, b in zip(node.outputs, outs, strict=False):
            if not name:
                continue
            c = const(name)
            if c.dtype != np.float64 or b.shape != c.shape or not np.all(np.isfinite(c)):
                raise _Unknown(f"{node.op_type}: a centre value is not a finite float64")
            vals[name] = b
            out_err[name] = _distance(arb, c, b)
    return out_err


def _distance(arb: Any, c: np.ndarray, b: Balls) -> np.ndarray:
    """Upper bounds of |c_i - t_i| over every t_i in the balls b_i, as float64."""
    flat = b.reshape(-1)
    cf = c.reshape(-1)
    out = np.empty(cf.size)
    for i in range(cf.size):
        d = (arb(float(cf[i])) - flat[i]).abs_upper()
        if not d.is_finite():
            raise _Unknown("a ball is not finite")
        out[i] = float(d)
    # float() rounds to nearest: one relative step up (and the smallest subnormal) covers it
    return (out * (1 + 2.0**-50) + 5e-324).reshape(c.shape)


def _elementwise(arb: Any, op: str, node: Node, x: Balls, pw: float | None) -> Balls:
    """f in ball arithmetic entrywise: the op's own (lsa_models/operators/), or Neg."""
    fn = make(op, {"exponent": pw} if op == "Pow" else node.attrs)
    if fn is not None and (op != "Pow" or pw is not None):
        f = fn.arb(arb)
    elif op == "Neg":
        f = lambda a: -a  # noqa: E731
    else:
        raise _Unknown(op)
    return np.asarray(np.frompyfunc(f, 1, 1)(x), dtype=object)


def _axes(node: Node, rank: int, const: Callable[[str], np.ndarray]) -> tuple[int, ...] | None:
    if len(node.inputs) > 1 and node.inputs[1]:
        ax = [int(v) for v in np.asarray(const(node.inputs[1])).reshape(-1)]
    elif "axes" in node.attrs:
        ax = [int(v) for v in node.attrs["axes"]]  # type: ignore[union-attr]
    else:
        ax = []
    if not ax:
        if int(node.attrs.get("noop_with_empty_axes", 0)):
            return None
        return tuple(range(rank))
    return tuple(sorted(a % rank for a in ax))


def _node(arb: Any, node: Node, vals: dict[str, Balls], env: dict[str, torch.Tensor],
          ball: Callable[[str], Balls], const: Callable[[str], np.ndarray]) -> list[Balls]:
    t, args = node.op_type, node.inputs
    fixed = all(a not in vals for a in args[1:] if a)  # every input past the first constant
    if t in _LAYOUT or (t == "Cast" and const(node.outputs[0]).dtype == np.float64):
        return _layout(node, vals, env, ball)
    if t in ("Add", "Sub", "Mul", "Div"):
        a, b = ball(args[0]), ball(args[1])
        res = a + b if t == "Add" else a - b if t == "Sub" else a * b if t == "Mul" else a / b
        return [np.asarray(res, dtype=object)]
    if t == "MatMul":
        return [np.asarray(np.matmul(ball(args[0]), ball(args[1])), dtype=object)]
    if t == "Gemm":
        return [_gemm(arb, node, ball)]
    if t == "Einsum":  # ONNX's equations are numpy's (letters, "->", "...")
        eq = node.attrs.get("equation", b"")
        eq = eq.decode() if isinstance(eq, bytes) else str(eq)
        return [np.asarray(np.einsum(eq.replace(" ", ""), *[ball(a) for a in args]),
                           dtype=object)]
    if t == "Conv" and fixed:
        return [_conv(arb, node, ball(args[0]), ball(args[1]),
                      ball(args[2]) if len(args) > 2 and args[2] else None)]
    if t in ("ReduceMean", "ReduceSum"):
        return [_reduce(arb, node, ball(args[0]), const)]
    if t == "Where" and args[0] not in vals:
        cond = const(args[0]).astype(bool)
        return [np.asarray(np.where(cond, ball(args[1]), ball(args[2])), dtype=object)]
    if t == "Softmax":  # e^z / sum e^z (operators/softmax.py)
        return [Softmax(t, node.attrs).arb(arb)(ball(args[0]))]
    if t == "LayerNormalization" and fixed and len([o for o in node.outputs if o]) == 1:
        return [_layernorm(arb, node, ball)]
    if t in ACTIVATION_TYPES or t in ARITHMETIC_TYPES or t == "Neg":
        pw = None
        if t == "Pow":
            if args[1] in vals:
                raise _Unknown("Pow with an input-dependent exponent")
            pw = float(np.asarray(const(args[1])).reshape(()))
        return [_elementwise(arb, t, node, ball(args[0]), pw)]
    raise _Unknown(t)


def _gemm(arb: Any, node: Node, ball: Callable[[str], Balls]) -> Balls:
    """alpha A' B' + beta C, the attributes' float32 values as ops/linear.py reads them."""
    args = node.inputs
    a, b = ball(args[0]), ball(args[1])
    if int(node.attrs.get("transA", 0)):
        a = a.T
    if int(node.attrs.get("transB", 0)):
        b = b.T
    y = np.matmul(a, b)
    alpha = float(node.attrs.get("alpha", 1.0))  # type: ignore[arg-type]
    if alpha != 1.0:
        y = y * arb(alpha)
    if len(args) > 2 and args[2]:
        beta = float(node.attrs.get("beta", 1.0))  # type: ignore[arg-type]
        cc = ball(args[2])
        y = y + (cc if beta == 1.0 else cc * arb(beta))
    return np.asarray(y, dtype=object)


def _reduce(arb: Any, node: Node, x: Balls, const: Callable[[str], np.ndarray]) -> Balls:
    axes = _axes(node, x.ndim, const)
    if axes is None:
        return x
    keep = bool(int(node.attrs.get("keepdims", 1)))  # type: ignore[arg-type]
    s = np.sum(x, axis=axes, keepdims=keep)
    if node.op_type == "ReduceMean":
        s = s / arb(int(np.prod([x.shape[a] for a in axes])))
    return np.asarray(s, dtype=object).reshape(np.shape(s))


def _layernorm(arb: Any, node: Node, ball: Callable[[str], Balls]) -> Balls:
    """(x - mean) (mean of its squares + eps)^-1/2 scale + bias over the axes from `axis` on;
    epsilon read as the engine reads it (decimal_attr, docs/bounds.md "Conventions")."""
    args = node.inputs
    f = LayerNormalization(node.op_type, node.attrs).arb(arb)  # operators/normalization.py
    return f(ball(args[0]), ball(args[1]), ball(args[2]) if len(args) > 2 and args[2] else None)


def _conv(arb: Any, node: Node, x: Balls, w: Balls, b: Balls | None) -> Balls:
    """A 2-D convolution with constant kernel and bias (one group): the input's patches
    gathered by their indices (torch's unfold of an index image; padding reads a zero),
    times the kernel as a matrix."""
    if x.ndim != 4 or w.ndim != 4 or int(node.attrs.get("group", 1)) != 1 or \
            str(node.attrs.get("auto_pad", "NOTSET")) not in ("NOTSET", "VALID"):
        raise _Unknown("Conv other than 2-D with one group and explicit pads")
    kh, kw = int(w.shape[2]), int(w.shape[3])
    st = [int(v) for v in node.attrs.get("strides", [1, 1])]  # type: ignore[union-attr]
    dl = [int(v) for v in node.attrs.get("dilations", [1, 1])]  # type: ignore[union-attr]
    pads = [int(v) for v in node.attrs.get("pads", [0, 0, 0, 0])]  # type: ignore[union-attr]
    if pads[0] != pads[2] or pads[1] != pads[3]:
        raise _Unknown("Conv with asymmetric pads")
    n, c, h, wd = x.shape
    # index n*c*h*w + 1 ... ; 0 is the padding's zero
    ids = torch.arange(1, x.size + 1, dtype=torch.float64).reshape(n, c, h, wd)
    cols = torch.nn.functional.unfold(ids, (kh, kw), dilation=tuple(dl),
                                      padding=(pads[0], pads[1]), stride=tuple(st))
    flat = np.concatenate([np.asarray([arb(0)], dtype=object), x.reshape(-1)])
    patches = flat[cols.numpy().astype(np.int64)]  # (N, C kh kw, L)
    y = np.matmul(w.reshape(w.shape[0], -1), patches)  # (O, C kh kw) @ -> (N, O, L)
    if b is not None:
        y = y + b[None, :, None]
    oh = (h + 2 * pads[0] - dl[0] * (kh - 1) - 1) // st[0] + 1
    ow = (wd + 2 * pads[1] - dl[1] * (kw - 1) - 1) // st[1] + 1
    return np.asarray(y, dtype=object).reshape(n, w.shape[0], oh, ow)


def _layout(node: Node, vals: dict[str, Balls], env: dict[str, torch.Tensor],
            ball: Callable[[str], Balls]) -> list[Balls]:
    """An op that only moves entries: run on the entries' indices (float64, exact below
    2^53), the balls gathered by them."""
    table: list[Balls] = []
    ins: list[torch.Tensor | None] = []
    start = 0
    for a in node.inputs:
        if not a:
            ins.append(None)
            continue
        c = env[a].detach()
        if a in vals or c.is_floating_point():
            b = ball(a)
            table.append(np.asarray(b, dtype=object).reshape(-1))
            ids = np.arange(start, start + b.size, dtype=np.float64).reshape(b.shape)
            start += b.size
            ins.append(torch.from_numpy(ids))
        else:
            ins.append(c)
    if start >= 2**53:
        raise _Unknown("too many entries to index exactly")
    flat = np.concatenate(table) if table else np.empty(0, dtype=object)
    res = OPS[node.op_type].run(node, ins, _CTX)
    outs: list[Balls] = []
    for r in res:
        ids = r.numpy()
        if not np.all(ids == np.round(ids)):
            raise _Unknown(f"{node.op_type} changed the entries' values")
        outs.append(flat[ids.astype(np.int64)].reshape(ids.shape))
    return outs
