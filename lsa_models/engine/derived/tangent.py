"""The Lipschitz constant on an inf-ball from the model's tangent graph (docs/local-graphs.md,
"The inf-ball by the tangent graph").

On the ball B = {X : ||X - X0||_inf <= eps},

    sup_{X in B} ||J_F(X)||_inf = max_i sup_{X in B, s in [-1, 1]^P} (J_F(X) s)_i,

and `J_F(X) s` is what forward-mode differentiation computes: the tangent graph. For every
input-dependent tensor T of the graph it adds a tangent tensor `dT = J_T(X) s` by the chain
rule of T's op, written with ops the affine forms (affine/form.py) have rules for (an elementwise
f's derivative from its own output where it can: tanh' = 1 - y^2, exp' = y, ...). The affine
forms then bound the tangent of the output over X in the ball and s in the box, with s the
first P noise symbols (e in [-1, 1]): relational in X and s together, where the Jacobian
enclosure (drivers/jacobian.py) keeps entrywise boxes whose products compound on deep graphs.

The graph is built once per model (`TangentGraph`); `bound(eps)` walks it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from lsa_models.bounds.numerics import U
from lsa_models.engine.affine import form as affine
from lsa_models.engine.affine.form import PAIRS, Aff
from lsa_models.engine.affine.walk import variance, walk
from lsa_models.engine.derivative_ops import GUARDS, RELU_GRAD, run_op
from lsa_models.engine.heads.final_layernorm import find_tail, tail_matrix
from lsa_models.engine.rounding.forward_error import Proven
from lsa_models.engine.values import Ball, widen_up
from lsa_models.onnx.loading import OnnxModel
from lsa_models.onnx.ops import Node, RunContext
from lsa_models.operators import OPERATORS, ModeNotImplemented, make
from lsa_models.operators.normalization import LayerNormalization

CTX = RunContext(torch.float64)


class NoTangent(Exception):
    """An op without a tangent rule (the model keeps the other bounds)."""


@dataclass
class _Builder:
    env: dict[str, torch.Tensor]  # centre values (float64) of everything seen so far
    nodes: list[Node] = field(default_factory=list)
    tan: dict[str, str] = field(default_factory=dict)  # tensor -> its tangent's name
    consts: dict[str, torch.Tensor] = field(default_factory=dict)
    k: int = 0
    # ranges some tensors are known to lie in over any ball (`affine.walk.walk`'s `known`)
    known: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    # a LayerNorm's mean node -> (its input x, its variance v = mean (x - mean x)^2 + eps, eps)
    variance: dict[str, tuple[str, str, float]] = field(default_factory=dict)
    centred: dict[str, str] = field(default_factory=dict)  # v -> u = x - mean x
    # a LayerNorm node -> its chain's tensors n, r, du, w = mean(n du) and dn (`_layernorm`)
    ln_parts: dict[str, dict[str, str]] = field(default_factory=dict)
    # outputs of IsNaN / IsInf of the model (SDPA's NaN guard): boolean, no tangent; the affine
    # walk proves them constant (False) where their input's forms are finite
    guards: set[str] = field(default_factory=set)

    def name(self, hint: str) -> str:
        self.k += 1
        return f"__tan{self.k}_{hint}"

    def const(self, value: np.ndarray | float, hint: str = "c") -> str:
        n = self.name(hint)
        t = torch.as_tensor(np.asarray(value, dtype=np.float64))
        self.consts[n] = t
        self.env[n] = t
        return n

    def ints(self, value: list[int], hint: str = "axes") -> str:
        n = self.name(hint)
        t = torch.tensor(value, dtype=torch.int64)
        self.consts[n] = t
        self.env[n] = t
        return n

    def op(self, op_type: str, inputs: list[str], attrs: dict | None = None,
           hint: str = "") -> str:
        out = self.name(hint or op_type.lower())
        node = Node(out, op_type, list(inputs), [out], dict(attrs or {}))
        self.nodes.append(node)
        res = run_op(node, [self.env[i] if i else None for i in inputs], CTX)
        self.env[out] = res[0]
        return out

    def step(self, g: str, u: str) -> str:
        """g H(u) (derivative_ops.RELU_GRAD): the derivative op of the piecewise-linear
        activations."""
        return self.op(RELU_GRAD, [g, u])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.env[name].shape)

    def fit(self, t: str, shape: tuple[int, ...]) -> str:
        """t broadcast to `shape` (a tangent of an operand broadcast by its op)."""
        if self.shape(t) == shape:
            return t
        return self.op("Expand", [t, self.ints(list(shape), "shape")])


def _axis(node: Node, rank: int) -> int:
    return int(node.attrs.get("axis", -1)) % rank


def ln_chain(b: _Builder, node: Node) -> tuple[str, str]:
    """A LayerNorm's n = u r and r = (mean u^2 + eps)^-1/2, u = x - mean x, over the last axis,
    recomputed as their own ops (their ranges registered for `LayerNormHook`)."""
    x = node.inputs[0]
    rank = b.env[x].dim()
    if _axis(node, rank) != rank - 1:
        raise NoTangent("LayerNorm over more than the last axis")
    axes = b.ints([-1])
    keep = {"keepdims": 1}
    mu = b.op("ReduceMean", [x, axes], keep, "ln_mu")
    u = b.op("Sub", [x, mu], hint="ln_u")
    q = b.op("Mul", [u, u], hint="ln_q")
    ln_eps = LayerNormalization(node.op_type, node.attrs).eps
    v = b.op("Add", [b.op("ReduceMean", [q, axes], keep, "ln_v"), b.const(ln_eps, "ln_eps")])
    # a mean of squares plus eps is at least eps (the forms alone may not see it); the walk
    # narrows it by the tokens' radii (`LayerNormHook`)
    b.known[v] = (np.full(b.shape(v), ln_eps * (1 - 1e-12)), np.full(b.shape(v), np.inf))
    b.variance[mu] = (x, v, ln_eps)
    b.centred[v] = u
    r = b.op("Reciprocal", [b.op("Sqrt", [v], hint="ln_s")], hint="ln_r")
    n = b.op("Mul", [u, r], hint="ln_n")
    # the normalised entries: a zero-sum vector of norm <= sqrt(D) has |n_i| <= sqrt(D - 1)
    lim = LayerNormalization.normalised_limit(b.shape(x)[-1])
    b.known[n] = (np.full(b.shape(n), -lim), np.full(b.shape(n), lim))
    return n, r


def _layernorm(b: _Builder, node: Node, t: str) -> str:
    """y = g n + beta, n = u r, u = x - mean x, r = (mean u^2 + eps)^-1/2 over the last axis:
    dn = r (du - n mean(n du)), du = dx - mean dx (n and r recomputed as their own ops; the
    formula: operators/normalization.py)."""
    n, r = ln_chain(b, node)
    parts = LayerNormalization(node.op_type, node.attrs).tangent_graph(b, t, n, r)
    b.ln_parts[node.name] = {"n": n, "r": r, **parts}
    dn = parts["dn"]
    if len(node.inputs) > 1 and node.inputs[1]:
        dn = b.op("Mul", [dn, node.inputs[1]], hint="ln_dy")
    return dn


def _deferred_output(b: _Builder, tail: tuple[Node, list[Node]]) -> tuple[str, str, np.ndarray]:
    """The output's tangent through a final LayerNorm and a linear tail, the LayerNorm's
    products deferred past the tail (as heads/final_layernorm.py does for the margins): with A the
    tail's matrix (K x size of y) and W_k = A_k gamma,
        (J s)_k = sum_ti W_k,ti dn_ti = sum_t r_t (g_kt - w_t h_kt),
    g_kt = sum_i W_k,ti du_ti (linear in the tangent), h_kt = sum_i W_k,ti n_ti, w_t =
    mean_i n_ti du_ti: per token and output one product with r_t and one of w_t with h_kt,
    instead of D products each. Returns (the output's name, dn's name, E) with E (K, *y)
    the weight on |dn_ti| of the coefficients' rounding: |A gamma - W| <= err |gamma| + u |W|."""
    ln, nodes_tail = tail
    parts = b.ln_parts[ln.name]
    y = ln.outputs[0]
    shape = b.shape(y)
    a_hat, err = tail_matrix(nodes_tail, b.env, y)
    k = a_hat.shape[0]
    gam = np.ones(shape) if len(ln.inputs) < 2 or not ln.inputs[1] else \
        np.broadcast_to(b.env[ln.inputs[1]].detach().double().numpy(), shape)
    wk = a_hat.reshape(k, *shape) * gam  # (K, *y)
    e = (err.reshape(k, *shape) * np.abs(gam) + U * np.abs(wk)) * (1 + 1e-9)
    wname = b.const(wk, "head")
    last = b.ints([-1])
    keep = {"keepdims": 1}
    g = b.op("ReduceSum", [b.op("Mul", [parts["du"], wname]), last], keep, "def_g")
    h = b.op("ReduceSum", [b.op("Mul", [parts["n"], wname]), last], keep, "def_h")
    inner = b.op("Sub", [g, b.op("Mul", [parts["w"], h])])
    prod = b.op("Mul", [parts["r"], inner], hint="def_rt")
    out = b.op("ReduceSum", [prod, b.ints(list(range(1, 1 + len(shape))))], {"keepdims": 0},
               "def_out")
    return out, parts["dn"], e


