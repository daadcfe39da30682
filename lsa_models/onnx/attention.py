"""Recognising self-attention layers inside an ONNX graph, by what they compute.

For each Softmax whose input depends on the model input:
1. the layer input X is a tensor dominating the Softmax (every path from the model input to it
   passes through X) that has the token layout (batch, N, width), tried farthest first; the layer
   output Y is reached from `P @ V` through token-wise affine ops (head merge, output
   projection, bias); the layer is the closed region of nodes between X and Y;
2. the logits are tested against `c q_i . k_j + m_ij` (dot product) and
   `-c ||q_i - k_j||^2 + r_i + m_ij` (L2) for every pair of affine (in X) tensors of the
   region, at random inputs: polynomial identities checked at more random points than the
   degrees of freedom of the residual (Schwartz-Zippel), with a tolerance far above float64
   rounding. Nothing is guessed from op names;
3. projections are read off by probing the region with basis inputs in float64 (exact for
   e_k inputs), and each probe is verified at random inputs (token-wise affine).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from ..bounds.numerics import inv_sqrt_up, mul_up
from ..operators.layout import FLOAT_TYPES
from .attention_l2 import finish_l2
from .attention_mask import (
    Found,
    LogitMask,
    check_mask,
    nan_guard,
    read_logit_mask,
    scores_match,
)
from .attention_probe import (
    FIT_MARGIN,
    AttentionLayer,
    NotAttention,
    Probe,
    data_consumers,
    per_head,
    probe_tail,
    token_view,
)
from .attention_rotary import ROTARY_NOTE, unrotate
from .graph import GraphInfo
from .ops import Node

__all__ = ["AttentionLayer", "recognise"]

_LAYOUT = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Dropout", "Flatten",
           "Slice", "Split", "Concat", "Expand"}


def _affine(info: GraphInfo, nodes: list[Node], source: str) -> set[str]:
    """Tensors of the region that are affine functions of `source`."""
    aff = {source}
    for n in nodes:
        vin = [i for i in n.inputs if i in info.var]
        if not vin or not all(i in aff for i in vin):
            continue
        t = n.op_type
        if t == "MatMul" or t == "Mul" or t == "Einsum":
            # Einsum: multilinear, so linear in its one input-dependent operand
            ok = len(vin) == 1 and (t != "Einsum" or n.inputs.count(vin[0]) == 1)
        elif t == "Gemm" or t == "Div":
            ok = vin == [n.inputs[0]]
        elif t == "Gather":
            ok = n.inputs[1] not in info.var
        elif t == "Cast":
            ok = int(n.attrs.get("to", 0)) in FLOAT_TYPES
        else:
            ok = t in _LAYOUT or t in ("Add", "Sub", "Neg")
        if ok:
            aff.update(o for o in n.outputs if o)
    return aff


def _ancestors(info: GraphInfo, t: str, stop: str) -> set[str]:
    seen: set[str] = set()
    stack = [t]
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        if x == stop or x not in info.producer:
            continue
        stack.extend(i for i in info.producer[x].inputs if i in info.var)
    return seen


def _through_noops(info: GraphInfo, t: str) -> str:
    """Follow single-consumer ops that leave the values alone: a float -> float Cast (GPT-2's
    TorchScript export casts the probabilities to their own dtype), Identity, Dropout."""
    while True:
        cons = data_consumers(info, t)
        if len(cons) != 1:
            return t
        c = cons[0]
        noop = c.op_type in ("Identity", "Dropout") or (
            c.op_type == "Cast" and int(c.attrs.get("to", 0)) in FLOAT_TYPES)
        if not noop or not c.outputs or not c.outputs[0]:
            return t
        t = c.outputs[0]


def _find_output(info: GraphInfo, start: str, n: int) -> str:
    """Follow token-wise affine single-consumer ops from `P @ V` to the layer output."""
    t, last_token = start, None
    outputs = {o.name for o in info.spec.model.graph.output}
    while True:
        if info.is_token(t, n):
            last_token = t
        cons = data_consumers(info, t)
        if len(cons) != 1 or t in outputs:
            break
        c = cons[0]
        vin = [i for i in c.inputs if i in info.var]
        if len(vin) != 1:
            break
        if c.op_type in ("MatMul",) and c.inputs[0] != t:
            break
        if c.op_type == "Gemm" and c.inputs[0] != t:
            break
        if c.op_type == "Einsum" and c.inputs.count(t) != 1:
            break
        if c.op_type not in _LAYOUT | {"MatMul", "Gemm", "Add", "Sub", "Mul", "Div",
                                       "Einsum"} or \
                c.op_type in ("Concat", "Split", "Expand"):
            break
        if c.op_type == "Div" and c.inputs[0] != t:
            break
        t = c.outputs[0]
    if last_token is None:
        raise NotAttention("the attention output never returns to the token layout "
                            "(batch, N, width)")
    return last_token


def _row_normalise(a: np.ndarray, j0: np.ndarray) -> np.ndarray:
    ref = np.take_along_axis(a, j0[..., None], axis=-1)
    return a - ref


def _fit(ls: list[np.ndarray], gs: list[np.ndarray], finite: np.ndarray,
         j0: np.ndarray) -> tuple[np.ndarray, np.ndarray, float] | None:
    """Per-head c with `L = c G + R`, R the same at every sample (after removing a per-row
    constant). Returns (c, R, err) or None; err bounds the relative error of c that the
    evaluation's rounding (the residual of the fit) can explain, times 10."""
    dl = [np.where(finite, _row_normalise(np.where(finite, lg, 0.0), j0), 0.0) for lg in ls]
    dg = [np.where(finite, _row_normalise(np.broadcast_to(g, lg.shape), j0), 0.0)
          for g, lg in zip(gs, ls, strict=True)]
    heads = dl[0].shape[0]
    diffs = [(dl[s] - dl[0], dg[s] - dg[0]) for s in range(1, len(ls))]
    num_h = sum((ddl * ddg).reshape(heads, -1).sum(axis=1) for ddl, ddg in diffs)
    den_h = sum((ddg * ddg).reshape(heads, -1).sum(axis=1) for _, ddg in diffs)
    # tolerances scale with how much the logits vary between samples, not with their size: a
    # large constant (a mask of -1e9) would otherwise let any c pass
    scale = max(float(np.abs(ddl).max()) for ddl, _ in diffs) + 1e-300
    if np.any(den_h <= 1e-20 * scale * scale):
        return None
    c = num_h / den_h
    res = [d - c[:, None, None] * g for d, g in zip(dl, dg, strict=True)]
    for r in res[1:]:
        if not np.max(np.abs(r - res[0])) <= 1e-7 * scale:
            return None
    # c - c_true = sum(e ddg) / sum(ddg^2) for the noise e of the differences: bounded by
    # max|e| sum|ddg| / sum(ddg^2), with the observed residual standing in for max|e|
    err = 0.0
    for ddl, ddg in diffs:
        resid = np.abs(ddl - c[:, None, None] * ddg).reshape(heads, -1).max(axis=1)
        l1 = np.abs(ddg).reshape(heads, -1).sum(axis=1)
        rel = resid * l1 / den_h / np.maximum(np.abs(c), 1e-300)
        err = max(err, 10.0 * float(rel.max()))
    return c, res[0], err


