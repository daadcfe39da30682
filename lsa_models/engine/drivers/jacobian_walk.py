"""The walk of the Jacobian enclosure: one pass over the graph's input-dependent nodes in
graph order, each op's local rule (enclosure/rules.py) carrying a `LocalValue` per tensor; the
range-sensitive ops' inputs (CHECKPOINTS) tightened by the telescoped remainder
(remainders/telescope.py), the values bounded by the half ball's integrated form, the affine forms
(affine/form.py) in lockstep narrowing the ranges, fused elementwise chains bounded at their sink.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from lsa_models.bounds.numerics import U, mul_up, sqrt_up
from lsa_models.engine import elementwise_chains
from lsa_models.engine.affine import form as affine
from lsa_models.engine.affine.walk import release, step, uses
from lsa_models.engine.elementwise_chains import Chain
from lsa_models.engine.enclosure.elementwise_ranges import LIBM_REL
from lsa_models.engine.enclosure.primitives import elementwise
from lsa_models.engine.enclosure.rules import LOCAL_RULES, LocalRule
from lsa_models.engine.remainders.operator_norms import integrated_tokens, set_token_radius
from lsa_models.engine.remainders.telescope import Telescope
from lsa_models.engine.values import (
    Ball,
    LocalNotCertified,
    LocalValue,
    Values,
    center_margin,
    dual_row_norms,
    input_value,
    widen_up,
)
from lsa_models.onnx.loading import OnnxModel
from lsa_models.onnx.ops import Node, decimal_attr
from lsa_models.operators import OPERATORS, ModeNotImplemented, activation

# Jacobian entries the engine will hold for one tensor (float64): beyond it, the ball is
# bounded by per-layer rules instead.
MAX_JACOBIAN_ENTRIES = 40_000_000
# Ops whose enclosures depend most on their input's range: their inputs are tightened (the
# registry's nonlinear ops, and products of two input-dependent tensors).
CHECKPOINTS = (*OPERATORS, "Mul", "MatMul", "Div")
# Relational value ranges (affine/form.py) in lockstep with the enclosure: they keep the value
# ranges from compounding through LayerNorm and attention (docs/local-affine.md, "Affine value
# forms").
AFFINE = True


def integrated(v: LocalValue, h: LocalValue | np.ndarray | None, ball: Ball) -> LocalValue:
    """Values by the integrated mean value form (docs/local-enclosure.md): the segment from X0 to
    X spends its first half in the ball of radius eps/2, where the Jacobian is within
    h.jr (+ |h.jc - jc|) of jc, so
    |T_i(X) - T_i(X0) - jc_i d| <= (eps/2) (||h.jr_i||_q + ||jr_i||_q)."""
    if not isinstance(h, LocalValue) or h.shape != v.shape:
        return v
    jr_h = widen_up(h.jr + np.abs(h.jc - v.jc), 2)
    rows = widen_up(dual_row_norms(np.abs(v.jc), ball.norm) + 0.5 * (
        dual_row_norms(jr_h, ball.norm) + dual_row_norms(v.jr, ball.norm)), 4)
    rad = widen_up(ball.eps * rows, 2) + center_margin(v.center)
    lo = np.minimum(np.maximum(v.lo, v.center - rad), v.center)
    hi = np.maximum(np.minimum(v.hi, v.center + rad), v.center)
    out = dataclasses.replace(v, lo=lo, hi=hi)  # every annotation kept
    integrated_tokens(out, h, ball)
    return out


def walk(model: OnnxModel, module: torch.nn.Module, env: dict[str, torch.Tensor], ball: Ball,
          tight: Telescope | None, half: Values | None = None, quad: bool = False
          ) -> tuple[Values, list[tuple[str, str, float, str]]]:
    """One pass over the input-dependent nodes in graph order; with `half` (the values on the
    ball of half the radius), every range is also bounded by the integrated form; `quad`:
    the forms in lockstep with second-order symbols (affine.QUAD)."""
    values: Values = {model.spec.input_name: input_value(ball)}
    layers: list[tuple[str, str, float, str]] = []
    chains, inside = fused_chains(model, module, env)
    nodes: list[Node] = list(module.runtime_nodes)  # type: ignore[arg-type]
    forms = _Forms(ball, values, env, uses(nodes, chains, inside),
                   model.spec.output_name) if ball.eps > 0 and AFFINE else None
    if forms is not None:
        forms.forms[model.spec.input_name] = affine.input_form(ball)
    q = quad and forms is not None
    t = affine.quad_size(ball.size) if q else 0
    token = affine.SPACE.set([ball.size, t, t])  # the second-order symbols: reserved
    token_q = affine.QUAD.set(ball.size if q else None)
    try:
        _walk_nodes(model, module, env, ball, tight, half, values, layers, chains, inside, forms)
    finally:
        affine.QUAD.reset(token_q)
        affine.SPACE.reset(token)
    return values, layers


def _walk_nodes(model: OnnxModel, module: torch.nn.Module, env: dict[str, torch.Tensor],
                ball: Ball, tight: Telescope | None, half: Values | None, values: Values,
                layers: list[tuple[str, str, float, str]], chains: dict[str, Chain],
                inside: set[str], forms: _Forms | None) -> None:
    for node in module.runtime_nodes:  # type: ignore[union-attr]
        if node.name in inside:
            chain = chains.get(node.name)
            if chain is not None:  # inner links are bounded at their chain's sink
                layers.append(_walk_chain(node, chain, values, env, ball, tight))
                if forms is not None:
                    forms.step(node, [chain.root], [chain.sink], chain)
            continue
        if tight is not None:
            _checkpoint(node, values, ball, tight, half, forms)
        args = [None if not i else values[i] if i in values else
                (env[i].detach().numpy() if i in env else None) for i in node.inputs]
        centers = [None if not o or o not in env else env[o].detach().numpy()
                   for o in node.outputs]
        if not any(isinstance(a, LocalValue) for a in args) or \
                node.op_type in ("Shape", "Size"):
            for o, c in zip(node.outputs, centers, strict=False):
                if o and c is not None:
                    values[o] = c  # shape arithmetic and constants
            continue
        outs = _rule(node, centers, ball).apply(node, args, centers, ball)
        for o, v in zip(node.outputs, outs, strict=False):
            if o and v is not None:
                values[o] = v if half is None or not isinstance(v, LocalValue) else \
                    integrated(v, half.get(o), ball)
        if forms is not None:
            forms.step(node, node.inputs, node.outputs)
        factor = _layer_factor(node, args, ball.norm)
        if factor is not None:
            layers.append((node.name, *factor))


def _rule(node: Node, centers: list[np.ndarray | None], ball: Ball) -> LocalRule:
    rule = LOCAL_RULES.get(node.op_type)
    if rule is None:
        raise LocalNotCertified(f"{node.op_type} node {node.name}: no local rule")
    for c in centers:
        if c is not None and c.size * ball.size > MAX_JACOBIAN_ENTRIES:
            raise LocalNotCertified(f"node {node.name}: the Jacobian enclosure would hold "
                                    f"{c.size * ball.size} entries (limit "
                                    f"{MAX_JACOBIAN_ENTRIES})")
    return rule


class _Forms:
    """The affine forms of the walk's tensors (affine/form.py): each op's inputs are narrowed to
    the enclosure's ranges, its outputs' enclosures intersected with the forms' ranges."""

    def __init__(self, ball: Ball, values: Values, env: dict[str, torch.Tensor],
                 count: dict[str, int], output: str) -> None:
        self.ball, self.values, self.env = ball, values, env
        self.forms: dict[str, affine.Aff] = {}
        self.count, self.output = count, output  # forms are dropped after their last use

    def _form(self, name: str) -> affine.Aff | None:
        v = self.values.get(name)
        if not isinstance(v, LocalValue):
            return None
        f = self.forms.get(name)
        if f is None:
            return affine.interval(v.center, center_margin(v.center), v.lo, v.hi,
                                   self.ball.size)
        if f.masked is not None:  # the mask's entries hold no values: nothing to narrow by
            return f
        return affine.narrow(f, v.lo, v.hi, self.ball)

    def tokens(self, name: str) -> None:
        """The token radii of a checkpoint's input, intersected with its form's."""
        v, f = self.values.get(name), self.forms.get(name)
        if not isinstance(v, LocalValue) or f is None or \
                f.shape != v.shape or not v.shape:
            return
        true = affine.token_radius(f, self.ball)
        if not np.all(np.isfinite(true)):
            return
        set_token_radius(v, true if v.tok_true is None else np.minimum(v.tok_true, true))

    def step(self, node: Node, ins: list[str], outs: list[str],
             chain: Chain | None = None) -> None:
        args: list = []
        for i in ins:
            f = self._form(i) if i else None
            args.append(f if f is not None else None if not i else
                        self.values[i] if i in self.values else
                        (self.env[i].detach().numpy() if i in self.env else None))
        centers = [None if not o or o not in self.env else self.env[o].detach().numpy()
                   for o in outs]

        def ranges_of(k: int) -> tuple[np.ndarray, np.ndarray] | None:
            v = self.values.get(ins[k])
            return (v.lo, v.hi) if isinstance(v, LocalValue) else None
        try:
            res = step(node, args, centers, self.ball, ranges_of, chain,
                              chain_consts(chain, self.env) if chain is not None else None)
        except affine.NotAffine:
            return
        finally:
            release(self.forms, self.count, ins, self.output)
        for o, f in zip(outs, res, strict=False):
            v = self.values.get(o) if o else None
            if f is None or not isinstance(v, LocalValue) or f.shape != v.shape:
                continue
            if f.masked is not None:  # kept for the Softmax that reads it, never intersected
                self.forms[o] = f
                continue
            lo, hi = affine.ranges(f, self.ball)
            if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
                continue
            self.values[o] = dataclasses.replace(
                v, lo=np.minimum(np.maximum(v.lo, lo), v.center),
                hi=np.maximum(np.minimum(v.hi, hi), v.center))
            self.forms[o] = f


