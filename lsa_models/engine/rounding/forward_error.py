"""A checked bound on the float64 forward pass's error at the centre (docs/local-rounding.md,
"The forward margin, checked").

The engine takes every centre value c_T = fl(T(X0)) to be within FORWARD_MARGIN |c_T| +
FORWARD_FLOOR max|c_T| of the true T(X0). This module proves it a posteriori for a graph:
one interval evaluation at X0 (a point, so the intervals are only as wide as the rounding),
each op with its own outward-rounded rule,
  - layout ops move entries (run on both ends: exact);
  - linear maps y = L(x) + b: |y - c_y| <= |L|(r_x) + gamma_k (|L|(|c_x|) + |b|), the second
    term bounding the float64 rounding of c_y = fl(L(c_x) + b) in any summation order;
  - elementwise f: the range of f over the input interval (primitives.value_range; the
    op's own, lsa_models/operators/);
  - products a * b, a @ b: |c_a| r_b + r_a |c_b| + r_a r_b + gamma_k |c_a| |c_b|;
  - Softmax from the logit intervals; LayerNorm from u = P x, s = mean(u^2) + eps, z = u/sigma
    intervals (LayerNormalization.output_range);
and returns the smallest margin that covers the resulting radius around every c_T; the engine
runs with it. An op without such a rule leaves FORWARD_MARGIN an assumption (reported), never
refused.
"""

from __future__ import annotations

from typing import Self

import numpy as np
import torch

from lsa_models.engine.derivative_ops import GUARDS, RELU_GRAD
from lsa_models.engine.enclosure.elementwise_ranges import value_range
from lsa_models.engine.enclosure.primitives import SOFTMAX
from lsa_models.engine.enclosure.rules import LayoutRule
from lsa_models.engine.rounding import forward_ball
from lsa_models.engine.values import (
    FORWARD_FLOOR,
    FORWARD_MARGIN,
    MARGIN,
    PROVEN,
    array_key,
    gamma,
    widen_up,
)
from lsa_models.onnx.ops import OPS, Node, RunContext
from lsa_models.operators import make
from lsa_models.operators.normalization import LayerNormalization

CTX = RunContext(torch.float64)
# A proven relative error above this means the interval evaluation is useless here: it is then
# not used and FORWARD_MARGIN stays an assumption, reported (docs/local-rounding.md)
PROVEN_CAP = 1e-3
_LAYOUT = LayoutRule.types
_LINEAR = ("Add", "Sub", "Neg", "Mul", "Div", "MatMul", "Gemm", "ReduceMean", "ReduceSum")
Iv = tuple[np.ndarray, np.ndarray]


def _t(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(x, dtype=np.float64, order="C"))


def _run(node: Node, ins: list[torch.Tensor | None]) -> np.ndarray:
    return OPS[node.op_type].run(node, ins, CTX)[0].numpy()


def _abs_node(node: Node) -> Node:
    n = Node(node.name, node.op_type, node.inputs, node.outputs, dict(node.attrs), node.domain)
    if node.op_type == "Sub":
        n.op_type = "Add"
    if node.op_type == "Neg":
        n.op_type = "Identity"
    for a in ("alpha", "beta"):
        if a in n.attrs:
            n.attrs[a] = abs(float(n.attrs[a]))
    return n


def _linear(node: Node, args: list, iv: dict[str, Iv], env: dict[str, torch.Tensor]) -> Iv:
    absn = _abs_node(node)
    var = [i for i, a in enumerate(args) if a in iv]
    # Gemm's and Conv's bias (input 2) is additive: zero in the spread, |b| in the magnitudes
    additive = node.op_type in ("Add", "Sub", "Gemm", "Conv")

    def fill(values: dict[int, np.ndarray], keep_additive: bool) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for i, name in enumerate(args):
            if i in values:
                out.append(_t(values[i]))
            elif not name:
                out.append(None)
            else:
                c = env[name].detach()
                if not c.is_floating_point():
                    out.append(c)
                elif additive and (node.op_type not in ("Gemm", "Conv") or i == 2) \
                        and not keep_additive:
                    out.append(torch.zeros_like(c, dtype=torch.float64))
                else:
                    out.append(c.to(torch.float64).abs())
        return out

    cen = {i: env[args[i]].detach().numpy() for i in var}
    rad = {i: np.maximum(iv[args[i]][1] - cen[i], cen[i] - iv[args[i]][0]) for i in var}
    spread = _run(absn, fill(rad, False))
    mag = _run(absn, fill({i: np.abs(c) for i, c in cen.items()}, True))
    k = max(int(env[a].numel()) if a and a in env else 1 for a in args) + 2
    c_out = env[node.outputs[0]].detach().numpy()
    r = widen_up(np.broadcast_to(spread, c_out.shape) + gamma(k) * mag, k)
    return c_out - r, c_out + r