# One rule per op family: (builder, node, the input-dependent inputs' positions, their
# tangents by position) -> the tangent of the node's (single) output.
Rule = Callable[[_Builder, Node, list[int], dict[int, str]], str]


def _layout(b: _Builder, node: Node, dep: list[int], tx: dict[int, str]) -> str:
    if dep != [0]:
        raise NoTangent(f"{node.op_type} of an input-dependent index or shape")
    return b.op(node.op_type, [tx[0]] + node.inputs[1:], node.attrs, node.op_type.lower())


def _concat(b: _Builder, node: Node, dep: list[int], tx: dict[int, str]) -> str:
    parts = [tx[i] if i in tx else b.const(np.zeros(b.shape(name)), "zero")
             for i, name in enumerate(node.inputs)]
    return b.op("Concat", parts, node.attrs)


def _add_sub(b: _Builder, node: Node, dep: list[int], tx: dict[int, str]) -> str:
    oshape = b.shape(node.outputs[0])
    if len(dep) == 2:
        return b.fit(b.op(node.op_type, [tx[0], tx[1]]), oshape)
    d = tx[dep[0]]
    if node.op_type == "Sub" and dep == [1]:
        d = b.op("Neg", [d])
    return b.fit(d, oshape)


def _neg(b: _Builder, node: Node, dep: list[int], tx: dict[int, str]) -> str:
    return b.op("Neg", [tx[0]])


