"""The ONNX front end: lower a graph to the layer graph and run the bound engine over it.

The recognised composites (attention layers, GELU written out in its Erf or tanh form,
decomposed LayerNorm / RMSNorm: patterns.py) become the engine's typed layers, bounded by the
families the native front end uses (lsa_models/bounds/layer_graph), so an exported native
model gets the native numbers; every other node that depends on the input is an `OpNode`
layer, bounded by its op's rule (the `ops` package). Values carry the Lipschitz constant from the
model input (`Value`, which the op rules call `Flow`), composed `mul_up(L, f)`; sums add
(residuals: `L + L Lip(g)`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ..bounds.layer_graph import (
    Activation,
    Context,
    DPAttention,
    L2Attention,
    Layer,
    LayerGraph,
    Norm,
    OpNode,
    Refused,
    Value,
    Verdicts,
    run,
)
from ..bounds.layer_graph.families import Family, register_family
from ..bounds.report import BoundResult, LayerBound, NormName, Verdict
from ..loaded import fixed_seq_len
from ..operators import ACTIVATIONS
from .errors import DynamicSeqLenError
from .graph import GraphInfo
from .loading import OnnxModel
from .ops import OPS, Flow, Node, NotCertified
from .patterns import Composite, find_composites

METHOD = ("analytic on the ONNX graph: recognised attention (Theorem 3.2 for tied L2; the "
          "docs/bounds.md ball bound for dot-product with a radius), LayerNorm/linear/"
          "activation rules per node, composition; float64 with upward rounding")

_REPORTED = {"MatMul": "linear", "Gemm": "linear", "LayerNormalization": "layernorm",
             "Softmax": "softmax",
             **{t: f"activation:{c.kind}" for t, c in ACTIVATIONS.items()}}  # operators/


def resolve_seq_len(model: OnnxModel, seq_len: int | None) -> int:
    fixed = model.spec.seq_len
    if seq_len is None:
        if fixed is None:
            raise DynamicSeqLenError("the graph has a dynamic sequence length: give the length "
                                     "to certify with --seq-len N (the bound depends on N)")
        return fixed
    return fixed_seq_len(seq_len, fixed, model.spec.attention_tokens)


def _method(notes: list[str]) -> str:
    """The method, with the float32 readings the certificate relies on (docs/bounds.md,
    Conventions): it is then a certificate for the exact constants."""
    if not notes:
        return METHOD
    return (f"{METHOD}; certified for the exact constants: " + "; ".join(notes))


def analyse(model: OnnxModel, norm: NormName, seq_len: int | None = None,
            radius: float | None = None) -> BoundResult:
    """Certified bound of the graph's Lipschitz constant on (N, D) inputs (token 2-norms
    <= radius when given), or the verdict why there is none."""
    if norm not in ("2", "inf"):
        raise ValueError(f"unknown norm {norm!r}; use '2' or 'inf'")
    if radius is not None and not (radius >= 0 and math.isfinite(radius)):
        raise ValueError(f"radius must be finite and >= 0, got {radius}")
    n = resolve_seq_len(model, seq_len)
    try:
        info = GraphInfo(model.module, n)
    except (RuntimeError, ValueError, IndexError) as exc:
        raise ValueError(f"the graph cannot be evaluated at sequence length {n}: "
                         f"{' '.join(str(exc).split())[:300]}") from None
    graph, hints = lower(info)
    acc = Verdicts()
    ctx = Context(norm, "mul_up", acc, input_bounded=radius is not None)
    values = run(graph, ctx, Value(1.0, radius, info.shape(graph.input)))
    out = graph.output
    reason = acc.first("not_lipschitz")
    if acc.status() == "not_lipschitz":
        verdict: Verdict = "not_lipschitz"
        upper = None
    elif acc.status() == "not_certified":
        verdict, upper, reason = "not_certified", None, acc.first("not_certified")
        if hints:
            reason = "; ".join(hints + [str(reason)])
    else:
        v = values.get(out)
        verdict = "certified"
        upper = 0.0 if out not in info.var else (v.lip if v is not None else None)
        if upper is None:
            verdict, reason = "not_certified", "the output's bound is unknown"
    return BoundResult(norm=norm, seq_len=n, radius=radius, verdict=verdict, upper=upper,
                       layers=acc.layers, method=_method(acc.notes), reason=reason)


def lower(info: GraphInfo) -> tuple[LayerGraph, list[str]]:
    """The graph as engine layers in graph order (a composite where its first node is), and
    the recognition hints for a not-certified verdict."""
    comps, hints = find_composites(info)
    taken = {nm for c in comps for nm in c.nodes}
    first_of: dict[str, Composite] = {}
    for c in comps:
        first = min(c.nodes, key=lambda nm: info.order[nm])
        first_of[first] = c
    layers: list[Layer] = []
    for node in info.nodes:
        if node.name in first_of:
            layers.append(_composite(first_of[node.name], info))
            continue
        if node.name in taken or node.op_type in ("Shape", "Size"):
            continue
        if not any(i in info.var for i in node.inputs):
            continue
        layers.append(_node(node, info))
    return LayerGraph(layers, info.spec.input_name, info.spec.output_name, "mul_up"), hints


def _const(info: GraphInfo, name: str) -> np.ndarray:
    t = info.env[name]
    return t.detach().to(torch.float64).numpy() if t.is_floating_point() else t.numpy()


def _node(node: Node, info: GraphInfo) -> Layer:
    outs = [o for o in node.outputs if o]
    shape = info.shape(outs[0]) if outs else ()
    consts = {i: _const(info, i) for i in node.inputs if i and i not in info.var}
    return OpNode(node.name, node=node, consts=consts,
                  variables=frozenset(i for i in node.inputs if i in info.var),
                  out_shapes=[info.shape(o) for o in outs],
                  report=_REPORTED.get(node.op_type), inputs=list(node.inputs), outputs=outs,
                  nodes=[node.name], shape=shape)


def _composite(c: Composite, info: GraphInfo) -> Layer:
    shape = info.shape(c.output)
    io: dict[str, Any] = {"inputs": [c.input], "outputs": [c.output], "nodes": c.nodes,
                          "shape": shape}
    if c.kind in ("gelu", "silu"):  # silu: x * Sigmoid(x), docs/bounds.md "Gated MLPs"
        return Activation(c.output, c.kind, **io)
    if c.kind in ("layernorm", "rmsnorm"):  # docs/bounds.md, "RMSNorm"
        assert c.gamma is not None
        width = int(shape[-1]) if shape else 1
        gamma = np.broadcast_to(np.asarray(c.gamma, dtype=np.float64), (width,))
        beta = None if c.beta is None or c.kind == "rmsnorm" else np.broadcast_to(
            np.asarray(c.beta, dtype=np.float64), (width,))
        return Norm(c.output, gamma, beta, c.eps, rms=c.kind == "rmsnorm", **io)
    return _attention(c, io)


def _attention(c: Composite, io: dict[str, Any]) -> Layer:
    """One recognised attention as an engine layer (the weights the theorems need)."""
    a = c.attention
    assert a is not None
    name = f"attention@{a.softmax}"
    if a.kind == "unknown" or a.reason is not None:
        reason = a.reason or f"Softmax node {a.softmax}: unrecognised attention"
        kind = f"{a.kind}_mha" if a.kind != "unknown" else "attention"
        return Refused(name, kind, "not_certified", reason, **io)
    assert a.wq is not None and a.wk is not None and a.wv is not None and a.wo is not None
    # the attention's own token count (N + 1 after a class token), never the input's N
    assert a.n >= 1, f"{name}: recognised without its token count"
    if a.kind == "dp":
        canonical = 1.0 / math.sqrt(a.wq.shape[-1])
        scale = None if a.scale == canonical else a.scale  # None: inv_sqrt_up(d), as native
        return DPAttention(name, a.wq, a.wk, a.wv, a.wo, a.n, scale, a.bq, a.bv, a.bo,
                           notes=list(a.notes),
                           # logits replaced by constants (masked_fill) or a rotated key
                           # bias: the bound without row centring, where the key bias counts
                           bk=a.bk, replaced=a.replaced or a.rotated_key_bias, **io)
    return L2Attention(name, a.wq, a.wv, a.wo, a.n, a.causal,
                       notes=list(a.notes), **io)


@register_family(OpNode)
class OpNodeFamily(Family):
    """A graph node through its op's rule; a single input-dependent operand is bounded from
    a unit input and composed (`Lip(f o g) <= Lip(f) Lip(g)`), several are handed over as
    they are (sums, concatenations). A failed operand fails the node silently (its cause is
    already recorded)."""

    def bound(self, layer: OpNode, args: list[Value | None], ctx: Context
              ) -> list[Value | None]:
        node = layer.node
        real: list[Flow | np.ndarray | None] = []
        for name, v in zip(node.inputs, args, strict=True):
            if not name:
                real.append(None)
            elif name in layer.variables:
                if v is None:
                    return [None] * len(layer.outputs)  # upstream already failed
                real.append(v)
            else:
                real.append(layer.consts[name])
        shapes = layer.out_shapes
        variables = [a for a in real if isinstance(a, Value)]
        try:
            if len(variables) == 1:
                v = variables[0]
                unit = [Value(1.0, a.radius, a.shape) if isinstance(a, Value) else a
                        for a in real]
                local = OPS[node.op_type].bound(node, unit, shapes, ctx.norm)
                if layer.report is not None and local and local[0] is not None:
                    ctx.acc.report(LayerBound(node.name, layer.report, local[0].lip,
                                              nodes=[node.name]))
                return [None if f is None else Value(ctx.compose(v.lip, f.lip), f.radius,
                                                     f.shape) for f in local]
            return OPS[node.op_type].bound(node, real, shapes, ctx.norm)
        except NotCertified as exc:
            ctx.acc.fail("not_certified", str(exc), LayerBound(
                node.name, node.op_type.lower(), None, "not_certified", str(exc), [node.name]))
            return [None] * len(layer.outputs)
