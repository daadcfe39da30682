"""Margin gradients over a ball from the model's adjoint graph (docs/local-graphs.md,
"Margin gradients by the adjoint graph").

For a fixed weight vector c on the output (c = e_Y - e_j: the margin f_Y - f_j), the gradient
`g(X) = J_F(X)^T c` is what reverse-mode differentiation computes. The adjoint graph is the
model's input-dependent nodes followed, in reverse order, by the nodes computing each one's
adjoint from its output's (each op's transposed chain rule, written with ops the affine forms
have rules for; a LayerNorm's n and r recomputed as their own ops, `tangent.ln_chain`). The
seed c is a form with no change (its rounding is then carried by every adjoint op like any
other value). The affine forms bound g over the ball relationally: each entry g_p as
`g0_p + a_p d + r_p e` with the input's change d and the symbols e shared by all entries, where
the Jacobian enclosure (drivers/jacobian.py) keeps entrywise boxes. Then

    inf-ball: ||g||_1 = sum_p |g_p| <= sum_p (lam_p g_p + mu_p)   (|y| <= lam y + mu on g_p's
              range: the sign where it is fixed, else the chord), one affine form summed:
              the change terms cancel across entries;
    2-ball:   ||g||_2 <= ||c + o|| + ||m|| + eps sigma_max(a_in) + ||a_sym||_{box->2} + ||b||.

Used for the radius sweep's margin constants (routes/certify.py `_constants_at`: the smaller one
stands).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from lsa_models.engine import elementwise_chains
from lsa_models.engine.affine.form import Aff
from lsa_models.engine.affine.walk import walk
from lsa_models.engine.derivative_ops import GUARDS
from lsa_models.engine.derived.dual_norms import l1_sup, l2_sup
from lsa_models.engine.derived.tangent import (
    LayerNormHook,
    NoTangent,
    _Builder,
    ln_chain,
    run_nodes,
    smooth,
)
from lsa_models.engine.rounding.forward_error import Proven
from lsa_models.engine.values import Ball
from lsa_models.onnx.loading import OnnxModel
from lsa_models.onnx.ops import Node
from lsa_models.operators import make
from lsa_models.operators.normalization import LayerNormalization

SEED = "__adjoint_seed"


class NoAdjoint(NoTangent):
    """An op without an adjoint rule (the model keeps the other bounds)."""


def _reduce_to(b: _Builder, t: str, shape: tuple[int, ...]) -> str:
    """The adjoint of a broadcast: t summed over the axes `shape` was broadcast along."""
    ts = b.shape(t)
    if ts == shape:
        return t
    lead = len(ts) - len(shape)
    if lead < 0:
        raise NoAdjoint("a broadcast to fewer axes")
    axes = list(range(lead)) + [lead + i for i, n in enumerate(shape)
                                if n == 1 and ts[lead + i] != 1]
    out = b.op("ReduceSum", [t, b.ints(axes)], {"keepdims": 1}) if axes else t
    return b.op("Reshape", [out, b.ints(list(shape), "shape")])


def _axes(b: _Builder, node: Node, rank: int) -> list[int]:
    if len(node.inputs) > 1 and node.inputs[1]:
        axes = [int(v) for v in b.env[node.inputs[1]].reshape(-1).tolist()]
    else:
        axes = [int(v) for v in node.attrs.get("axes", [])]
    if not axes:
        if int(node.attrs.get("noop_with_empty_axes", 0)):
            return []
        axes = list(range(rank))
    return sorted(a % rank for a in axes)


def _transposed(b: _Builder, name: str) -> str:
    rank = len(b.shape(name))
    perm = list(range(rank - 2)) + [rank - 1, rank - 2]
    return b.op("Transpose", [name], {"perm": perm})


# One rule per op family: (builder, node, the input-dependent inputs' positions, the output's
# adjoint gy, the LayerNorms' recomputed (n, r)) -> the adjoints of those inputs by position.
LN = dict[str, tuple[str, str]]
Rule = Callable[[_Builder, Node, list[int], str, LN], dict[int, str]]


def _shape_only(b: _Builder, node: Node, dep: list[int], gy: str, ln: LN) -> dict[int, str]:
    if dep != [0]:
        raise NoAdjoint(f"{node.op_type} of an input-dependent shape")
    if node.op_type == "Cast" and not b.env[node.outputs[0]].is_floating_point():
        raise NoAdjoint(f"Cast node {node.name} to a non-float type")
    return {0: b.op("Reshape", [gy, b.ints(list(b.shape(node.inputs[0])), "shape")])}


def _transpose(b: _Builder, node: Node, dep: list[int], gy: str, ln: LN) -> dict[int, str]:
    rank = len(b.shape(node.inputs[0]))
    perm = [int(p) for p in node.attrs.get("perm", list(range(rank))[::-1])]
    return {0: b.op("Transpose", [gy], {"perm": [perm.index(i) for i in range(rank)]})}


def _expand(b: _Builder, node: Node, dep: list[int], gy: str, ln: LN) -> dict[int, str]:
    if dep != [0]:
        raise NoAdjoint("Expand to an input-dependent shape")
    return {0: _reduce_to(b, gy, b.shape(node.inputs[0]))}


def _concat(b: _Builder, node: Node, dep: list[int], gy: str, ln: LN) -> dict[int, str]:
    """Each input's part of gy along the axis."""
    ax = int(node.attrs.get("axis", 0)) % len(b.shape(node.outputs[0]))
    out, off = {}, 0
    for i, name in enumerate(node.inputs):
        n = b.shape(name)[ax]
        if i in dep:
            out[i] = b.op("Slice", [gy, b.ints([off]), b.ints([off + n]), b.ints([ax])])
        off += n
    return out