def _product(node: Node, a: Iv, b: Iv, ca: np.ndarray, cb: np.ndarray,
             c_out: np.ndarray) -> Iv:
    mm = node.op_type == "MatMul"
    ra, rb = np.maximum(a[1] - ca, ca - a[0]), np.maximum(b[1] - cb, cb - b[0])

    def mul(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return x @ y if mm else x * y
    k = int(ca.shape[-1]) + 2 if mm else 4
    r = mul(np.abs(ca), rb) + mul(ra, np.abs(cb)) + mul(ra, rb) + gamma(k) * mul(
        np.abs(ca), np.abs(cb))
    r = widen_up(np.broadcast_to(r, c_out.shape), 4 * k)
    return c_out - r, c_out + r


def _layernorm(node: Node, x: Iv, xc: np.ndarray, g: np.ndarray, b: np.ndarray | None) -> Iv:
    """y's range from x's: u = P x within uc +- ru (the centring's rounding included), then
    the op's own (operators/normalization.py, `output_range`)."""
    d = xc.shape[-1]
    rx = np.maximum(x[1] - xc, xc - x[0])
    uc = xc - xc.mean(axis=-1, keepdims=True)
    ru = widen_up(rx + rx.mean(axis=-1, keepdims=True)
                  + gamma(d + 2) * (np.abs(xc) + np.abs(xc).mean(axis=-1, keepdims=True)), 4)
    return LayerNormalization(node.op_type, node.attrs).output_range(uc, ru, g, b)


def _node(node: Node, iv: dict[str, Iv], env: dict[str, torch.Tensor]) -> Iv | None:
    """The interval of the node's (first) output, or None: no rule for this op."""
    t, args = node.op_type, node.inputs
    var = [i for i, a in enumerate(args) if a in iv]
    c_out = env[node.outputs[0]].detach().numpy()
    if t in _LAYOUT:
        lo = [_t(iv[a][0]) if a in iv else (env[a].detach() if a else None) for a in args]
        hi = [_t(iv[a][1]) if a in iv else (env[a].detach() if a else None) for a in args]
        return _run(node, lo), _run(node, hi)
    if t == RELU_GRAD:  # g H(x): a product with 0 or 1, exact
        giv = iv[args[0]] if args[0] in iv else (env[args[0]].detach().numpy(),) * 2
        xiv = iv[args[1]] if args[1] in iv else (env[args[1]].detach().numpy(),) * 2
        h_lo, h_hi = np.where(xiv[0] > 0, 1.0, 0.0), np.where(xiv[1] > 0, 1.0, 0.0)
        ends = np.stack([giv[0] * h_lo, giv[0] * h_hi, giv[1] * h_lo, giv[1] * h_hi])
        return ends.min(axis=0), ends.max(axis=0)
    if t in GUARDS and var == [0]:  # of a finite interval: False, exactly
        lo_, hi_ = iv[args[0]]
        if not (np.all(np.isfinite(lo_)) and np.all(np.isfinite(hi_))):
            return None
        return np.zeros(c_out.shape), np.zeros(c_out.shape)
    if t == "Where" and (0 not in var or np.array_equal(*iv[args[0]])):
        # a constant condition (or a guard's, proven constant): each entry its branch's
        cond = env[args[0]].detach().numpy().astype(bool)
        br = [iv[a] if a in iv else (env[a].detach().numpy(),) * 2 for a in args[1:]]
        return (np.broadcast_to(np.where(cond, br[0][0], br[1][0]), c_out.shape),
                np.broadcast_to(np.where(cond, br[0][1], br[1][1]), c_out.shape))
    if t in ("Add", "Sub") and len(var) == 1 and np.any(np.isneginf(c_out)):
        # an attention mask's -inf constant: those entries are -inf exactly (a finite value
        # plus -inf), the rest by the linear rule
        k = 1 - var[0]
        const = np.broadcast_to(env[args[k]].detach().numpy(), c_out.shape)
        neg = np.isneginf(c_out)
        # (Sub: the constant is subtracted, so the mask is +inf there)
        if t == "Sub" and k == 0 or not np.array_equal(np.isinf(const), neg):
            return None
        masked_env = dict(env)  # the mask's entries as 0: the linear rule on the rest
        masked_env[args[k]] = torch.from_numpy(np.where(neg, 0.0, const))
        masked_env[node.outputs[0]] = torch.from_numpy(np.where(neg, 0.0, c_out))
        mlo, mhi = _linear(node, args, iv, masked_env)
        return np.where(neg, -np.inf, mlo), np.where(neg, -np.inf, mhi)
    if t in ("Mul", "MatMul") and len(var) == 2:
        ca, cb = env[args[0]].detach().numpy(), env[args[1]].detach().numpy()
        return _product(node, iv[args[0]], iv[args[1]], ca, cb, c_out)
    if t == "Div" and 1 in var:
        return None
    if t in _LINEAR or (t == "Conv" and var == [0]):  # Conv: a constant kernel and bias
        return _linear(node, args, iv, env)
    if t == "Softmax":
        ax = int(node.attrs.get("axis", -1)) % c_out.ndim
        llo, lhi = np.moveaxis(iv[args[0]][0], ax, -1), np.moveaxis(iv[args[0]][1], ax, -1)
        pc = np.moveaxis(c_out, ax, -1)
        plo, phi = SOFTMAX.probability_ranges(llo, lhi, pc)
        return np.moveaxis(plo, -1, ax), np.moveaxis(phi, -1, ax)
    if t == "LayerNormalization":
        if var != [0]:
            return None
        g = env[args[1]].detach().numpy()
        b = env[args[2]].detach().numpy() if len(args) > 2 and args[2] else None
        return _layernorm(node, iv[args[0]], env[args[0]].detach().numpy(), g, b)
    op = make(t, {"exponent": float(env[args[1]].reshape(()))} if t == "Pow" else node.attrs)
    if op is not None:
        vlo, vhi = value_range(op, *iv[args[0]])
        return None if vlo is None or vhi is None else (vlo, vhi)
    return None


def check(nodes: list[Node], input_name: str, x: np.ndarray,
          env: dict[str, torch.Tensor], errors: dict[str, np.ndarray] | None = None
          ) -> tuple[float | None, str]:
    """(m, detail): the smallest margin m with |T(X0) - c_T| <= m |c_T| + m max|c_T| proven
    for every input-dependent tensor T (at least FORWARD_MARGIN), or None when neither the
    interval evaluation nor the ball arithmetic (rounding/forward_ball.py) has a rule for every op
    (then the engine keeps FORWARD_MARGIN as a stated assumption). Where the interval bound
    is above BALL_BELOW, the ball arithmetic's is computed too and the smaller one kept per
    entry. `errors`, when given, receives every tensor's proven entrywise error."""
    errs, why = _interval_errors(nodes, input_name, x, env)
    how = "op by op"
    need = None if errs is None else _need(errs, env)
    if need is None or need > BALL_BELOW:
        balls = forward_ball.errors(nodes, input_name, x, env)
        if balls is not None and (errs is None or set(errs) <= set(balls)):
            # both are proven: the smaller per entry
            errs = {n: e if errs is None else np.minimum(e, errs.get(n, e))
                    for n, e in balls.items()}
            need, how = _need(errs, env), "by ball arithmetic"
    if errs is None or need is None:
        return None, why
    if errors is not None:
        errors.update({n: e * (1 + 1e-9) + 1e-300 for n, e in errs.items()})
    if need > PROVEN_CAP:
        return None, (f"the bound on the forward error ({need:.3g} relative, {how}) is too "
                      f"wide to use; FORWARD_MARGIN {FORWARD_MARGIN:g} is assumed")
    return need, f"forward error proven {how}: margin {need:.3g}"


# the interval bound's relative forward error above which the ball arithmetic runs as well
# (small classifiers stay below it; a 4-sublayer x-transformers encoder reaches 0.085)
BALL_BELOW = 1e-12


def _need(errs: dict[str, np.ndarray], env: dict[str, torch.Tensor]) -> float:
    """The smallest m with every err <= m |c| + m max|c| (at least FORWARD_MARGIN)."""
    need = max(FORWARD_MARGIN, FORWARD_FLOOR)
    for name, err in errs.items():
        c = env[name].detach().numpy()
        if c.size:
            # (an all-zero tensor, a tangent at the centre (derived/tangent.py), has errors of the
            # order of the TINY paddings only: 1e-280 keeps them out of the relative margin)
            cf = np.abs(np.where(np.isneginf(c) & (err == 0), 0.0, c))
            need = max(need, float(np.max(err / (cf + float(np.max(cf)) + 1e-280)))
                       * (1 + 1e-6))
    return need


def _interval_errors(nodes: list[Node], input_name: str, x: np.ndarray,
                     env: dict[str, torch.Tensor]
                     ) -> tuple[dict[str, np.ndarray] | None, str]:
    """Every input-dependent tensor's entrywise error bound by one interval evaluation at
    X0, or (None, why)."""
    iv: dict[str, Iv] = {input_name: (x, x)}
    errs: dict[str, np.ndarray] = {}
    for node in nodes:
        if node.op_type in ("Shape", "Size") or not any(a in iv for a in node.inputs if a):
            continue
        if node.op_type in _LAYOUT and len([o for o in node.outputs if o]) > 1:
            lo = [_t(iv[a][0]) if a in iv else (env[a].detach() if a else None)
                  for a in node.inputs]
            hi = [_t(iv[a][1]) if a in iv else (env[a].detach() if a else None)
                  for a in node.inputs]
            outs = zip(OPS[node.op_type].run(node, lo, CTX), OPS[node.op_type].run(node, hi, CTX),
                       node.outputs, strict=False)
            iv.update({o: (a.numpy(), b.numpy()) for a, b, o in outs if o})
            continue
        out = _node(node, iv, env) if len([o for o in node.outputs if o]) == 1 else None
        if out is None:
            return None, f"{node.op_type} node {node.name}: no forward-error rule"
        name = node.outputs[0]
        c = env[name].detach().numpy()
        # an attention mask's -inf entries are exact where both ends are -inf
        exact = np.isneginf(c) & np.isneginf(out[0]) & np.isneginf(out[1])
        with np.errstate(invalid="ignore"):
            err = np.where(exact, 0.0, np.maximum(out[1] - c, c - out[0]))
        if not np.all(np.isfinite(err)):
            return None, f"{node.op_type} node {node.name}: the forward error is not finite"
        errs[name] = err
        iv[name] = (np.minimum(out[0], c), np.maximum(out[1], c))
    return errs, ""


class Proven:
    """A graph's float64 run at X0 with its forward margin (`check`: `proven`, None where not
    proven, and `detail`) and every tensor's proven error (`known`), set as the run's margin
    (values.MARGIN, values.PROVEN) for the duration of a `with` block."""

    def __init__(self, nodes: list[Node], input_name: str, x: np.ndarray,
                 env: dict[str, torch.Tensor]) -> None:
        errors: dict[str, np.ndarray] = {}
        self.proven, self.detail = check(nodes, input_name, x, env, errors)
        self.known: dict = {} if self.proven is None else {
            array_key(env[n].detach().numpy()): (None, e) for n, e in errors.items()
            if n in env}

    def __enter__(self) -> Self:
        self._tokens = (MARGIN.set(FORWARD_MARGIN if self.proven is None else self.proven),
                        PROVEN.set(self.known))
        return self

    def __exit__(self, *exc: object) -> None:
        PROVEN.reset(self._tokens[1])
        MARGIN.reset(self._tokens[0])