def recognise(info: GraphInfo) -> list[AttentionLayer]:
    layers = []
    for node in info.nodes:
        if node.op_type != "Softmax" or node.inputs[0] not in info.var:
            continue
        layers.append(_recognise_one(info, node))
    return layers


_TOKEN_AFFINE = _LAYOUT | {"MatMul", "Gemm", "Add", "Sub", "Mul", "Div", "Neg"}


_WALKS = 4  # token chains tried per Softmax, nearest the logits first


def _input_candidates(info: GraphInfo, logits: str, n: int) -> list[str]:
    """Token tensors dominating the logits, farthest first: up the dominator tree through
    token-wise affine ops (projections), up to the first tensor made otherwise (a LayerNorm,
    a residual sum, the model input). Then, tried last, the same walk once more above that
    tensor, and again above that: with one sequence a tensor of pairwise terms (1, N, N) has
    the token layout of an (N, D) input, and the layer input lies above it."""
    out: list[str] = []
    chain = _token_chain(info, info.idom.get(logits), n)
    # a few walks: torch's cdist spells `||q_i - q_j||` through several pairwise (N, N)
    # tensors (ReduceSum, Pow, Pow), each of token layout on one sequence
    for _ in range(_WALKS):
        if not chain:
            break
        out += chain[::-1]
        chain = _token_chain(info, info.idom.get(chain[-1]), n)
    return out