def _embed(b: _Builder, g: str, shape: tuple[int, ...], ax: int, lo: int) -> str:
    """g (shape but n along ax) placed at [lo, lo + n) of zeros of `shape` (the adjoint of
    taking those entries): a Concat with zero blocks."""
    def zeros(width: int) -> str:
        zs = list(shape)
        zs[ax] = width
        return b.const(np.zeros(zs), "zeros")
    hi = shape[ax] - lo - b.shape(g)[ax]
    parts = ([zeros(lo)] if lo > 0 else []) + [g] + ([zeros(hi)] if hi > 0 else [])
    return g if len(parts) == 1 else b.op("Concat", parts, {"axis": ax})


def _slice(b: _Builder, node: Node, dep: list[int], gy: str, ln: LN) -> dict[int, str]:
    """Slice with constant starts/ends/axes and unit steps: gy placed back among zeros."""
    if dep != [0]:
        raise NoAdjoint("Slice with input-dependent bounds")
    shape = b.shape(node.inputs[0])

    def ints(i: int) -> list[int] | None:
        if len(node.inputs) > i and node.inputs[i]:
            return [int(v) for v in b.env[node.inputs[i]].reshape(-1).tolist()]
        return None
    starts, ends = ints(1), ints(2)
    if starts is None or ends is None:
        raise NoAdjoint("Slice without constant starts and ends")
    axes = ints(3) or list(range(len(starts)))
    steps = ints(4) or [1] * len(starts)
    if any(st != 1 for st in steps):
        raise NoAdjoint("Slice with a step other than 1")
    g, cur = gy, list(b.shape(gy))
    for st, en, a in zip(starts, ends, axes, strict=False):
        ax = a % len(shape)
        idx = range(shape[ax])[st:en]
        full = list(cur)
        full[ax] = shape[ax]
        g = _embed(b, g, tuple(full), ax, idx.start if len(idx) else 0)
        cur = full
    return {0: g}


def _gather(b: _Builder, node: Node, dep: list[int], gy: str, ln: LN) -> dict[int, str]:
    """Gather of one constant index (a CLS token): gy placed back at that index."""
    if dep != [0]:
        raise NoAdjoint("Gather of input-dependent indices")
    idx = b.env[node.inputs[1]]
    if idx.numel() != 1 or idx.dim() != 0:
        raise NoAdjoint("Gather of more than one scalar index")
    shape = b.shape(node.inputs[0])
    ax = int(node.attrs.get("axis", 0)) % len(shape)
    g = b.op("Unsqueeze", [gy, b.ints([ax])])
    return {0: _embed(b, g, shape, ax, int(idx) % shape[ax])}


def _add_sub(b: _Builder, node: Node, dep: list[int], gy: str, ln: LN) -> dict[int, str]:
    neg = node.op_type == "Sub"
    return {i: _reduce_to(b, b.op("Neg", [gy]) if neg and i == 1 else gy,
                          b.shape(node.inputs[i])) for i in dep}


def _neg(b: _Builder, node: Node, dep: list[int], gy: str, ln: LN) -> dict[int, str]:
    return {0: b.op("Neg", [gy])}


