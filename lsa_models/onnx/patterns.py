"""Composite patterns recognised before the per-node rules run: attention layers (attention.py),
GELU written out in its Erf or tanh form, LayerNorm decomposed into ReduceMean/Sub/Pow/Sqrt/Div,
and RMSNorm decomposed into Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul (LLaMA, Qwen).

Each is found by what it computes (checked in float64 at fresh inputs), not by how it is spelled;
the analyser bounds a composite as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..operators.normalization import decimal_attr
from .attention import AttentionLayer, recognise
from .graph import GraphInfo
from .ops import Node


@dataclass
class Composite:
    kind: str  # "attention" | "gelu" | "silu" | "layernorm" | "rmsnorm"
    input: str
    output: str
    nodes: list[str]
    attention: AttentionLayer | None = None
    gamma: np.ndarray | None = None
    beta: np.ndarray | None = None
    eps: float = 0.0


def _gelu_inputs(info: GraphInfo, e: Node) -> list[str]:
    """Candidate GELU inputs x for an Erf (`erf(x / sqrt 2)`) or Tanh
    (`tanh(sqrt(2/pi) (x + 0.044715 x^3))`) node: input-dependent tensors that dominate its
    argument, nearest first."""
    if e.op_type == "Erf":
        pre = info.producer.get(e.inputs[0])
        if pre is None or pre.op_type not in ("Div", "Mul"):
            return []
        x = next((i for i in pre.inputs if i in info.var), None)
        return [] if x is None else [x]
    shape = info.shape(e.inputs[0])
    out, t = [], info.idom.get(e.inputs[0])
    for _ in range(6):  # x^3 and the sums above it are a few ops deep
        if t is None:
            break
        if info.shape(t) == shape:
            out.append(t)
        t = info.idom.get(t)
    return out


def _gelu_patterns(info: GraphInfo) -> list[Composite]:
    """GELU written out elementwise: the Erf form (exact GELU) and the tanh approximation
    (GPT-2's), both bounded by the GELU constant (it covers both: test_bounds_formulas)."""
    out = []
    for e in info.nodes:
        if e.op_type not in ("Erf", "Tanh") or e.inputs[0] not in info.var:
            continue
        approximate = "none" if e.op_type == "Erf" else "tanh"
        for x in _gelu_inputs(info, e):
            found = _gelu_at(info, e, x, approximate)
            if found is not None:
                out.append(found)
                break
    return out


def _gelu_at(info: GraphInfo, e: Node, x: str, approximate: str) -> Composite | None:
    def gelu(v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(v, approximate=approximate)

    # candidate outputs: up to three Add/Mul hops after the Erf/Tanh
    frontier, cands = [e.outputs[0]], []
    for _ in range(3):
        nxt = []
        for t in frontier:
            for c in info.consumers.get(t, []):
                if c.op_type in ("Add", "Mul"):
                    nxt.append(c.outputs[0])
        cands.extend(nxt)
        frontier = nxt
    xv = info.env[x]
    ref = gelu(xv)
    gen = torch.Generator().manual_seed(3)
    for t in reversed(cands):
        if info.shape(t) != tuple(xv.shape):
            continue
        # a loose first look at the reference point (module precision); the identity
        # itself is checked below in float64 at fresh inputs
        if not torch.allclose(info.env[t], ref, rtol=1e-4, atol=1e-5):
            continue
        nodes = info.region(x, t)
        if nodes is None or e.name not in {n.name for n in nodes}:
            continue
        # an elementwise identity: confirm it at fresh inputs, large values included
        fresh = [3.0 * torch.randn(xv.shape, generator=gen, dtype=torch.float64)
                 for _ in range(2)]
        with torch.no_grad():
            if not all(torch.allclose(info.eval_nodes(nodes, {x: f})[t], gelu(f),
                                      rtol=1e-6, atol=1e-9) for f in fresh):
                continue
        return Composite("gelu", x, t, [n.name for n in nodes])
    return None


def _silu_patterns(info: GraphInfo) -> list[Composite]:
    """SiLU written out as `x * Sigmoid(x)` (LLaMA's and Qwen's gated MLP, both exporters):
    the Sigmoid's only reader is the Mul, whose other operand is the Sigmoid's input."""
    out = []
    for s in info.nodes:
        if s.op_type != "Sigmoid" or s.inputs[0] not in info.var:
            continue
        x, sig = s.inputs[0], s.outputs[0]
        cons = [c for c in info.consumers.get(sig, []) if c.name in info.live]
        if len(cons) != 1 or cons[0].op_type != "Mul" or sorted(cons[0].inputs) != sorted(
                [x, sig]) or info.shape(cons[0].outputs[0]) != info.shape(x):
            continue
        out.append(Composite("silu", x, cons[0].outputs[0], [s.name, cons[0].name]))
    return out


def _downstream(info: GraphInfo, t: str, depth: int) -> list[str]:
    """The input-dependent tensors up to `depth` consumer steps below t, nearest first."""
    cands: list[str] = []
    frontier = [t]
    for _ in range(depth):
        frontier = [c.outputs[0] for u in frontier for c in info.consumers.get(u, [])
                    if c.outputs and c.outputs[0] in info.var]
        cands.extend(frontier)
    return list(dict.fromkeys(cands))


def _region_eps(info: GraphInfo, nodes: list[Node]) -> float | None:
    """The epsilon of the region's one Add of a scalar constant (read by `decimal_attr`);
    None without exactly one such Add or when it is <= 0."""
    adds = [n for n in nodes if n.op_type == "Add"
            and any(i not in info.var and info.env[i].numel() == 1 for i in n.inputs)]
    if len(adds) != 1:
        return None
    eps_t = next(i for i in adds[0].inputs if i not in info.var)
    eps = decimal_attr(float(info.env[eps_t].reshape(())))
    return None if eps <= 0 else eps


def _layernorm_patterns(info: GraphInfo) -> list[Composite]:
    out = []
    for r in info.nodes:
        if r.op_type != "ReduceMean" or r.inputs[0] not in info.var:
            continue
        x = r.inputs[0]
        xv = info.env[x].to(torch.float64)
        width = xv.shape[-1]
        for t in reversed(_downstream(info, r.outputs[0], 10)):
            if info.shape(t) != tuple(xv.shape):
                continue
            nodes = info.region(x, t)
            if nodes is None or r.name not in {n.name for n in nodes}:
                continue
            eps = _region_eps(info, nodes)
            if eps is None:
                continue
            z = torch.nn.functional.layer_norm(xv, (width,), eps=eps)
            with torch.no_grad():
                tv = info.eval_nodes(nodes, {x: xv})[t]
            zf = z.reshape(-1, width)
            tf = tv.reshape(-1, width)
            # fit t = gamma z + beta per feature, then verify at fresh inputs
            zc = zf - zf.mean(0)
            denom = (zc * zc).sum(0)
            if bool((denom <= 0).any()):
                continue
            gamma = ((tf - tf.mean(0)) * zc).sum(0) / denom
            beta = tf.mean(0) - gamma * zf.mean(0)
            ok = True
            gen = torch.Generator().manual_seed(5)
            for _ in range(2):
                xs = torch.randn(xv.shape, generator=gen, dtype=xv.dtype)
                with torch.no_grad():
                    env = info.eval_nodes(nodes, {x: xs})
                want = torch.nn.functional.layer_norm(xs, (width,), eps=eps) * gamma + beta
                if not torch.allclose(env[t], want, rtol=1e-6, atol=1e-6):
                    ok = False
                    break
            if not ok:
                continue
            # gamma is fitted in float64: a relative 1e-9 margin covers the fit's rounding
            out.append(Composite("layernorm", x, t, [n.name for n in nodes],
                                 gamma=gamma.numpy() * (1 + 1e-9), beta=beta.numpy(), eps=eps))
            break
    return out


def _squared_input(info: GraphInfo, r: Node) -> str | None:
    """x for a ReduceMean of `x ** 2` (Pow with exponent 2, or Mul(x, x)), else None."""
    sq = info.producer.get(r.inputs[0])
    if sq is None:
        return None
    if sq.op_type == "Mul" and sq.inputs[0] == sq.inputs[1] and sq.inputs[0] in info.var:
        return sq.inputs[0]
    if sq.op_type == "Pow" and sq.inputs[0] in info.var and sq.inputs[1] not in info.var:
        e = info.env[sq.inputs[1]]
        if e.numel() == 1 and float(e.reshape(())) == 2.0:
            return sq.inputs[0]
    return None


def _rms_candidate(info: GraphInfo, r: Node, x: str, t: str,
                   avoid: set[str]) -> Composite | None:
    """The composite when `t = g * x / sqrt(mean(x^2) + eps)` on the region x -> t (g fitted
    per feature, then checked at fresh inputs, large and small)."""
    xv = info.env[x].to(torch.float64)
    if info.shape(t) != tuple(xv.shape):
        return None
    nodes = info.region(x, t)
    if nodes is None or r.name not in {n.name for n in nodes} or \
            avoid & {n.name for n in nodes}:
        return None
    eps = _region_eps(info, nodes)
    if eps is None:
        return None

    def rms(z: torch.Tensor) -> torch.Tensor:  # (..., D)
        return z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + eps)

    width = xv.shape[-1]
    with torch.no_grad():
        zf = rms(xv).reshape(-1, width)
        tf = info.eval_nodes(nodes, {x: xv})[t].reshape(-1, width)
    denom = (zf * zf).sum(0)
    if bool((denom <= 0).any()):
        return None
    gamma = (tf * zf).sum(0) / denom
    gen = torch.Generator().manual_seed(6)
    for scale in (1.0, 1e-3, 30.0):
        xs = scale * torch.randn(xv.shape, generator=gen, dtype=xv.dtype)
        with torch.no_grad():
            got = info.eval_nodes(nodes, {x: xs})[t]
        if not torch.allclose(got, rms(xs) * gamma, rtol=1e-6, atol=1e-9):
            return None
    # gamma is fitted in float64: a relative 1e-9 margin covers the fit's rounding
    return Composite("rmsnorm", x, t, [n.name for n in nodes],
                     gamma=gamma.abs().numpy() * (1 + 1e-9), eps=eps)


def _rmsnorm_patterns(info: GraphInfo, avoid: set[str]) -> list[Composite]:
    """Decomposed RMSNorms on nodes outside `avoid` (an attention layer may start inside one,
    after its cast back to the model dtype: the weight is then part of the projections)."""
    out = []
    for r in info.nodes:
        if r.op_type != "ReduceMean" or r.inputs[0] not in info.var:
            continue
        x = _squared_input(info, r)
        if x is None:
            continue
        for t in reversed(_downstream(info, r.outputs[0], 8)):
            comp = _rms_candidate(info, r, x, t, avoid)
            if comp is not None:
                out.append(comp)
                break
    return out


def find_composites(info: GraphInfo) -> tuple[list[Composite], list[str]]:
    """Every recognised composite (attention first, then GELU and LayerNorm patterns on nodes
    no earlier composite took) and the hints of attention recognised without a region."""
    comps: list[Composite] = []
    hints: list[str] = []
    for a in recognise(info):
        if a.output:
            comps.append(Composite("attention", a.input, a.output, a.nodes, a))
        elif a.reason:
            hints.append(a.reason)  # no region: the generic rules decide, sound either way
    taken = {nm for c in comps for nm in c.nodes}
    for c in _gelu_patterns(info) + _silu_patterns(info) + _layernorm_patterns(info) + \
            _rmsnorm_patterns(info, taken):
        if not taken & set(c.nodes):
            comps.append(c)
            taken |= set(c.nodes)
    return comps, hints