def _product(b: _Builder, node: Node, dep: list[int], tx: dict[int, str]) -> str:
    """Mul, MatMul: d(a b) = da b + a db."""
    t, (a, c) = node.op_type, node.inputs[:2]
    oshape = b.shape(node.outputs[0])
    if len(dep) == 2:
        return b.fit(b.op("Add", [b.op(t, [tx[0], c]), b.op(t, [a, tx[1]])]), oshape)
    args = list(node.inputs)
    args[dep[0]] = tx[dep[0]]
    return b.fit(b.op(t, args), oshape)


def _div(b: _Builder, node: Node, dep: list[int], tx: dict[int, str]) -> str:
    oshape = b.shape(node.outputs[0])
    if dep == [0]:
        return b.fit(b.op("Div", [tx[0], node.inputs[1]]), oshape)
    # d(a / b) = (da - y db) / b, the division as a product with 1 / b (its forward error has
    # a rule, rounding/forward_error.py; a Div by a tensor has none)
    num = b.op("Mul", [node.outputs[0], tx[1]])
    num = b.op("Sub", [tx[0], num]) if 0 in dep else b.op("Neg", [num])
    return b.fit(b.op("Mul", [num, b.op("Reciprocal", [node.inputs[1]])]), oshape)


def _gemm(b: _Builder, node: Node, dep: list[int], tx: dict[int, str]) -> str:
    if dep != [0]:
        raise NoTangent("Gemm of an input-dependent weight")
    attrs = {k: v for k, v in node.attrs.items() if k != "beta"}  # the bias drops out
    return b.op("Gemm", [tx[0], node.inputs[1]], attrs)


def _reduce(b: _Builder, node: Node, dep: list[int], tx: dict[int, str]) -> str:
    if dep != [0]:
        raise NoTangent(f"{node.op_type} with input-dependent axes")
    return b.op(node.op_type, [tx[0]] + node.inputs[1:], node.attrs)


