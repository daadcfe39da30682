"""Elementwise chains as one function: y = f(x) entrywise, f built from one root tensor x by
Add/Sub/Mul/Div/Neg/Pow and the smooth activations (Tanh, Erf, Sigmoid, Softplus: the
registry's FUSABLE_ACTIVATIONS, lsa_models/operators/) with scalar constants (the tanh form
of GELU as torch exports it: 0.5 x (1 + tanh(c (x + a x^3))) is six such nodes). Bounding
the chain link by link sums the absolute value of every link's remainder; as one function its
remainder is |G| sup|f'(x) - f'(x0)| |J_x|, with the range of f' over the input's interval
from interval automatic differentiation (docs/local-enclosure.md, "Fused elementwise chains").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lsa_models.engine.values import FLOOR
from lsa_models.onnx.ops import Node
from lsa_models.operators import FUSABLE_ACTIVATIONS, activation
from lsa_models.operators.activation import Activation
from lsa_models.operators.arithmetic import CHAIN_EXPONENTS, Pow

FUSABLE = ("Add", "Sub", "Mul", "Div", "Neg", "Pow") + FUSABLE_ACTIVATIONS
_NONLINEAR = FUSABLE_ACTIVATIONS + ("Pow",)
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
    pad = _REL * np.maximum(np.abs(lo), np.abs(hi)) + FLOOR
    return lo - pad, hi + pad


def iv_mul(a: Iv, b: Iv) -> Iv:
    """The product of two intervals, padded outward for its rounding."""
    # pairwise minima and maxima, not a stacked array's reductions: these arrays are small
    # and the chains call this ~30000 times per MLP radius job (half its cost was the stack)
    p, q, r, s = a[0] * b[0], a[0] * b[1], a[1] * b[0], a[1] * b[1]
    return _out(np.minimum(np.minimum(p, q), np.minimum(r, s)),
                np.maximum(np.maximum(p, q), np.maximum(r, s)))


def _add(a: Iv, b: Iv) -> Iv:
    return _out(a[0] + b[0], a[1] + b[1])


def _neg(a: Iv) -> Iv:
    return -a[1], -a[0]


def _near_far(a: Iv) -> tuple[np.ndarray, np.ndarray]:
    near = np.where((a[0] <= 0) & (a[1] >= 0), 0.0, np.minimum(np.abs(a[0]), np.abs(a[1])))
    return near, np.maximum(np.abs(a[0]), np.abs(a[1]))


def _square(a: Iv) -> Iv:
    near, far = _near_far(a)
    return _out(near * near, far * far)


@dataclass
class _Intervals:
    """The arithmetic above for an op's chain rule (operators.base.IntervalOps), its
    constants shaped like `one`."""

    one: np.ndarray

    def mul(self, a: Iv, b: Iv) -> Iv:
        return iv_mul(a, b)

    def add(self, a: Iv, b: Iv) -> Iv:
        return _add(a, b)

    def square(self, a: Iv) -> Iv:
        return _square(a)

    def out(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        return _out(lo, hi)

    def k(self, x: float) -> Iv:
        return x * self.one, x * self.one


def _pow(nd: Node, consts: dict[str, float]) -> Pow:
    return Pow("Pow", {"exponent": consts[nd.inputs[1]]})


def _activation(nd: Node) -> Activation:
    op = activation(nd.op_type, nd.attrs)
    assert op is not None and op.fusable
    return op


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
                v, d = iv_mul(a, b), _add(iv_mul(da, b), iv_mul(a, db))
            else:  # by a nonzero constant (checked by `find_chains`)
                inv = 1.0 / consts[nd.inputs[1]]
                v, d = iv_mul(a, (inv * one, inv * one)), iv_mul(da, (inv * one, inv * one))
        elif t == "Neg":
            v, d = _neg(a), _neg(da)
        elif t == "Pow":  # by 2 or 3 (`find_chains`)
            v, d, _ = _pow(nd, consts).chain_rule(_Intervals(one), a, da)
        else:  # a smooth activation: increasing
            op = _activation(nd)
            v = _out(*op.value_range(a[0], a[1]))
            d = iv_mul(_out(*op.d1_range(a[0], a[1])), da)
        val[nd.outputs[0]], der[nd.outputs[0]] = v, d
    return val[chain.sink], der[chain.sink]


def second(chain: Chain, consts: dict[str, float], lo: np.ndarray, hi: np.ndarray
           ) -> Iv | None:
    """Interval forward-mode differentiation to second order over x in [lo, hi] (SPLITS
    pieces, hulled): an enclosure of f''(x) for every x in the interval. Rules: (a b)'' =
    a'' b + 2 a' b' + a b'', (a^2)'' = 2 (a'^2 + a a''), (a^3)'' = 3 (2 a a'^2 + a^2 a''),
    g(u)'' = g''(u) u'^2 + g'(u) u'' for g a smooth activation (its `d2_range`)."""
    t = np.linspace(0.0, 1.0, SPLITS + 1)
    w = hi - lo
    edges = lo[None] + t.reshape(-1, *([1] * lo.ndim)) * w[None]
    edges[0], edges[-1] = lo, hi
    lo_, hi_ = edges[:-1], edges[1:]
    one, zero = np.ones_like(lo_), np.zeros_like(lo_)
    val: dict[str, Iv] = {chain.root: (lo_, hi_)}
    d1: dict[str, Iv] = {chain.root: (one, one)}
    d2: dict[str, Iv] = {chain.root: (zero, zero)}

    def arg(name: str) -> tuple[Iv, Iv, Iv]:
        if name in val:
            return val[name], d1[name], d2[name]
        c = consts[name] * one
        return (c, c), (zero, zero), (zero, zero)

    def k(x: float) -> Iv:
        return x * one, x * one

    for nd in chain.nodes:
        a, da, dda = arg(nd.inputs[0])
        op = nd.op_type
        if op in ("Add", "Sub"):
            b, db, ddb = arg(nd.inputs[1])
            if op == "Sub":
                b, db, ddb = _neg(b), _neg(db), _neg(ddb)
            v, d, dd = _add(a, b), _add(da, db), _add(dda, ddb)
        elif op == "Mul":
            b, db, ddb = arg(nd.inputs[1])
            v, d = iv_mul(a, b), _add(iv_mul(da, b), iv_mul(a, db))
            dd = _add(_add(iv_mul(dda, b), iv_mul(k(2.0), iv_mul(da, db))), iv_mul(a, ddb))
        elif op == "Div":
            inv = k(1.0 / consts[nd.inputs[1]])
            v, d, dd = iv_mul(a, inv), iv_mul(da, inv), iv_mul(dda, inv)
        elif op == "Neg":
            v, d, dd = _neg(a), _neg(da), _neg(dda)
        elif op == "Pow":  # by 2 or 3 (`find_chains`)
            v, d, ddp = _pow(nd, consts).chain_rule(_Intervals(one), a, da, dda)
            assert ddp is not None
            dd = ddp
        else:  # a smooth activation: increasing, f'' enclosed
            f = _activation(nd)
            v = _out(*f.value_range(a[0], a[1]))
            g1 = _out(*f.d1_range(a[0], a[1]))
            d = iv_mul(g1, da)
            curv = f.d2_range(a[0], a[1])
            assert curv is not None
            dd = _add(iv_mul(_out(*curv), _square(da)), iv_mul(g1, dda))
        val[nd.outputs[0]], d1[nd.outputs[0]], d2[nd.outputs[0]] = v, d, dd
    r = d2[chain.sink]
    return r[0].min(axis=0), r[1].max(axis=0)


def ranges(chain: Chain, consts: dict[str, float], lo: np.ndarray, hi: np.ndarray
           ) -> tuple[Iv, Iv]:
    """`evaluate` on SPLITS equal pieces of [lo, hi], hulled: (f range, f' range)."""
    t = np.linspace(0.0, 1.0, SPLITS + 1)
    w = hi - lo
    edges = lo[None] + t.reshape(-1, *([1] * lo.ndim)) * w[None]  # (S+1, *shape)
    edges[0], edges[-1] = lo, hi
    v, d = evaluate(chain, consts, edges[:-1], edges[1:])
    return (v[0].min(axis=0), v[1].max(axis=0)), (d[0].min(axis=0), d[1].max(axis=0))


def scalar(env: dict, name: str) -> float | None:
    """The value of a one-entry floating-point constant in env, else None."""
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
                c = scalar(env, i)
                ok = ok and c is not None and not (nd.op_type == "Div" and (k == 0 or c == 0))
                ok = ok and not (nd.op_type == "Pow" and (k != 1 or c not in CHAIN_EXPONENTS))
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