def _checkpoint(node: Node, values: Values, ball: Ball, tight: Telescope,
                half: Values | None = None, forms: _Forms | None = None) -> None:
    """Tighten the inputs of a range-sensitive op (CHECKPOINTS; products only of two
    input-dependent tensors) by telescoping."""
    if node.op_type not in CHECKPOINTS or (
            node.op_type in ("Mul", "MatMul", "Div") and
            sum(isinstance(values.get(i), LocalValue) for i in node.inputs if i) < 2):
        return
    for i in node.inputs:
        v = values.get(i) if i else None
        if isinstance(v, LocalValue):
            t = tight.tighten(i, v, values, ball, tokens=True)
            values[i] = t if half is None else integrated(t, half.get(i), ball)
            if forms is not None:
                forms.tokens(i)


def _walk_chain(node: Node, chain: Chain, values: Values, env: dict[str, torch.Tensor],
                ball: Ball, tight: Telescope | None) -> tuple[str, str, float, str]:
    """Bound a fused elementwise chain at its sink node; returns its reported factor."""
    root = values.get(chain.root)
    if not isinstance(root, LocalValue):
        raise LocalNotCertified(f"the elementwise chain ending at {node.name} has an "
                                "input-independent root")
    if tight is not None:
        root = values[chain.root] = tight.tighten(chain.root, root, values, ball, tokens=True)
    values[chain.sink] = _fused(chain, root, env, ball)
    dlo, dhi = elementwise_chains.ranges(chain, chain_consts(chain, env), root.lo, root.hi)[1]
    f = float(np.max(np.maximum(np.abs(dlo), np.abs(dhi)))) * (1 + LIBM_REL) + 1e-300
    ops = "/".join(nd.op_type for nd in chain.nodes)
    return (node.name, "activation:fused", f,
            f"local elementwise chain ({ops}): largest slope over the input's range")