def smooth(b: _Builder, node: Node, dep: list[int], g: str, derivative_first: bool) -> str:
    """g f'(x) for an elementwise or row-wise op of the registry (operators/registry.py), by
    the op's own graph: `scaled_derivative`, Pow's constant exponent its attribute, an axis
    normalised (Relu's derivative is the step: derivative_ops.RELU_GRAD)."""
    if node.op_type not in OPERATORS:
        raise NoTangent(f"{node.op_type} node {node.name}: no rule")
    if dep != [0]:
        raise NoTangent(f"{node.op_type} with an input-dependent exponent")
    attrs = {**node.attrs, "axis": _axis(node, b.env[node.outputs[0]].dim())}
    if node.op_type == "Pow":  # by a constant exponent
        p = b.env[node.inputs[1]].detach().double().reshape(-1)
        if p.numel() != 1:
            raise NoTangent(f"Pow node {node.name}: a tangent only for the exponent 2")
        attrs = {"exponent": float(p[0])}
    op = make(node.op_type, attrs)
    assert op is not None
    try:
        return op.scaled_derivative(b, g, node.inputs[0], node.outputs[0], derivative_first)
    except ModeNotImplemented as e:
        raise NoTangent(f"{node.op_type} node {node.name}: {e}") from None


def _where(b: _Builder, node: Node, dep: list[int], tx: dict[int, str]) -> str:
    """Where(cond, x, y) for a constant condition, or a guard's (IsNaN of a tensor the walk
    proves finite): the taken branch's tangent (0 for a constant branch)."""
    if 0 in dep and node.inputs[0] not in b.guards:
        raise NoTangent("Where with an input-dependent condition")
    zero = b.const(0.0, "zero")
    return b.op("Where", [node.inputs[0], tx.get(1, zero), tx.get(2, zero)])


def _layernorm_rule(b: _Builder, node: Node, dep: list[int], tx: dict[int, str]) -> str:
    if dep != [0]:
        raise NoTangent("LayerNorm with input-dependent weights")
    return _layernorm(b, node, tx[0])


RULES: dict[str, Rule] = {
    **dict.fromkeys(("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity",
                     "Slice", "Gather", "Expand", "Dropout", "Tile", "Cast"), _layout),
    "Concat": _concat, "Add": _add_sub, "Sub": _add_sub, "Neg": _neg, "Mul": _product,
    "MatMul": _product, "Div": _div, "Gemm": _gemm, "ReduceMean": _reduce,
    "ReduceSum": _reduce, "LayerNormalization": _layernorm_rule, "Where": _where,
}


def _split(b: _Builder, node: Node, dep: list[int]) -> None:
    """Split (torch's fused q/k/v projection): each output's tangent the Slice of the
    input's tangent it takes."""
    if dep != [0]:
        raise NoTangent("Split with input-dependent sizes")
    ax = int(node.attrs.get("axis", 0)) % len(b.shape(node.inputs[0]))
    off = 0
    for o in node.outputs:
        if not o:
            continue
        n = b.shape(o)[ax]
        b.tan[o] = b.op("Slice", [b.tan[node.inputs[0]], b.ints([off]), b.ints([off + n]),
                                  b.ints([ax])])
        off += n


def _rule(b: _Builder, node: Node, dep: list[int]) -> str:
    """The tangent of one node's output (an op without a rule here: the registry's, `smooth`)."""
    rule = RULES.get(node.op_type, lambda b, node, dep, tx: smooth(b, node, dep, tx[0], True))
    if len([o for o in node.outputs if o]) != 1:
        raise NoTangent(f"{node.op_type} node {node.name}: several outputs")
    if node.op_type == "Cast" and not b.env[node.outputs[0]].is_floating_point():
        raise NoTangent(f"Cast node {node.name} to a non-float type")
    if any(node.inputs[i] in b.guards for i in dep) and node.op_type != "Where":
        raise NoTangent(f"{node.op_type} node {node.name}: reads an IsNaN/IsInf output")
    return rule(b, node, dep, {i: b.tan[node.inputs[i]] for i in dep
                               if node.inputs[i] not in b.guards})