def _token_chain(info: GraphInfo, x: str | None, n: int) -> list[str]:
    chain: list[str] = []
    while x is not None:
        if info.is_token(x, n):
            chain.append(x)
            prod = info.producer.get(x)
            if prod is None or prod.op_type not in _TOKEN_AFFINE or \
                    sum(i in info.var for i in prod.inputs) != 1:
                break
        x = info.idom.get(x)
    return chain


def _recognise_one(info: GraphInfo, sm: Node) -> AttentionLayer:
    logits = sm.inputs[0]
    n = _token_count(info, logits)
    tried: list[AttentionLayer] = []
    for x in _input_candidates(info, logits, n) or [""]:
        layer = AttentionLayer(sm.name, "", "", [sm.name])
        try:
            if not x:
                raise NotAttention("no tensor of token layout dominates it")
            _analyse(info, sm, logits, x, layer, n)
        except (NotAttention, ValueError, RuntimeError, IndexError, KeyError) as exc:
            # anything unexpected while probing means: not recognised (never a crash)
            layer.kind = "unknown"
            layer.reason = f"Softmax node {sm.name} is not a recognised attention layer: {exc}"
        if layer.kind != "unknown" and layer.reason is None:
            return layer
        tried.append(layer)
    known = [t for t in tried if t.kind != "unknown"]
    return known[0] if known else tried[0]


def _token_count(info: GraphInfo, logits: str) -> int:
    """The tokens the attention sees: the logits' key axis when they are square and have the
    token layout's rank, else the graph's N (refused later, with the shape named). A class
    (and distillation) token concatenated to the input makes it N + 1 (N + 2); the bound must
    then use that count, never the graph input's N (docs/bounds.md, "Class tokens")."""
    s = info.shape(logits)
    if len(s) >= 2 and s[-1] == s[-2] and s[-1] >= 1:
        return int(s[-1])
    return info.seq_len


@dataclass
class _Region:
    """What the first steps find: the logits' layout, P @ V, and the layer's closed region."""

    n: int
    g_l: int  # groups (batch x heads) of the logits
    v_name: str  # V in P @ V
    o_name: str  # P @ V
    y: str  # layer output
    nodes: list[Node]
    aff: set[str]  # tensors of the region affine in X
    guard: str | None = None  # output of a NaN guard Where(IsNaN(P), c, P) read as P


def _analyse(info: GraphInfo, sm: Node, logits: str, x: str, layer: AttentionLayer,
             n_tokens: int) -> None:
    """Recognise the attention at Softmax `sm` over `n_tokens` tokens with layer input `x`
    and fill `layer`."""
    reg = _region(info, sm, logits, x, layer, n_tokens)
    cands = _projection_candidates(info, reg, logits, x)
    # a constant added to the logits (a mask written as a large finite negative number, as
    # the dynamo exporter does for causal attention) swamps the fit numerically: DP attention
    # allows any constant additive mask, so its fit may also run on the logits without it
    scores = _strip_constant_terms(info, logits)
    mask = read_logit_mask(info, logits, reg.n)
    probe = Probe(info, reg.nodes, x, [logits, scores, mask.scores, reg.v_name],
                  [t for t, _ in cands] + [reg.v_name], reg.n)
    if probe.exact_exponents:
        layer.notes.append("Pow(Pow(s, e), p) with e p within 1e-6 of 1 (a float32 spelling "
                           "of cdist's square root) is read as the exact s")
    gen = np.random.default_rng(1234)
    xs = [gen.standard_normal(probe.shape) for _ in range(2)]  # the fit needs two
    envs = [probe.run(xi) for xi in xs]
    ls, finite = _sampled_logits(envs, logits, reg.n)
    if mask.replaces:  # masked_fill with a finite constant: docs/bounds.md
        found = _find_replaced_form(envs, mask, cands, reg)
    else:
        found = _find_form(envs, logits, scores, ls, finite, cands, reg, info.var)
    if mask.replaces or reg.guard:
        check_mask(info, envs, mask, found, reg.n, reg.guard)
    kind, a, b, (c, resid, fit_err) = found
    layer.kind = kind
    layer.replaced = mask.replaces
    g = ls[0].shape[0]
    n = layer.n = reg.n
    causal_mask = np.tril(np.ones((n, n), dtype=bool))
    layer.causal = bool(np.array_equal(finite, np.broadcast_to(causal_mask, finite.shape))) \
        and not finite.all()
    (wa, ba), (wb, bb) = _read_projections(info, reg, probe, envs, xs, kind, a, b, layer)
    layer.wq, layer.bq = per_head(wa, g), per_head(ba, g)
    layer.wk, bk = per_head(wb, g), per_head(bb, g)
    layer.bk = bk
    # the output projection: the tail from P @ V to Y, probed per token
    layer.wo, layer.bo, heads_o = probe_tail(info, reg.nodes, reg.o_name, reg.y, n)
    if kind == "dp":
        _finish_dp(probe, envs, xs, reg, layer, c, fit_err, heads_o)
        return
    layer.tied = bool(a == b or (np.array_equal(layer.wq, layer.wk)
                                 and np.array_equal(layer.bq, bk)))
    finish_l2(probe, envs, xs, reg.v_name, layer, (c, resid, ls, finite), heads_o)