def chain_consts(chain: Chain, env: dict[str, torch.Tensor]) -> dict[str, float]:
    inner = {n.outputs[0] for n in chain.nodes}
    return {i: float(env[i].reshape(())) for nd in chain.nodes for i in nd.inputs
            if i and i in env and env[i].numel() == 1 and i != chain.root and i not in inner}


def fused_chains(model: OnnxModel, module: torch.nn.Module, env: dict[str, torch.Tensor]
            ) -> tuple[dict[str, Chain], set[str]]:
    variable = {model.spec.input_name}
    nodes: list[Node] = list(module.runtime_nodes)  # type: ignore[arg-type]
    for nd in nodes:
        if nd.op_type not in ("Shape", "Size") and any(i in variable for i in nd.inputs if i):
            variable.update(o for o in nd.outputs if o)
    return elementwise_chains.find_chains(nodes, env, variable, {model.spec.output_name})


def _fused(chain: Chain, x: LocalValue, env: dict[str, torch.Tensor],
           ball: Ball) -> LocalValue:
    """y = f(x) for a fused chain: elementwise with f' from interval differentiation."""
    consts = chain_consts(chain, env)

    def d(c: np.ndarray) -> np.ndarray:
        lo, hi = elementwise_chains.evaluate(chain, consts, c, c)[1]
        return 0.5 * (lo + hi)

    def rng(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return elementwise_chains.ranges(chain, consts, lo, hi)[1]

    def curv(lo: np.ndarray, hi: np.ndarray) -> np.ndarray | None:
        r = elementwise_chains.second(chain, consts, lo, hi)
        return None if r is None else np.maximum(np.abs(r[0]), np.abs(r[1]))

    def curv2(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        return elementwise_chains.second(chain, consts, lo, hi)

    vals = elementwise_chains.ranges(chain, consts, x.lo, x.hi)[0]
    out = env[chain.sink].detach().numpy()
    return elementwise(x, "fused", out, ball, deriv=(d, rng), values=vals, curv=curv,
                       curv2=curv2)


def _layer_factor(node: Node, args: list, norm: str) -> tuple[str, float, str] | None:
    """A reported per-layer local factor (what dominates; the certificate is the whole-graph
    enclosure): LayerNorm's constant on the ball from a lower bound on each token's centred
    norm, an activation's largest slope over its input range."""
    x = args[0] if args else None
    if not isinstance(x, LocalValue):
        return None
    if node.op_type == "LayerNormalization" and isinstance(args[1], np.ndarray):
        d = x.shape[-1]
        eps = decimal_attr(float(node.attrs.get("epsilon", 1e-5)))
        pc = x.center - x.center.mean(axis=-1, keepdims=True)
        cn = np.sqrt(np.square(pc).sum(axis=-1)) * (1 - 4 * U)  # ||P x0_i||, rounded down
        rho = np.sqrt(np.square(x.rad).sum(axis=-1)) * (1 + 4 * U)  # ||x - x0|| per token
        low = np.maximum(cn - rho, 0.0)
        sigma = np.sqrt((low * low / d + eps) * (1 - 4 * U)) * (1 - 2 * U)
        gmax = float(np.abs(args[1]).max())
        f = float(np.max(gmax / sigma)) * (1 + 8 * U)
        if norm == "inf":
            f = mul_up(f, sqrt_up(d))
        return ("layernorm", f, "local LayerNorm: max|gamma| / sqrt(max(0, ||P x0|| - rho)^2"
                "/D + eps) per token" + (" x sqrt(D) (inf)" if norm == "inf" else ""))
    op = activation(node.op_type, node.attrs)  # lsa_models/operators/
    if op is None:
        return None
    try:
        dlo, dhi = op.d1_range(x.lo, x.hi)
    except ModeNotImplemented:
        return None
    f = float(np.max(np.maximum(np.abs(dlo), np.abs(dhi)))) * (1 + LIBM_REL) + 1e-300
    return (f"activation:{op.kind}", f, f"local {op.kind}: largest slope over the input's range")