def run_nodes(nodes: list[Node], env: dict[str, torch.Tensor], feed: dict[str, np.ndarray]
              ) -> dict[str, torch.Tensor]:
    """The nodes evaluated in float64 over a copy of env with `feed` replaced (the tangent and
    adjoint graphs at another point, for tests against autodiff)."""
    out = dict(env)
    out.update({k: torch.from_numpy(np.asarray(v, np.float64)) for k, v in feed.items()})
    for node in nodes:
        res = run_op(node, [out[i] if i else None for i in node.inputs], CTX)
        for name, value in zip(node.outputs, res, strict=False):
            if name:
                out[name] = value
    return out


class LayerNormHook:
    """`affine.walk.walk`'s hook for the LayerNorm chains of `ln_chain`: the variance by its
    expansion (`affine.walk.variance`) and its range from the tokens' radii."""

    def __init__(self, variance: dict[str, tuple[str, str, float]], centred: dict[str, str],
                 env: dict[str, torch.Tensor], known: dict[str, tuple[np.ndarray, np.ndarray]],
                 ball: Ball) -> None:
        self.variance, self.centred, self.env = variance, centred, env
        self.known, self.ball = known, ball

    def __call__(self, node: Node, forms: dict[str, Aff]) -> None:
        """Before a LayerNorm's mean: its variance from the tokens' radii,
        (||P x0_t|| - rho_t)_+^2 / D + eps <= v_t <= (||P x0_t|| + rho_t)^2 / D + eps,
        P the mean-removing projection (norm <= 1), rho_t >= ||x_t(X) - x_t(X0)||_2."""
        vin = node.inputs[0] if node.inputs else ""
        if vin in self.centred and vin in forms and self.centred[vin] in forms:
            # the variance by its expansion around the centre (affine.walk.variance)
            forms[vin] = affine.select(forms[vin], variance(
                forms[self.centred[vin]], forms[vin], self.ball), self.ball)
        spec = self.variance.get(node.outputs[0])
        if spec is None or spec[0] not in forms:
            return
        xf = forms[spec[0]]
        rho = affine.token_radius(xf, self.ball)[..., 0]  # (...,)
        if not np.all(np.isfinite(rho)):
            return
        d = xf.shape[-1]
        u0 = xf.c - xf.c.mean(axis=-1, keepdims=True)
        cn = np.sqrt(np.square(u0).sum(axis=-1))
        mn = np.sqrt(np.square(xf.m).sum(axis=-1))
        lo_norm = np.maximum(cn * (1 - 1e-12) - mn * (1 + 1e-12) - rho, 0.0)
        hi_norm = (cn * (1 + 1e-12) + mn + rho) * (1 + 1e-12)
        ln_eps = spec[2]
        vlo = (np.square(lo_norm) / d) * (1 - 1e-12) + ln_eps * (1 - 1e-12)
        vhi = (np.square(hi_norm) / d) * (1 + 1e-12) + ln_eps * (1 + 1e-12)
        shape = self.env[spec[1]].shape
        self.known[spec[1]] = (vlo.reshape(shape), vhi.reshape(shape))


SEED = "__tangent_seed"
PAIRS_ON = True  # the pair symbols (affine.PAIRS); off: one symbol per product entry