def _mul(b: _Builder, node: Node, dep: list[int], gy: str, ln: LN) -> dict[int, str]:
    ins = node.inputs
    return {i: _reduce_to(b, b.op("Mul", [gy, ins[1 - i]]), b.shape(ins[i])) for i in dep}


def _matmul(b: _Builder, node: Node, dep: list[int], gy: str, ln: LN) -> dict[int, str]:
    """dA = dY B^T, dB = A^T dY (each summed over the batch axes it was broadcast along)."""
    a, c = node.inputs[:2]
    if len(b.shape(a)) < 2 or len(b.shape(c)) < 2:
        raise NoAdjoint("MatMul of a vector")
    out = {}
    if 0 in dep:
        out[0] = _reduce_to(b, b.op("MatMul", [gy, _transposed(b, c)]), b.shape(a))
    if 1 in dep:
        out[1] = _reduce_to(b, b.op("MatMul", [_transposed(b, a), gy]), b.shape(c))
    return out


def _div(b: _Builder, node: Node, dep: list[int], gy: str, ln: LN) -> dict[int, str]:
    """d(a / b) = da / b - y db / b (the division by a tensor as a product with 1 / b)."""
    a, c = node.inputs[:2]
    out = {}
    rb = b.op("Reciprocal", [c]) if 1 in dep else c
    if 0 in dep:
        g = b.op("Mul", [gy, rb]) if 1 in dep else b.op("Div", [gy, c])
        out[0] = _reduce_to(b, g, b.shape(a))
    if 1 in dep:
        g = b.op("Neg", [b.op("Mul", [b.op("Mul", [gy, node.outputs[0]]), rb])])
        out[1] = _reduce_to(b, g, b.shape(c))
    return out


def _gemm(b: _Builder, node: Node, dep: list[int], gy: str, ln: LN) -> dict[int, str]:
    if dep != [0]:
        raise NoAdjoint("Gemm of an input-dependent weight")
    w = b.env[node.inputs[1]].detach().double().numpy()
    w = w.T if int(node.attrs.get("transB", 0)) else w  # B' (K x N)
    alpha = float(node.attrs.get("alpha", 1.0))
    g = b.op("MatMul", [gy, b.const(np.ascontiguousarray(w.T), "gemm_bt")])
    if alpha != 1.0:
        g = b.op("Mul", [g, b.const(alpha, "alpha")])
    if int(node.attrs.get("transA", 0)):
        g = b.op("Transpose", [g], {"perm": [1, 0]})
    return {0: g}


def _reduce(b: _Builder, node: Node, dep: list[int], gy: str, ln: LN) -> dict[int, str]:
    if dep != [0]:
        raise NoAdjoint(f"{node.op_type} with input-dependent axes")
    shape = b.shape(node.inputs[0])
    axes = _axes(b, node, len(shape))
    kept = [1 if i in axes else n for i, n in enumerate(shape)]
    g = b.op("Expand", [b.op("Reshape", [gy, b.ints(kept, "shape")]),
                        b.ints(list(shape), "shape")])
    if node.op_type == "ReduceMean":
        n = int(np.prod([shape[a] for a in axes])) if axes else 1
        g = b.op("Mul", [g, b.const(1.0 / n, "inv_n")])
    return {0: g}


def _where(b: _Builder, node: Node, dep: list[int], gy: str, ln: LN) -> dict[int, str]:
    """Where(cond, x, y) for a constant condition (attention masks): gy where the branch was
    taken, 0 elsewhere, summed back to the branch's shape."""
    cond = node.inputs[0]
    if 0 in dep and cond not in b.guards:
        raise NoAdjoint("Where with an input-dependent condition")
    zero = b.const(0.0, "zero")
    return {i: _reduce_to(b, b.op("Where", [cond, gy, zero] if i == 1 else [cond, zero, gy]),
                          b.shape(node.inputs[i])) for i in dep if i != 0}


def _layernorm(b: _Builder, node: Node, dep: list[int], gy: str, ln: LN) -> dict[int, str]:
    """J^T g = r (g - mean g - n mean(n g)) for J = r (I - n n^T / D)(I - 1 1^T / D) (the
    tangent rule's matrix; mean n = 0), g = gy gamma (operators/normalization.py)."""
    if dep != [0]:
        raise NoAdjoint("LayerNorm with input-dependent weights")
    n, r = ln[node.name]
    ins = node.inputs
    scale = ins[1] if len(ins) > 1 and ins[1] else None
    return {0: LayerNormalization(node.op_type, node.attrs).adjoint_graph(b, gy, n, r, scale)}