def _read_projections(info: GraphInfo, reg: _Region, probe: Probe,
                      envs: list[Mapping[str, Tensor]], xs: list[np.ndarray], kind: str,
                      a: tuple[str, bool], b: tuple[str, bool], layer: AttentionLayer
                      ) -> list[tuple[np.ndarray, np.ndarray]]:
    """The query and key projections; for dot-product attention whose query/key is a
    per-position rotation of a projection (rotary embeddings), the projection it rotates,
    with the rotations' certified norm in `layer.position_factor` (docs/bounds.md, "Rotary
    position embeddings")."""
    try:
        return probe.affine([a, b], envs, xs)
    except NotAttention:
        if kind != "dp":
            raise
    out, factor = [], 1.0
    for is_key, t in ((False, a), (True, b)):
        try:
            out += probe.affine([t], envs, xs)
            continue
        except NotAttention:
            pass
        (w, bias), rho = unrotate(info, reg.nodes, reg.aff, probe, envs, xs, t)
        if is_key and np.abs(bias).max() > 0:
            # the bias rotates with the key's position (no row constant): the bound without
            # the row centring, where ||b^K|| counts (docs/bounds.md, "Rotary position
            # embeddings")
            layer.rotated_key_bias = True
        out.append((w, bias))
        factor = mul_up(factor, rho)
    layer.position_factor = factor
    if ROTARY_NOTE not in layer.notes:
        layer.notes.append(ROTARY_NOTE)
    return out


def _region(info: GraphInfo, sm: Node, logits: str, x: str, layer: AttentionLayer,
            n: int) -> _Region:
    """Step 1: the logits' layout, `P @ V` (through no-op casts) and the layer output Y; the
    layer is the closed region of nodes between X and Y."""
    shape_l = info.shape(logits)
    if len(shape_l) < 2 or shape_l[-1] != shape_l[-2] or shape_l[-1] != n:
        raise NotAttention(f"its input {logits} of shape {tuple(shape_l)} is not an N x N "
                           f"logits tensor (N = {n}) with the keys on the last axis")
    axis = int(sm.attrs.get("axis", -1)) % len(shape_l)
    if axis != len(shape_l) - 1:
        raise NotAttention("the softmax is not over the last (key) axis")
    p = _through_noops(info, sm.outputs[0])
    guard = nan_guard(info, p)  # torch's where(isnan(P), 0, P): proved an identity later
    if guard is not None:
        p = _through_noops(info, guard)
    cons = data_consumers(info, p)
    pv = [c for c in cons if c.op_type == "MatMul" and c.inputs[0] == p]
    if len(cons) != 1 or len(pv) != 1 or pv[0].inputs[1] not in info.var:
        used = ", ".join(f"{c.op_type} node {c.name}" for c in cons) or "nothing"
        raise NotAttention(f"its probabilities are not used only as P @ V (a MatMul with P "
                           f"first); they feed {used}")
    v_name, o_name = pv[0].inputs[1], pv[0].outputs[0]
    y = _find_output(info, o_name, n)
    nodes = info.region(x, y)
    if nodes is None:
        raise NotAttention(f"the nodes between {x} and {y} also read or feed other "
                           "input-dependent tensors")
    layer.input, layer.output = x, y
    layer.nodes = [nd.name for nd in nodes]
    return _Region(n, int(np.prod(shape_l[:-2])), v_name, o_name, y, nodes,
                   _affine(info, nodes, x), guard)


