"""Elementwise chains as one function: y = f(x) entrywise, f built from one root tensor x by
Add/Sub/Mul/Div/Neg/Pow/Tanh/Erf/Sigmoid with scalar constants (the tanh form of GELU as
torch exports it: 0.5 x (1 + tanh(c (x + a x^3))) is six such nodes). Bounding the chain link
by link sums the absolute value of every link's remainder; as one function its remainder is
|G| sup|f'(x) - f'(x0)| |J_x|, with the range of f' over the input's interval from interval
automatic differentiation (docs/local-bounds.md, "Fused elementwise chains").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import special

from ..onnx.ops import Node

FUSABLE = ("Add", "Sub", "Mul", "Div", "Neg", "Pow", "Tanh", "Erf", "Sigmoid")
_NONLINEAR = ("Tanh", "Erf", "Sigmoid", "Pow")
# relative outward allowance per interval operation: a few roundings of faithfully rounded
# (libm) or correctly rounded operations, far below 1e-12
_REL = 1e-12
# sub-intervals per entry: interval arithmetic's dependency loss shrinks with their width
SPLITS = 8

Iv = tuple[np.ndarray, np.ndarray]


@dataclass
class Chain:
    root: str  # the input tensor x
    sink: str  # the output tensor y = f(x)
    nodes: list[Node]  # in graph order


def _out(lo: np.ndarray, hi: np.ndarray) -> Iv:
    pad = _REL * np.maximum(np.abs(lo), np.abs(hi)) + 1e-300
    return lo - pad, hi + pad


def _mul(a: Iv, b: Iv) -> Iv:
    c = np.stack([a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1]])
    return _out(c.min(axis=0), c.max(axis=0))


def _add(a: Iv, b: Iv) -> Iv:
    return _out(a[0] + b[0], a[1] + b[1])


def _neg(a: Iv) -> Iv:
    return -a[1], -a[0]


def _near_far(a: Iv) -> tuple[np.ndarray, np.ndarray]:
    near = np.where((a[0] <= 0) & (a[1] >= 0), 0.0, np.minimum(np.abs(a[0]), np.abs(a[1])))
    return near, np.maximum(np.abs(a[0]), np.abs(a[1]))


def _bell(fn: Callable[[np.ndarray], np.ndarray], a: Iv) -> Iv:
    """Range of an even function decreasing in |x| (tanh', erf', sigmoid')."""
    near, far = _near_far(a)
    return _out(fn(far), fn(near))


def _square(a: Iv) -> Iv:
    near, far = _near_far(a)
    return _out(near * near, far * far)


_F = {"Tanh": np.tanh, "Erf": special.erf, "Sigmoid": special.expit}
_DF: dict[str, Callable[[np.ndarray], np.ndarray]] = {"Tanh": lambda x: 1.0 - np.tanh(x) ** 2,
       "Erf": lambda x: (2.0 / math.sqrt(math.pi)) * np.exp(-x * x),
       "Sigmoid": lambda x: special.expit(x) * (1.0 - special.expit(x))}


def evaluate(chain: Chain, consts: dict[str, float], lo: np.ndarray, hi: np.ndarray
             ) -> tuple[Iv, Iv]:
    """Interval forward-mode differentiation of the chain over x in [lo, hi]: enclosures of
    f(x) and f'(x) for every x in the interval (entrywise)."""
    one, zero = np.ones_like(lo), np.zeros_like(lo)
    val: dict[str, Iv] = {chain.root: (lo, hi)}
    der: dict[str, Iv] = {chain.root: (one, one)}

    def arg(name: str) -> tuple[Iv, Iv]:
        if name in val:
            return val[name], der[name]
        c = consts[name] * one
        return (c, c), (zero, zero)

    for nd in chain.nodes:
        (a, da) = arg(nd.inputs[0])
        t = nd.op_type
        if t in ("Add", "Sub", "Mul", "Div"):
            b, db = arg(nd.inputs[1])
            if t == "Add":
                v, d = _add(a, b), _add(da, db)
            elif t == "Sub":
                v, d = _add(a, _neg(b)), _add(da, _neg(db))
            elif t == "Mul":
                v, d = _mul(a, b), _add(_mul(da, b), _mul(a, db))
            else:  # by a nonzero constant (checked by `find_chains`)
                inv = 1.0 / consts[nd.inputs[1]]
                v, d = _mul(a, (inv * one, inv * one)), _mul(da, (inv * one, inv * one))
        elif t == "Neg":
            v, d = _neg(a), _neg(da)
        elif t == "Pow":
            p = consts[nd.inputs[1]]
            if p == 2.0:
                v, d = _square(a), _mul(_mul(a, da), (2 * one, 2 * one))
            else:  # p == 3: increasing
                v = _out(a[0] ** 3, a[1] ** 3)
                d = _mul(_mul(_square(a), da), (3 * one, 3 * one))
        else:
            f = _F[t]
            v = _out(f(a[0]), f(a[1]))  # increasing
            d = _mul(_bell(_DF[t], a), da)
        val[nd.outputs[0]], der[nd.outputs[0]] = v, d
    return val[chain.sink], der[chain.sink]


def ranges(chain: Chain, consts: dict[str, float], lo: np.ndarray, hi: np.ndarray
           ) -> tuple[Iv, Iv]:
    """`evaluate` on SPLITS equal pieces of [lo, hi], hulled: (f range, f' range)."""
    t = np.linspace(0.0, 1.0, SPLITS + 1)
    w = hi - lo
    edges = lo[None] + t.reshape(-1, *([1] * lo.ndim)) * w[None]  # (S+1, *shape)
    edges[0], edges[-1] = lo, hi
    v, d = evaluate(chain, consts, edges[:-1], edges[1:])
    return (v[0].min(axis=0), v[1].max(axis=0)), (d[0].min(axis=0), d[1].max(axis=0))


def _scalar(env: dict, name: str) -> float | None:
    t = env.get(name)
    if t is None or t.numel() != 1 or not t.is_floating_point():
        return None
    return float(t.reshape(()))


def find_chains(nodes: list[Node], env: dict, variable: set[str], outputs: set[str]
                ) -> tuple[dict[str, Chain], set[str]]:
    """Chains by their sink's producing node name, and every node name inside a chain.
    `variable`: the input-dependent tensors; `env`: the centre values (constants)."""
    origin: dict[str, str] = {}  # tensor -> its root, for outputs of fusable nodes
    members: dict[str, list[Node]] = {}
    consumers: dict[str, list[str]] = {}
    for nd in nodes:
        for i in nd.inputs:
            if i:
                consumers.setdefault(i, []).append(nd.name)
        if nd.op_type not in FUSABLE or len(nd.outputs) != 1:
            continue
        roots, ok = set(), True
        for k, i in enumerate(nd.inputs):
            if not i:
                continue
            if i in variable:
                roots.add(origin.get(i, i))
            else:
                c = _scalar(env, i)
                ok = ok and c is not None and not (nd.op_type == "Div" and (k == 0 or c == 0))
                ok = ok and not (nd.op_type == "Pow" and (k != 1 or c not in (2.0, 3.0)))
        if nd.op_type == "Pow" and len(nd.inputs) > 1 and nd.inputs[1] in variable:
            ok = False
        if ok and len(roots) == 1:
            r = roots.pop()
            origin[nd.outputs[0]] = r
            members.setdefault(r, []).append(nd)
    chains: dict[str, Chain] = {}
    inside: set[str] = set()
    for r, group in members.items():
        outs = {nd.outputs[0] for nd in group}
        names = {nd.name for nd in group}
        sinks = [o for o in outs if o in outputs
                 or any(c not in names for c in consumers.get(o, []))]
        nonlinear = any(nd.op_type in _NONLINEAR or (
            nd.op_type == "Mul" and all(i in variable for i in nd.inputs)) for nd in group)
        if len(sinks) != 1 or len(group) < 2 or not nonlinear \
                or group[-1].outputs[0] != sinks[0]:
            continue
        last = group[-1]
        chains[last.name] = Chain(r, sinks[0], group)
        inside |= names
    return chains, inside