RULES: dict[str, Rule] = {
    **dict.fromkeys(("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout",
                     "Cast"), _shape_only),
    "Transpose": _transpose, "Expand": _expand, "Concat": _concat, "Slice": _slice,
    "Gather": _gather, "Add": _add_sub,
    "Sub": _add_sub, "Neg": _neg, "Mul": _mul, "MatMul": _matmul, "Div": _div, "Gemm": _gemm,
    "ReduceMean": _reduce, "ReduceSum": _reduce, "LayerNormalization": _layernorm,
    "Where": _where,
}


def _adjoints(b: _Builder, node: Node, dep: list[int], gy: str, ln: LN) -> dict[int, str]:
    """The adjoints of the node's input-dependent inputs (by position) from its output's gy
    (an op without a rule here: the registry's, `tangent.smooth`: f' is diagonal, or
    symmetric for Softmax)."""
    rule = RULES.get(node.op_type)
    if rule is None:
        return {0: smooth(b, node, dep, gy, False)}
    return rule(b, node, dep, gy, ln)


Sym = str | float  # a tensor's name, or a scalar known at build time


class _Diff:
    """Forward-mode differentiation of a chain's links with respect to its root, scalars
    folded (d(x * 0.5) = 0.5, not a tensor of 0.5s), so the derivative stays a fusable chain."""

    def __init__(self, b: _Builder) -> None:
        self.b = b

    def mul(self, p: Sym, q: Sym) -> Sym:
        if isinstance(p, float) and isinstance(q, float):
            return p * q
        if isinstance(p, str) and isinstance(q, str):
            return self.b.op("Mul", [p, q])
        k, t = (p, q) if isinstance(p, float) else (q, p)
        assert isinstance(k, float) and isinstance(t, str)
        if k == 0.0:
            return 0.0
        return t if k == 1.0 else self.b.op("Mul", [t, self.b.const(k)])

    def add(self, p: Sym, q: Sym, sub: bool = False) -> Sym:
        if isinstance(p, float) and isinstance(q, float):
            return p - q if sub else p + q
        if isinstance(q, float) and q == 0.0:
            return p
        if isinstance(p, float) and p == 0.0:
            assert isinstance(q, str)
            return self.b.op("Neg", [q]) if sub else q
        pn = self.b.const(p) if isinstance(p, float) else p
        qn = self.b.const(q) if isinstance(q, float) else q
        return self.b.op("Sub" if sub else "Add", [pn, qn])

    def link(self, t: str, ins: list[tuple[Sym, Sym]], v: str) -> Sym | None:
        """d(link) from its inputs' (value, derivative) and its output v; None: no rule."""
        (a, da), rest = ins[0], ins[1:]
        if t in ("Add", "Sub"):
            return self.add(da, rest[0][1], t == "Sub")
        if t == "Mul":
            return self.add(self.mul(da, rest[0][0]), self.mul(a, rest[0][1]))
        if t == "Div":  # by a constant (elementwise_chains.find_chains)
            return self.mul(da, 1.0 / float(rest[0][0]))
        if t == "Neg":
            return self.mul(da, -1.0)
        # a fusable activation, f' from its output where it can; or Pow by 2 or 3
        # (elementwise_chains.find_chains)
        op = make(t, {"exponent": float(rest[0][0])} if t == "Pow" else None)
        d = None if op is None else op.chain_derivative(self, a, v)
        return None if d is None else self.mul(d, da)


def _chain_derivative(b: _Builder, chain: elementwise_chains.Chain) -> str | None:
    """f'(x) of a fused elementwise chain y = f(x) as a new chain of fusable ops from a copy
    of x (an Identity: `elementwise_chains.find_chains` groups by root), so the walk bounds it
    as one elementwise function; None where a link's derivative is not fusable (Erf: exp)."""
    diff = _Diff(b)
    root = b.op("Identity", [chain.root], hint="droot")
    val: dict[str, str] = {chain.root: root}
    der: dict[str, Sym] = {chain.root: 1.0}

    def arg(name: str) -> tuple[Sym, Sym]:
        if name in val:
            return val[name], der[name]
        return float(b.env[name].reshape(())), 0.0

    for nd in chain.nodes:
        v = b.op(nd.op_type, [val.get(i, i) for i in nd.inputs], nd.attrs, "dcopy")
        d = diff.link(nd.op_type, [arg(i) for i in nd.inputs if i], v)
        if d is None:
            return None
        val[nd.outputs[0]], der[nd.outputs[0]] = v, d
    out = der[chain.sink]
    return None if isinstance(out, float) else out