class TangentGraph:
    """The model's input-dependent nodes followed, node by node, by their tangents (the seed
    `SEED`, the input's tangent, is 0 at the centre and the first P symbols over the ball)."""

    def __init__(self, model: OnnxModel, x: np.ndarray) -> None:
        self.model, self.x = model, x
        module = model.module.with_dtype(torch.float64)
        with torch.no_grad():
            env = module.run_env(torch.from_numpy(x))
        inp = model.spec.input_name
        env[SEED] = torch.zeros_like(env[inp])
        b = _Builder(env)
        b.tan[inp] = SEED
        dynamic = {inp}
        for node in module.runtime_nodes:  # type: ignore[union-attr]
            dep = [i for i, n in enumerate(node.inputs) if n and n in dynamic]
            # a shape is constant over the ball: what reads only shapes is too (torch's
            # attention exports Shape nodes of its projections)
            if not dep or node.op_type in ("Shape", "Size"):
                continue
            b.nodes.append(node)
            if node.op_type in GUARDS:  # walked, no tangent
                b.guards.add(node.outputs[0])
                dynamic.add(node.outputs[0])
                continue
            if node.op_type == "Split":  # several outputs: each one's part of the tangent
                _split(b, node, dep)
                dynamic.update(o for o in node.outputs if o)
                continue
            b.tan[node.outputs[0]] = _rule(b, node, dep)
            dynamic.add(node.outputs[0])
        self.output = b.tan[model.spec.output_name]
        # the final LayerNorm's tangent deferred past a linear head (`_deferred_output`)
        self.deferred: tuple[str, str, np.ndarray] | None = None
        tail = find_tail(list(module.runtime_nodes), model.spec.output_name, env)  # type: ignore[arg-type]
        if tail is not None and tail[0].name in b.ln_parts:
            self.deferred = _deferred_output(b, tail)
        self.nodes, self.env, self.known_ranges = b.nodes, env, b.known
        self.variance, self.centred = b.variance, b.centred
        self.widest = max(int(env[nd.outputs[0]].numel()) for nd in b.nodes)
        self.margin = Proven(self.nodes, inp, x, env)

    def jvp(self, x: np.ndarray, s: np.ndarray, deferred: bool = False) -> np.ndarray:
        """J_F(x) s, evaluated through the tangent graph in float64 (for tests: it must agree
        with autodiff); `deferred`: through the deferred output instead."""
        env = run_nodes(self.nodes, self.env, {self.model.spec.input_name: x, SEED: s})
        name = self.deferred[0] if deferred and self.deferred is not None else self.output
        return env[name].detach().numpy()

    def output_form(self, eps: float, quad: bool = False) -> Aff | None:
        """The tangent output's affine form over X in the inf-ball and s in [-1, 1]^P
        (`quad`: with second-order symbols in d, affine.QUAD)."""
        ball = Ball(self.x, float(eps), "inf")
        p = ball.size
        shape = self.x.shape
        # the pair symbols d_p s_q / eps (affine.PAIRS) on the inf-ball, while the widest
        # tangent form they make fits the form budget
        pairs = PAIRS_ON and \
            self.widest * (2 * p + p * p) <= affine.MAX_FORM_ENTRIES // 2
        reserved = p + p * p if pairs else p
        z = np.zeros(shape)
        seed = Aff(z, z.copy(), z.copy(),
                   np.concatenate([np.zeros((p, p)), np.eye(p)], axis=1).reshape(*shape, 2 * p),
                   z.copy())
        token = PAIRS.set((p, 2 * p) if pairs else None)
        known = dict(self.known_ranges)

        hook = LayerNormHook(self.variance, self.centred, self.env, known, ball)
        capture: dict[str, Aff | None] = {} if self.deferred is None else {
            self.deferred[0]: None, self.deferred[1]: None}
        try:
            with self.margin:
                forms = walk(self.nodes, self.model.spec.input_name, self.env, ball, {}, set(),
                             self.output, everything=False, seeds={SEED: seed},
                             symbols=reserved, known=known, hook=hook, capture=capture,
                             quad=quad)
        finally:
            PAIRS.reset(token)
        self._captured = capture
        return forms.get(self.output)

    def bound(self, eps: float, quad: bool = False) -> np.ndarray | None:
        """Per output entry i, an upper bound on sup ||row i of J_F(X)||_1 over the ball."""
        f = self.output_form(eps, quad)
        if f is None:
            return None
        ball = Ball(self.x, float(eps), "inf")
        lo, hi = affine.ranges(f, ball)
        out = np.maximum(np.abs(lo), np.abs(hi)).reshape(-1)
        if self.deferred is not None:
            dfo, dn = (self._captured.get(n) for n in self.deferred[:2])
            if dfo is not None and dn is not None and dfo.c.size == out.size:
                # the deferred output plus the coefficients' rounding: sum E |dn|
                dlo, dhi = affine.ranges(dn, ball)
                dmax = np.maximum(np.abs(dlo), np.abs(dhi))
                slack = (self.deferred[2] * dmax).reshape(out.size, -1).sum(axis=1)
                qlo, qhi = affine.ranges(dfo, ball)
                alt = np.maximum(np.abs(qlo), np.abs(qhi)).reshape(-1) + slack * (1 + 1e-9)
                with np.errstate(invalid="ignore"):
                    out = np.where(np.isfinite(alt), np.minimum(out, alt), out)
        if not np.all(np.isfinite(out)):
            return None
        return widen_up(out, 4)