def _projection_candidates(info: GraphInfo, reg: _Region, logits: str,
                           x: str) -> list[tuple[str, bool]]:
    """Step 2: affine (in X) tensors feeding the logits with N rows (or N columns:
    transposed), in graph order: the candidates for q and k."""
    anc = _ancestors(info, logits, x)
    cands: list[tuple[str, bool]] = []
    for t in sorted(anc & reg.aff, key=lambda t: info.order.get(info.producer[t].name, -1)
                    if t in info.producer else -1):
        s = info.shape(t)
        if len(s) < 2:
            continue
        for tr in (False, True):
            rows = s[-1] if tr else s[-2]
            g = int(np.prod(s[:-2]))
            if rows == reg.n and g in (1, reg.g_l):
                cands.append((t, tr))
    if not cands:
        raise NotAttention("no affine projection of the layer input feeds the logits")
    return cands


def _sampled_logits(envs: list[Mapping[str, Tensor]], logits: str,
                    n: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Step 3: the logits (G, N, N) at the samples and their finite (unmasked) entries."""
    ls = [e[logits].detach().numpy().reshape(-1, n, n) for e in envs]
    finite = np.isfinite(ls[0])
    if any(not np.array_equal(np.isfinite(lg), finite) for lg in ls):
        raise NotAttention("its mask depends on the input")
    if not finite.any(axis=-1).all():
        raise NotAttention("a row of its mask hides every key")
    return ls, finite


def _find_form(envs: list[Mapping[str, Tensor]], logits: str, scores: str,
               ls: list[np.ndarray], finite: np.ndarray, cands: list[tuple[str, bool]],
               reg: _Region, var: set[str]) -> tuple[str, tuple[str, bool], tuple[str, bool],
                                      tuple[np.ndarray, np.ndarray, float]]:
    """Step 4: the polynomial identity the logits satisfy (dot product or L2 distance)."""
    n = reg.n
    views = {c: [token_view(e[c[0]], n, c[1]) for e in envs] for c in cands}
    found = None
    if scores != logits:  # DP first on the logits without their constant: a cleaner fit
        ss = [e[scores].detach().numpy().reshape(-1, n, n) for e in envs]
        if all(np.isfinite(sc).all() for sc in ss):
            found = _search(ss, np.ones(ss[0].shape, dtype=bool), views, cands, reg.g_l,
                            ("dp",))
    if found is None:
        found = _search(ls, finite, views, cands, reg.g_l, ("dp", "l2"))
    if found is None:
        raise NotAttention("its logits are neither a scaled dot product nor a negative "
                           "squared L2 distance of projections of the layer input"
                           + _where_hint(envs[0], logits, reg, var))
    return found


def _find_replaced_form(envs: list[Mapping[str, Tensor]], mask: LogitMask,
                        cands: list[tuple[str, bool]], reg: _Region) -> Found:
    """Step 4 when the logits replace some entries by constants: the scores under the Where
    must be `c q_i . k_j` plus a constant at every entry (no input-dependent row term: with
    replaced entries it would not drop out of the softmax), for the projections found."""
    n = reg.n
    ss = [e[mask.scores].detach().numpy().reshape(-1, n, n) for e in envs]
    found = None
    if all(np.isfinite(sc).all() for sc in ss):
        views = {c: [token_view(e[c[0]], n, c[1]) for e in envs] for c in cands}

        def exact(f: Found) -> bool:
            return scores_match(envs, mask, (views[f[1]], views[f[2]]), f[0],
                                np.asarray(f[3][0]), n, False)

        found = _search(ss, np.ones(ss[0].shape, dtype=bool), views, cands, reg.g_l, ("dp",),
                        exact)
    if found is None:
        raise NotAttention(f"Where node {mask.wheres[-1]} replaces logits by constants, and "
                           f"the scores {mask.scores} under it are not c q_i . k_j (a scaled "
                           "dot product of projections of the layer input) plus a constant; "
                           "only that form is covered with replaced logits: mask with "
                           "float('-inf') or add the mask instead")
    return found


def _where_hint(env: Mapping[str, Tensor], logits: str, reg: _Region, var: set[str]) -> str:
    """A mask applied by replacing logits with a finite constant (`masked_fill(mask,
    -finfo.max)`, as x-transformers does) is not an additive mask: say so, and how to fix it."""
    prod = next((nd for nd in reg.nodes if logits in nd.outputs), None)
    if prod is None or prod.op_type != "Where":
        return ""
    fills = [env[i] for i in prod.inputs[1:] if i and i not in var]
    if not fills or any(bool(f.isinf().all()) for f in fills):
        return ""
    return (f" (Where node {prod.name} replaces masked logits by a finite constant; mask "
            "with float('-inf') or add the mask instead)")


def _finish_dp(probe: Probe, envs: list[Mapping[str, Tensor]], xs: list[np.ndarray],
               reg: _Region, layer: AttentionLayer, c: np.ndarray, fit_err: float,
               heads_o: int) -> None:
    """Dot-product attention: the values and the certified scale."""
    if reg.v_name not in reg.aff:
        raise NotAttention("its values are not an affine map of the layer input")
    assert layer.wq is not None
    ((wv, bv),) = probe.affine([(reg.v_name, False)], envs, xs)
    layer.wv, layer.bv = per_head(wv, heads_o), per_head(bv, heads_o)
    scale = float(np.abs(c).max())
    canonical = 1.0 / math.sqrt(layer.wq.shape[-1])
    if scale <= canonical and scale >= canonical * (1 - 1e-6):
        # float32 spellings of 1/sqrt(d) (e.g. sqrt(sqrt(1/d)) on both sides) land just
        # below it: the canonical, larger scale is still an upper bound (docs/bounds.md)
        scale = canonical
    else:
        # the fitted scale carries the evaluation's rounding (~1e-15 relative, more
        # when large constants sit in the logits): certify a slightly larger one
        scale = math.nextafter(scale * (1 + max(FIT_MARGIN, fit_err)), math.inf)
    if layer.position_factor != 1.0:
        # rotary: ||R_i||_2 <= rho for queries and keys scales the logit term by rho_q rho_k,
        # folded into the scale; from 1/sqrt(d) rounded up, as the analyser would use
        base = inv_sqrt_up(layer.wq.shape[-1]) if scale == canonical else scale
        scale = mul_up(base, layer.position_factor)
    layer.scale = scale


def _search(ls: list[np.ndarray], finite: np.ndarray,
            views: dict[tuple[str, bool], list[np.ndarray]], cands: list[tuple[str, bool]],
            g_l: int, kinds: tuple[str, ...],
            accept: Callable[[Found], bool] | None = None
            ) -> tuple[str, tuple[str, bool], tuple[str, bool],
                       tuple[np.ndarray, np.ndarray, float]] | None:
    """The first (kind, a, b, fit) whose projections a, b explain the sampled logits `ls`
    (and that `accept` accepts, when given)."""
    j0 = np.argmax(finite, axis=-1)
    for kind in kinds:
        for a in cands:
            for b in cands:
                va, vb = views[a], views[b]
                if va[0].shape[-1] != vb[0].shape[-1]:
                    continue
                # products of views shared by every group (G = 1) are computed once and
                # broadcast (`_fit` broadcasts them to the logits' groups): the same values,
                # without G identical (N x w) @ (w x N) products per pair
                if kind == "dp":
                    gs = [qa @ np.swapaxes(kb, 1, 2) for qa, kb in zip(va, vb, strict=True)]
                else:
                    gs = [-(np.square(qa).sum(-1)[:, :, None] - 2 * (qa @ np.swapaxes(kb, 1, 2))
                            + np.square(kb).sum(-1)[:, None, :])
                          for qa, kb in zip(va, vb, strict=True)]
                gs = [np.broadcast_to(gg, (g_l, *gg.shape[1:])) for gg in gs]
                fit = _fit(ls, gs, finite, j0)
                if fit is not None and (accept is None or accept((kind, a, b, fit))):
                    return kind, a, b, fit
    return None


def _strip_constant_terms(info: GraphInfo, logits: str) -> str:
    """The tensor the logits are made from by adding (or subtracting) input-independent
    tensors of the same shape: `scores` in `logits = scores + mask`."""
    t = logits
    while (prod := info.producer.get(t)) is not None and prod.op_type in ("Add", "Sub"):
        ins = [i for i in prod.inputs if i]
        var_in = [i for i in ins if i in info.var]
        if len(ins) != 2 or len(var_in) != 1 or (prod.op_type == "Sub" and var_in[0] != ins[0]):
            break
        if info.shape(var_in[0]) != info.shape(t):
            break
        t = var_in[0]
    return t