def _forward_nodes(nodes: list[Node], inp: str, out: str) -> list[Node]:
    """The input-dependent nodes, in graph order."""
    dynamic = {inp}
    forward: list[Node] = []
    for node in nodes:
        # a shape is constant over the ball: what reads only shapes is too
        if node.op_type in ("Shape", "Size") or not any(n and n in dynamic for n in node.inputs):
            continue
        if len([o for o in node.outputs if o]) != 1 and node.op_type != "Split":
            raise NoAdjoint(f"{node.op_type} node {node.name}: several outputs")
        forward.append(node)
        dynamic.update(o for o in node.outputs if o)
    if out not in dynamic:
        raise NoAdjoint("the output does not depend on the input")
    return forward


def _split(b: _Builder, node: Node, grads: dict[str, list[str]],
           total: Callable[[list[str]], str]) -> None:
    """Split's adjoint: its outputs' adjoints (zeros where an output has none) concatenated
    along the axis."""
    outs = [o for o in node.outputs if o]
    if not any(grads.get(o) for o in outs):
        return
    ax = int(node.attrs.get("axis", 0)) % len(b.shape(node.inputs[0]))
    parts = [total(grads.pop(o)) if grads.get(o) else b.const(np.zeros(b.shape(o)), "zeros")
             for o in outs]
    g = parts[0] if len(parts) == 1 else b.op("Concat", parts, {"axis": ax})
    grads.setdefault(node.inputs[0], []).append(g)


def _reverse(b: _Builder, forward: list[Node], inp: str, out: str, ln: LN) -> str:
    """The adjoint nodes from SEED at the output back to the input; the input's adjoint."""
    dynamic = {inp} | {o for nd in forward for o in nd.outputs if o}

    def total(parts: list[str]) -> str:  # a tensor read by several nodes: its adjoints' sum
        g = parts[0]
        for p in parts[1:]:
            g = b.op("Add", [g, p], hint="acc")
        return g
    # the forward graph's elementwise chains (GELU written out): one adjoint each,
    # g_x = g_y f'(x), its f' a chain of its own (`_chain_derivative`)
    fchains, _ = elementwise_chains.find_chains(forward, b.env, dynamic, {out})
    sinks = {c.sink: c for c in fchains.values()}
    grads: dict[str, list[str]] = {out: [SEED]}
    fused_done: set[str] = set()  # a chain's inner tensors: adjoint through its sink only
    for node in reversed(forward):
        if node.op_type == "Split":
            _split(b, node, grads, total)
            continue
        y = node.outputs[0]
        parts = grads.pop(y, None)
        if y in fused_done or not parts:
            continue
        gy = total(parts)
        chain = sinks.get(y)
        dchain = None if chain is None else _chain_derivative(b, chain)
        if chain is not None and dchain is not None:
            grads.setdefault(chain.root, []).append(b.op("Mul", [gy, dchain], hint="dch"))
            fused_done.update(nd.outputs[0] for nd in chain.nodes)
            continue
        dep = [i for i, n in enumerate(node.inputs) if n and n in dynamic]
        for i, g in _adjoints(b, node, dep, gy, ln).items():
            grads.setdefault(node.inputs[i], []).append(g)
    if not grads.get(inp):
        raise NoAdjoint("no adjoint reaches the input")
    return total(grads[inp])


