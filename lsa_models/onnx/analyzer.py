"""The certified bound of an ONNX graph: patterns first, then one rule per node.

Walks the nodes in graph order carrying a `Flow` (Lipschitz constant from the model input,
token-norm bound) for every input-dependent tensor. Recognised composites (attention layers,
GELU written out in its Erf or tanh form, decomposed LayerNorm) are bounded as a whole with
the formulas the native analyser uses (lsa_models/bounds/formulas.py), so an exported native
model gets the same number; every other node goes through its op's rule (the `ops` package).
Composition follows bounds/rules.py: `Lip(f o g) <= Lip(f) Lip(g)`, sums add (residuals:
1 + Lip(g)).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..bounds.formulas import dp_mha_ball, l2_mha_bound
from ..bounds.numerics import ACTIVATION_LIPSCHITZ, mul_up, up
from ..bounds.report import BoundResult, LayerBound, NormName, Verdict
from .graph import GraphInfo
from .loading import DynamicSeqLenError, OnnxModel
from .ops import OPS, Flow, Node, NotCertified, layernorm_flow, rmsnorm_flow
from .ops.base import SILU_LIPSCHITZ
from .patterns import Composite, find_composites

METHOD = ("analytic on the ONNX graph: recognised attention (Theorem 3.2 for tied L2; the "
          "docs/bounds.md ball bound for dot-product with a radius), LayerNorm/linear/"
          "activation rules per node, composition; float64 with upward rounding")

_REPORTED = {"MatMul": "linear", "Gemm": "linear", "Relu": "activation:relu",
             "Tanh": "activation:tanh", "Sigmoid": "activation:sigmoid",
             "Gelu": "activation:gelu", "Erf": "activation:erf",
             "LayerNormalization": "layernorm", "Softmax": "softmax"}


def resolve_seq_len(model: OnnxModel, seq_len: int | None) -> int:
    fixed = model.spec.seq_len
    if seq_len is None:
        if fixed is None:
            raise DynamicSeqLenError("the graph has a dynamic sequence length: give the length "
                                     "to certify with --seq-len N (the bound depends on N)")
        return fixed
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if fixed is not None and seq_len != fixed:
        raise ValueError(f"seq_len={seq_len} differs from the graph's fixed sequence length "
                         f"{fixed}")
    return seq_len




class _State:
    def __init__(self) -> None:
        self.not_lipschitz: str | None = None
        self.not_certified: str | None = None
        self.layers: list[LayerBound] = []
        self.notes: list[str] = []  # float32 readings relied on (`_method`)

    def fail(self, status: Verdict, reason: str, layer: LayerBound | None = None) -> None:
        if status == "not_lipschitz" and self.not_lipschitz is None:
            self.not_lipschitz = reason
        if status == "not_certified" and self.not_certified is None:
            self.not_certified = reason
        if layer is not None:
            self.layers.append(layer)


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
    comps, hints = find_composites(info)
    taken = {nm for c in comps for nm in c.nodes}
    first_of: dict[str, Composite] = {}
    for c in comps:
        first = min(c.nodes, key=lambda nm: info.order[nm])
        first_of[first] = c
    st = _State()
    flows: dict[str, Flow | None] = {model.spec.input_name: Flow(
        1.0, radius, info.shape(model.spec.input_name))}
    for node in info.nodes:
        if node.name in first_of:
            _composite(first_of[node.name], info, flows, st, norm)
            continue
        if node.name in taken or node.op_type in ("Shape", "Size"):
            continue
        if not any(i in info.var for i in node.inputs):
            continue
        _node(node, info, flows, st, norm)
    out = model.spec.output_name
    if st.not_lipschitz is not None:
        verdict: Verdict = "not_lipschitz"
        upper, reason = None, st.not_lipschitz
    elif st.not_certified is not None:
        verdict, upper, reason = "not_certified", None, st.not_certified
        if hints:
            reason = "; ".join(hints + [st.not_certified])
    else:
        flow = flows.get(out)
        verdict, reason = "certified", None
        upper = 0.0 if out not in info.var else (flow.lip if flow is not None else None)
        if upper is None:
            verdict, reason = "not_certified", "the output's bound is unknown"
    return BoundResult(norm=norm, seq_len=n, radius=radius, verdict=verdict, upper=upper,
                       layers=st.layers, method=_method(st.notes), reason=reason)


def _args(node: Node, info: GraphInfo, flows: dict[str, Flow | None]) -> list | None:
    args: list[Flow | np.ndarray | None] = []
    for i in node.inputs:
        if not i:
            args.append(None)
        elif i in info.var:
            f = flows.get(i)
            if f is None:
                return None  # upstream already failed
            args.append(f)
        else:
            args.append(info.env[i].detach().to(torch.float64).numpy()
                        if info.env[i].is_floating_point() else info.env[i].numpy())
    return args


def _node(node: Node, info: GraphInfo, flows: dict[str, Flow | None], st: _State,
          norm: NormName) -> None:
    args = _args(node, info, flows)
    outs = [o for o in node.outputs if o]
    if args is None:
        for o in outs:
            flows[o] = None
        return
    shapes = [info.shape(o) for o in outs]
    variables = [a for a in args if isinstance(a, Flow)]
    try:
        if len(variables) == 1:
            # local constant with a unit input, then composed: Lip(f o g) <= Lip(f) Lip(g)
            v = variables[0]
            unit = [Flow(1.0, a.radius, a.shape) if isinstance(a, Flow) else a for a in args]
            local = OPS[node.op_type].bound(node, unit, shapes, norm)
            result = [None if f is None else Flow(mul_up(v.lip, f.lip), f.radius, f.shape)
                      for f in local]
            if node.op_type in _REPORTED and local and local[0] is not None:
                kind = _REPORTED[node.op_type]
                st.layers.append(LayerBound(node.name, kind, local[0].lip, nodes=[node.name]))
        else:
            result = OPS[node.op_type].bound(node, args, shapes, norm)
    except NotCertified as exc:
        st.fail("not_certified", str(exc), LayerBound(node.name, node.op_type.lower(), None,
                                                      "not_certified", str(exc), [node.name]))
        result = [None] * len(outs)
    for o, f in zip(outs, result, strict=False):
        flows[o] = f


def _composite(c: Composite, info: GraphInfo, flows: dict[str, Flow | None], st: _State,
               norm: NormName) -> None:
    fx = flows.get(c.input)
    shape = info.shape(c.output)
    if c.kind in ("gelu", "silu"):  # silu: x * Sigmoid(x), |silu(x)| <= |x| (recoglayout)
        local = ACTIVATION_LIPSCHITZ["gelu"] if c.kind == "gelu" else SILU_LIPSCHITZ
        st.layers.append(LayerBound(c.output, f"activation:{c.kind}", local, nodes=c.nodes))
        flows[c.output] = None if fx is None else Flow(
            mul_up(fx.lip, local), None if fx.radius is None else mul_up(local, fx.radius),
            shape)
        return
    if c.kind == "layernorm":
        assert c.gamma is not None
        f = layernorm_flow(Flow(1.0, None, shape), c.gamma, c.beta, c.eps, norm, shape)
        st.layers.append(LayerBound(c.output, "layernorm", f.lip, nodes=c.nodes))
        flows[c.output] = None if fx is None else Flow(mul_up(fx.lip, f.lip), f.radius, shape)
        return
    if c.kind == "rmsnorm":  # docs/bounds.md, "RMSNorm"
        assert c.gamma is not None
        f = rmsnorm_flow(Flow(1.0, None, shape), c.gamma, c.eps, norm, shape)
        st.layers.append(LayerBound(c.output, "rmsnorm", f.lip, nodes=c.nodes))
        flows[c.output] = None if fx is None else Flow(mul_up(fx.lip, f.lip), f.radius, shape)
        return
    a = c.attention
    assert a is not None
    name = f"attention@{a.softmax}"
    if a.kind == "unknown" or a.reason is not None:
        reason = a.reason or f"Softmax node {a.softmax}: unrecognised attention"
        st.fail("not_certified", reason, LayerBound(name, f"{a.kind}_mha" if a.kind != "unknown"
                                                    else "attention", None, "not_certified",
                                                    reason, c.nodes))
        flows[c.output] = None
        return
    assert a.wq is not None and a.wk is not None and a.wv is not None and a.wo is not None
    # the attention's own token count (N + 1 after a class token), never the input's N
    assert a.n >= 1, f"{name}: recognised without its token count"
    st.notes.extend(nt for nt in a.notes if nt not in st.notes)
    if a.kind == "dp":
        r = None if fx is None else fx.radius
        if r is None:
            inp = flows.get(info.spec.input_name)
            status: Verdict
            if inp is not None and inp.radius is not None:
                status = "not_certified"
                reason = (f"{name}: dot-product attention whose input token norms are not "
                          "bounded by the analysis (the radius does not reach it)")
            else:
                status = "not_lipschitz"
                reason = (f"{name}: dot-product attention is not Lipschitz on an unbounded "
                          "domain (Theorem 3.1); give an input radius to bound it on a "
                          "bounded domain")
            st.fail(status, reason, LayerBound(name, "dp_mha", None, status, reason, c.nodes))
            flows[c.output] = None
            return
        assert fx is not None and r is not None
        canonical = 1.0 / math.sqrt(a.wq.shape[-1])
        scale = None if a.scale == canonical else a.scale  # None: inv_sqrt_up(d), as native
        local, out_r = dp_mha_ball(a.wq, a.wk, a.wv, a.wo, a.n, r, norm, scale=scale, bq=a.bq,
                                   bv=a.bv, bo=a.bo,
                                   # recogmask: logits replaced by constants (masked_fill)
                                   bk=a.bk, replaced=a.replaced)
        st.layers.append(LayerBound(name, "dp_mha_radius", local, nodes=c.nodes))
        flows[c.output] = Flow(mul_up(fx.lip, local), out_r, shape)
        return
    local = l2_mha_bound(a.wq, a.wv, a.wo, a.n, norm, a.causal)
    if a.value_factor > 1.0:
        local = mul_up(local, up(a.value_factor))
    kind = "l2_mha_causal" if a.causal else "l2_mha"
    st.layers.append(LayerBound(name, kind, local, nodes=c.nodes))
    flows[c.output] = None if fx is None else Flow(mul_up(fx.lip, local), None, shape)