class AdjointGraph:
    """The model's input-dependent nodes, then the adjoints of a weight vector c on the output
    back to the input (`grad`): one graph per c."""

    def __init__(self, model: OnnxModel, x: np.ndarray, weights: np.ndarray) -> None:
        self.model, self.x = model, x
        module = model.module.with_dtype(torch.float64)
        with torch.no_grad():
            env = module.run_env(torch.from_numpy(x))
        inp, out = model.spec.input_name, model.spec.output_name
        b = _Builder(env)
        forward = _forward_nodes(module.runtime_nodes, inp, out)  # type: ignore[arg-type]
        ln: dict[str, tuple[str, str]] = {}
        for node in forward:
            b.nodes.append(node)
            if node.op_type in GUARDS:  # (tangent._Builder.guards)
                b.guards.add(node.outputs[0])
            if node.op_type == "LayerNormalization":
                ln[node.name] = ln_chain(b, node)
        c = np.asarray(weights, dtype=np.float64).reshape(tuple(env[out].shape))
        env[SEED] = torch.from_numpy(c.copy())
        self.seed_value = c
        gx = _reverse(b, forward, inp, out, ln)
        self.output = gx
        self.nodes, self.env, self.known_ranges = b.nodes, env, b.known
        # every elementwise chain of the whole graph (the forward's and the derivatives'),
        # walked as one function each
        variable = {inp, SEED} | {o for nd in b.nodes for o in nd.outputs if o}
        self.chains, self.inside = elementwise_chains.find_chains(b.nodes, env, variable, {gx})
        # the nodes the seed does not reach (the forward graph, its LayerNorm chains and the
        # chains' derivatives: the same for every c, `primal_forms`) and the rest
        seeded = {SEED}
        self.adjoint_nodes: list[Node] = []
        self.primal_nodes: list[Node] = []
        for nd in b.nodes:
            if any(i in seeded for i in nd.inputs if i):
                seeded.update(o for o in nd.outputs if o)
                self.adjoint_nodes.append(nd)
            else:
                self.primal_nodes.append(nd)
        # the forward tensors the adjoint nodes read: all must have forms (a forward walk that
        # stopped, e.g. at an overflow, leaves them out, and a missing form would be read as
        # the constant centre value)
        made = {inp}  # the input-dependent ones (a Transpose of a weight is a constant)
        for nd in self.primal_nodes:
            if any(i in made for i in nd.inputs if i):
                made.update(o for o in nd.outputs if o)
        self.primal_needed = {i for nd in self.adjoint_nodes for i in nd.inputs
                              if i and i in made}
        self.variance, self.centred = b.variance, b.centred
        self.margin = Proven(self.nodes, inp, x, env)

    def vjp(self, x: np.ndarray) -> np.ndarray:
        """J_F(x)^T c through the adjoint graph in float64 (for tests: it must agree with
        autodiff)."""
        env = run_nodes(self.nodes, self.env, {self.model.spec.input_name: x})
        return env[self.output].detach().numpy()

    def primal_forms(self, eps: float, norm: str) -> tuple[dict[str, Aff], int]:
        """The forms of the nodes the seed does not reach, and the symbols they use: the same
        for every graph of one model and centre (`grad_form`'s `primal`)."""
        ball = Ball(self.x, float(eps), norm)
        known = dict(self.known_ranges)
        hook = LayerNormHook(self.variance, self.centred, self.env, known, ball)
        space: list[int] = []
        with self.margin:
            forms = walk(self.primal_nodes, self.model.spec.input_name, self.env, ball,
                         self.chains, self.inside, everything=True, known=known, hook=hook,
                         space=space)
        return forms, space[1] if len(space) > 1 else 0

    def grad_form(self, eps: float, norm: str,
                  primal: tuple[dict[str, Aff], int] | None = None) -> Aff | None:
        """The input adjoint's affine form over the ball (None where the walk stops);
        `primal`: `primal_forms` of this ball (from any graph of the same model and centre)."""
        ball = Ball(self.x, float(eps), norm)
        forms, used = self.primal_forms(eps, norm) if primal is None else primal
        if any(n not in forms for n in self.primal_needed):
            return None  # the forward walk stopped: no bound (never a constant in its place)
        z = np.zeros(self.seed_value.shape)
        seed = Aff(self.seed_value.copy(), z.copy(), z.copy(),
                   np.zeros((*self.seed_value.shape, ball.size)), z.copy())
        seeds = {k: v for k, v in forms.items() if k != self.model.spec.input_name}
        seeds[SEED] = seed
        with self.margin:
            out = walk(self.adjoint_nodes, self.model.spec.input_name, self.env, ball,
                       self.chains, self.inside, self.output, everything=False, seeds=seeds,
                       symbols=used)
        return out.get(self.output)

    def dual_norm_bound(self, eps: float, norm: str,
                        primal: tuple[dict[str, Aff], int] | None = None) -> float | None:
        """An upper bound on sup ||J_F(X)^T c||_dual over the ball (ell_1 on the inf-ball,
        ell_2 on the 2-ball); None where the walk stops or overflows."""
        f = self.grad_form(eps, norm, primal)
        if f is None:
            return None
        ball = Ball(self.x, float(eps), norm)
        with np.errstate(over="ignore", invalid="ignore"):
            v = l1_sup(f, ball) if norm == "inf" else l2_sup(f, ball)
        return v if math.isfinite(v) else None

