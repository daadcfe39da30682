"""Recognising self-attention layers inside an ONNX graph, by what they compute.

For each Softmax whose input depends on the model input:
1. the layer input X is the nearest tensor dominating the Softmax (every path from the model
   input to it passes through X) that has the token layout (batch, N, width); the layer
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
from collections import ChainMap
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch
from torch import Tensor

from .graph import GraphInfo
from .ops import FLOAT_TYPES, OPS, Node, gemm_epilogue

_LAYOUT = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Dropout", "Flatten",
           "Slice", "Split", "Concat", "Expand"}
_TOL = 1e-8
_FIT_MARGIN = 1e-12  # relative allowance for constants fitted by least squares in float64


@dataclass
class AttentionLayer:
    softmax: str
    input: str  # X
    output: str  # Y
    nodes: list[str]
    kind: str = "unknown"  # "dp" | "l2" | "unknown"
    tied: bool | None = None
    causal: bool = False
    reason: str | None = None  # why no certificate (recognition failed, untied, ...)
    wq: np.ndarray | None = None  # (H, D, d)
    bq: np.ndarray | None = None  # (H, d)
    wk: np.ndarray | None = None
    wv: np.ndarray | None = None  # (H, D, dv)
    bv: np.ndarray | None = None
    wo: np.ndarray | None = None  # (H dv, D_out)
    bo: np.ndarray | None = None
    scale: float = 1.0  # DP: max_h |c_h|
    value_factor: float = 1.0  # L2: max_h c'_h sqrt(d) (1.0 for the canonical scale)
    extra: dict[str, float] = field(default_factory=dict)


class _NotAttention(Exception):
    pass


def _affine(info: GraphInfo, nodes: list[Node], source: str) -> set[str]:
    """Tensors of the region that are affine functions of `source`."""
    aff = {source}
    for n in nodes:
        vin = [i for i in n.inputs if i in info.var]
        if not vin or not all(i in aff for i in vin):
            continue
        t = n.op_type
        if t == "MatMul" or t == "Mul":
            ok = len(vin) == 1
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


def _view(v: Tensor, n: int, transposed: bool) -> np.ndarray:
    a = v.detach().numpy()
    if transposed:
        a = np.swapaxes(a, -1, -2)
    return a.reshape(-1, n, a.shape[-1])


def _data_consumers(info: GraphInfo, t: str) -> list[Node]:
    """Consumers that read values (a Shape of a tensor is a constant at a fixed size)."""
    return [c for c in info.consumers.get(t, [])
            if c.op_type not in ("Shape", "Size") and c.name in info.live]


def _find_output(info: GraphInfo, start: str) -> str:
    """Follow token-wise affine single-consumer ops from `P @ V` to the layer output."""
    t, last_token = start, None
    outputs = {o.name for o in info.spec.model.graph.output}
    while True:
        if info.is_token(t):
            last_token = t
        cons = _data_consumers(info, t)
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
        if c.op_type not in _LAYOUT | {"MatMul", "Gemm", "Add", "Sub", "Mul", "Div"} or \
                c.op_type in ("Concat", "Split", "Expand"):
            break
        if c.op_type == "Div" and c.inputs[0] != t:
            break
        t = c.outputs[0]
    if last_token is None:
        raise _NotAttention("the attention output never returns to the token layout "
                            "(batch, N, width)")
    return last_token


class _Probe:
    """Evaluates the region at chosen values of one tensor and reads token-wise affine maps.

    `targets` are the tensors the analysis reads; only the nodes they depend on run (the
    softmax and the output projection are not needed to read the projections). The basis
    probes only read `projections` (not the logits made from them)."""

    def __init__(self, info: GraphInfo, nodes: list[Node], source: str,
                 targets: list[str], projections: list[str]) -> None:
        self.info, self.source = info, source
        self.nodes = info.needed(nodes, targets)
        self.basis_nodes = info.needed(self.nodes, projections)
        actual = info.shape(source)
        self.n = info.seq_len
        self.width = actual[-1]
        # probes are written (batch, N, width); a sequence-first source (N, 1, width) holds
        # the same rows in the same memory order (`GraphInfo.is_token`)
        self.shape = (int(np.prod(actual[:-1])) // self.n, self.n, self.width)
        self._actual = actual
        self._exponents = _exact_exponents(info, self.nodes)

    def run(self, x: np.ndarray, basis: bool = False) -> Mapping[str, Tensor]:
        src = {self.source: torch.from_numpy(x.reshape(self._actual)), **self._exponents}
        if not basis:
            with torch.no_grad():
                return self.info.eval_nodes(self.nodes, src)
        return _eval_unit_rows(self.info, self.basis_nodes, src)

    def _basis_runs(self) -> tuple[Mapping[str, Tensor], list[Mapping[str, Tensor]]]:
        """The region at X = 0 and at the basis inputs (token i of run k is e_{kN+i}); run
        once, every probed tensor is read from the same evaluations."""
        if not hasattr(self, "_runs"):
            n, width = self.n, self.width
            zero = self.run(np.zeros(self.shape), basis=True)
            bases = []
            for k in range(-(-width // n)):
                x = np.zeros(self.shape)
                for i in range(n):
                    if k * n + i < width:
                        x[..., i, k * n + i] = 1.0
                bases.append(self.run(x, basis=True))
            self._runs = (zero, bases)
        return self._runs

    def affine(self, targets: list[tuple[str, bool]], samples: Sequence[Mapping[str, Tensor]],
               sample_inputs: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each (tensor, transposed): W (G, width, w) and b (G, w) with
        view(T(X))[g, i] = x_i W[g] + b[g].

        The region's structure already makes T affine in X (`_affine`); the basis probes read
        its coefficients as if it were token-wise, and one random sample confirms that (a
        map mixing tokens or features differently disagrees there with probability one)."""
        n, width = self.n, self.width
        zero, bases = self._basis_runs()
        results = []
        for name, tr in targets:
            b_all = _view(zero[name], n, tr)  # (G, N, w)
            if not np.allclose(b_all, b_all[:, :1, :], rtol=0, atol=1e-12 * (
                    1 + np.abs(b_all).max())):
                raise _NotAttention(f"tensor {name} is not a token-wise map of the layer input")
            b = b_all[:, 0, :]  # (G, w)
            g, _, w = b_all.shape
            # filled in (width, G, w) order: the check below is then one plain 2-D product
            stacked = np.empty((width, g, w))
            for k, env in enumerate(bases):
                rows = min(n, width - k * n)
                v = _view(env[name], n, tr)[:, :rows, :]  # (G, rows, w)
                np.subtract(v.transpose(1, 0, 2), b_all[:, :rows, :].transpose(1, 0, 2),
                            out=stacked[k * n:k * n + rows])
            got = _view(samples[0][name], n, tr).transpose(1, 0, 2)  # (N, G, w)
            xs = sample_inputs[0].reshape(-1, n, width)[0]  # (N, width)
            pred = (xs @ stacked.reshape(width, g * w)).reshape(n, g, w)
            scale = _check_scale(pred, b)
            pred += b[None, :, :]
            pred -= got
            if not np.abs(pred).max() <= _TOL * scale:
                raise _NotAttention(f"tensor {name} is not a token-wise affine map of the "
                                    "layer input")
            weight = stacked.transpose(1, 0, 2)  # (G, width, w)
            results.append((weight, b))
        return results


_A_RTOL = 2.0 ** -20
_EXPONENT_RTOL = 1e-6  # float32 spellings of 1/p: torch writes cdist's 1/2 as 0.49999976


def _exact_exponents(info: GraphInfo, nodes: list[Node]) -> dict[str, Tensor]:
    """`Pow(Pow(s, e), p)` with a constant p and `e p` within float32 rounding of 1 (torch's
    TorchScript export of `torch.cdist(q, k) ** 2` writes `e = 0.49999976`) is read as the
    exact `s`: the exponent the user wrote (docs/bounds.md, Conventions). The probes evaluate
    with `e = 1/p` exactly; the certificate concerns that model."""
    out: dict[str, Tensor] = {}
    for nd in nodes:
        if nd.op_type != "Pow" or len(nd.inputs) != 2 or nd.inputs[1] in info.var:
            continue
        cons = _data_consumers(info, nd.outputs[0])
        if len(cons) != 1 or cons[0].op_type != "Pow" or cons[0].inputs[0] != nd.outputs[0] \
                or cons[0].inputs[1] in info.var:
            continue
        e, p = info.env[nd.inputs[1]], info.env[cons[0].inputs[1]]
        if e.numel() != 1 or p.numel() != 1:
            continue
        ev, pv = float(e.reshape(())), float(p.reshape(()))
        if pv > 0 and ev * pv != 1.0 and abs(ev * pv - 1.0) <= _EXPONENT_RTOL:
            out[nd.inputs[1]] = torch.full_like(e, 1.0, dtype=torch.float64) / pv
    return out


def _eval_unit_rows(info: GraphInfo, nodes: list[Node],
                    overrides: dict[str, Tensor]) -> Mapping[str, Tensor]:
    """Evaluate `nodes` for probe inputs: a product `T @ W` with a constant W and rows of T
    that are unit vectors or zero is a row gather of W; the same float64 numbers (1 * w,
    0 * w) without the cost of the matrix product."""
    computed: dict[str, Tensor] = {}
    env: MutableMapping[str, Tensor] = ChainMap(
        computed, overrides, cast(MutableMapping[str, Tensor], info.env))
    with torch.no_grad():
        for node in nodes:
            ins = [env[i] if i else None for i in node.inputs]
            out = _gather_product(node, ins, info) if node.op_type in ("MatMul", "Gemm") \
                else None
            outs = [out] if out is not None else OPS[node.op_type].run(node, ins, info.ctx)
            for name, value in zip(node.outputs, outs, strict=False):
                if name:
                    computed[name] = value
    return env


def _gather_product(node: Node, ins: list[Tensor | None], info: GraphInfo) -> Tensor | None:
    a, w = ins[0], ins[1]
    if a is None or w is None or node.inputs[1] in info.var or w.dim() != 2 or a.dim() < 2:
        return None
    gemm = node.op_type == "Gemm"
    if gemm:
        if a.dim() != 2 or node.attrs.get("transA", 0):
            return None
        if node.attrs.get("transB", 0):
            w = w.T
    rows = a.reshape(-1, a.shape[-1])
    nonzero = rows != 0
    counts = nonzero.sum(dim=1)
    if bool((counts > 1).any()) or not bool((rows[nonzero] == 1).all()):
        return None
    idx = rows.argmax(dim=1)
    out = w[idx] * (counts == 1).to(w.dtype)[:, None]
    out = out.reshape(*a.shape[:-1], w.shape[1])
    return gemm_epilogue(node, out, ins) if gemm else out


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


def _input_candidates(info: GraphInfo, logits: str) -> list[str]:
    """Token tensors dominating the logits, farthest first: up the dominator tree through
    token-wise affine ops (projections), up to the first tensor made otherwise (a LayerNorm,
    a residual sum, the model input)."""
    chain: list[str] = []
    x = info.idom.get(logits)
    while x is not None:
        if info.is_token(x):
            chain.append(x)
            prod = info.producer.get(x)
            if prod is None or prod.op_type not in _TOKEN_AFFINE or \
                    sum(i in info.var for i in prod.inputs) != 1:
                break
        x = info.idom.get(x)
    return chain[::-1]


def _recognise_one(info: GraphInfo, sm: Node) -> AttentionLayer:
    logits = sm.inputs[0]
    tried: list[AttentionLayer] = []
    for x in _input_candidates(info, logits) or [""]:
        layer = AttentionLayer(sm.name, "", "", [sm.name])
        try:
            if not x:
                raise _NotAttention("no tensor of token layout dominates it")
            _analyse(info, sm, logits, x, layer)
        except (_NotAttention, ValueError, RuntimeError, IndexError, KeyError) as exc:
            # anything unexpected while probing means: not recognised (never a crash)
            layer.kind = "unknown"
            layer.reason = f"Softmax node {sm.name} is not a recognised attention layer: {exc}"
        if layer.kind != "unknown" and layer.reason is None:
            return layer
        tried.append(layer)
    known = [t for t in tried if t.kind != "unknown"]
    return known[0] if known else tried[0]


def _analyse(info: GraphInfo, sm: Node, logits: str, x: str, layer: AttentionLayer) -> None:
    shape_l = info.shape(logits)
    if len(shape_l) < 2 or shape_l[-1] != shape_l[-2] or shape_l[-1] != info.seq_len:
        raise _NotAttention("its input is not an N x N logits tensor")
    axis = int(sm.attrs.get("axis", -1)) % len(shape_l)
    if axis != len(shape_l) - 1:
        raise _NotAttention("the softmax is not over the last (key) axis")
    n = info.seq_len
    # 2. P @ V and the layer output
    p = sm.outputs[0]
    cons = _data_consumers(info, p)
    pv = [c for c in cons if c.op_type == "MatMul" and c.inputs[0] == p]
    if len(cons) != 1 or len(pv) != 1 or pv[0].inputs[1] not in info.var:
        raise _NotAttention("its probabilities are not used only as P @ V")
    v_name, o_name = pv[0].inputs[1], pv[0].outputs[0]
    y = _find_output(info, o_name)
    nodes = info.region(x, y)
    if nodes is None:
        raise _NotAttention(f"the nodes between {x} and {y} also read or feed other "
                            "input-dependent tensors")
    layer.input, layer.output = x, y
    layer.nodes = [nd.name for nd in nodes]
    aff = _affine(info, nodes, x)
    # 3. candidate projections feeding the logits
    anc = _ancestors(info, logits, x)
    g_l = int(np.prod(shape_l[:-2]))
    cands: list[tuple[str, bool]] = []
    for t in sorted(anc & aff, key=lambda t: info.order.get(info.producer[t].name, -1)
                    if t in info.producer else -1):
        s = info.shape(t)
        if len(s) < 2:
            continue
        for tr in (False, True):
            rows, w = (s[-1], s[-2]) if tr else (s[-2], s[-1])
            g = int(np.prod(s[:-2]))
            if rows == n and g in (1, g_l):
                cands.append((t, tr))
    if not cands:
        raise _NotAttention("no affine projection of the layer input feeds the logits")
    # a constant added to the logits (a mask written as a large finite negative number, as
    # the dynamo exporter does for causal attention) swamps the fit numerically: DP attention
    # allows any constant additive mask, so its fit may also run on the logits without it
    scores = _strip_constant_terms(info, logits)
    probe = _Probe(info, nodes, x, [logits, scores, v_name], [t for t, _ in cands] + [v_name])
    gen = np.random.default_rng(1234)
    xs = [gen.standard_normal(probe.shape) for _ in range(2)]  # the fit needs two
    envs = [probe.run(xi) for xi in xs]
    ls = [e[logits].detach().numpy().reshape(-1, n, n) for e in envs]
    finite = np.isfinite(ls[0])
    if any(not np.array_equal(np.isfinite(lg), finite) for lg in ls):
        raise _NotAttention("its mask depends on the input")
    if not finite.any(axis=-1).all():
        raise _NotAttention("a row of its mask hides every key")
    views = {c: [_view(e[c[0]], n, c[1]) for e in envs] for c in cands}
    found = None
    if scores != logits:  # DP first on the logits without their constant: a cleaner fit
        ss = [e[scores].detach().numpy().reshape(-1, n, n) for e in envs]
        if all(np.isfinite(sc).all() for sc in ss):
            found = _search(ss, np.ones(ss[0].shape, dtype=bool), views, cands, g_l, ("dp",))
    if found is None:
        found = _search(ls, finite, views, cands, g_l, ("dp", "l2"))
    if found is None:
        raise _NotAttention("its logits are neither a scaled dot product nor a negative "
                            "squared L2 distance of projections of the layer input")
    kind, a, b, (c, resid, fit_err) = found
    layer.kind = kind
    g = ls[0].shape[0]
    causal_mask = np.tril(np.ones((n, n), dtype=bool))
    layer.causal = bool(np.array_equal(finite, np.broadcast_to(causal_mask, finite.shape))) \
        and not finite.all()
    (wa, ba), (wb, bb) = probe.affine([a, b], envs, xs)
    wa, ba = _per_head(wa, g), _per_head(ba, g)
    wb, bb = _per_head(wb, g), _per_head(bb, g)
    # 4. output projection: the tail from P @ V to Y, probed per token
    wo, bo, heads_o = _probe_tail(info, nodes, o_name, y, n)
    if kind == "dp":
        if v_name not in aff:
            raise _NotAttention("its values are not an affine map of the layer input")
        ((wv, bv),) = probe.affine([(v_name, False)], envs, xs)
        layer.wq, layer.bq, layer.wk = wa, ba, wb
        layer.wv, layer.bv = _per_head(wv, heads_o), _per_head(bv, heads_o)
        scale = float(np.abs(c).max())
        canonical = 1.0 / math.sqrt(wa.shape[-1])
        if scale <= canonical and scale >= canonical * (1 - 1e-6):
            # float32 spellings of 1/sqrt(d) (e.g. sqrt(sqrt(1/d)) on both sides) land just
            # below it: the canonical, larger scale is still an upper bound (docs/bounds.md)
            scale = canonical
        else:
            # the fitted scale carries the evaluation's rounding (~1e-15 relative, more
            # when large constants sit in the logits): certify a slightly larger one
            scale = math.nextafter(scale * (1 + max(_FIT_MARGIN, fit_err)), math.inf)
        layer.scale = scale
        layer.wo, layer.bo = wo, bo
        return
    # L2
    layer.wq, layer.bq, layer.wk = wa, ba, wb
    layer.wo, layer.bo = wo, bo
    if float(c.min()) <= 0:
        raise _NotAttention("its logits grow with the distance (a positive L2 coefficient)")
    same_tensor = a == b
    layer.tied = bool(same_tensor or (np.array_equal(wa, wb) and np.array_equal(ba, bb)))
    if np.abs(resid).max() > 1e-7 * (1 + max(float(np.abs(lg[finite]).max()) for lg in ls)):
        layer.reason = (f"attention at Softmax {layer.softmax}: L2 logits with an additive "
                        "mask other than causal masking are not covered by Theorem 3.2")
        return
    if not finite.all() and not layer.causal:
        layer.reason = (f"attention at Softmax {layer.softmax}: L2 attention with a mask "
                        "other than causal is not covered by Theorem 3.2")
        return
    if not layer.tied:
        layer.reason = (f"attention at Softmax {layer.softmax}: L2 attention with untied "
                        "query/key weights is not covered by Theorem 3.2 (not Lipschitz in "
                        "general); tie them to get a certificate")
        return
    if np.abs(ba).max() > 0:
        layer.reason = (f"attention at Softmax {layer.softmax}: L2 attention with a query bias "
                        "is not covered by Theorem 3.2")
        return
    _l2_values(info, nodes, probe, envs, xs, v_name, layer, g, heads_o)


def _search(ls: list[np.ndarray], finite: np.ndarray,
            views: dict[tuple[str, bool], list[np.ndarray]], cands: list[tuple[str, bool]],
            g_l: int, kinds: tuple[str, ...]
            ) -> tuple[str, tuple[str, bool], tuple[str, bool],
                       tuple[np.ndarray, np.ndarray, float]] | None:
    """The first (kind, a, b, fit) whose projections a, b explain the sampled logits `ls`."""
    j0 = np.argmax(finite, axis=-1)
    for kind in kinds:
        for a in cands:
            for b in cands:
                va, vb = views[a], views[b]
                if va[0].shape[-1] != vb[0].shape[-1]:
                    continue
                va = [np.broadcast_to(v, (g_l, *v.shape[1:])) for v in va]
                vb = [np.broadcast_to(v, (g_l, *v.shape[1:])) for v in vb]
                if kind == "dp":
                    gs = [qa @ np.swapaxes(kb, 1, 2) for qa, kb in zip(va, vb, strict=True)]
                else:
                    gs = [-(np.square(qa).sum(-1)[:, :, None] - 2 * (qa @ np.swapaxes(kb, 1, 2))
                            + np.square(kb).sum(-1)[:, None, :])
                          for qa, kb in zip(va, vb, strict=True)]
                fit = _fit(ls, gs, finite, j0)
                if fit is not None:
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


def _check_scale(linear: np.ndarray, bias: np.ndarray) -> float:
    """The size a read-out check's tolerance is relative to: the input-dependent part, not a
    constant bias on top of it (a huge bias would otherwise hide a token-mixing term). Its
    rounding (~u |bias|) must stay far below that tolerance, which caps the bias."""
    scale = 1.0 + float(np.abs(linear).max())
    if float(np.abs(bias).max(initial=0.0)) > 1e6 * scale:
        raise _NotAttention("a projection bias is over 1e6 times its input-dependent part; "
                            "its rounding would hide what the checks must see")
    return scale


def _per_head(w: np.ndarray, heads: int) -> np.ndarray:
    if w.shape[0] == heads:
        return w
    if w.shape[0] == 1:
        return np.repeat(w, heads, axis=0)
    raise _NotAttention(f"projection with {w.shape[0]} groups for {heads} heads")


def _probe_tail(info: GraphInfo, nodes: list[Node], o_name: str, y: str,
                n: int) -> tuple[np.ndarray, np.ndarray, int]:
    """W^O (H dv, D_out) and b^O with Y_i = [o^1_i, ..., o^H_i] W^O + b^O."""
    tail = info.region(o_name, y)
    if tail is None:
        raise _NotAttention("its output projection reads other tensors")
    o_shape = info.shape(o_name)
    o_view = _view(info.env[o_name], n, False)
    heads, _, dv = o_view.shape
    width = heads * dv

    def run(view: np.ndarray) -> np.ndarray:
        o = torch.from_numpy(np.ascontiguousarray(view).reshape(o_shape))
        env = _eval_unit_rows(info, tail, {o_name: o})
        return env[y].detach().numpy().reshape(-1, n, info.shape(y)[-1])[0]

    zero = run(np.zeros(o_view.shape))
    if not np.allclose(zero, zero[:1], rtol=0, atol=1e-12 * (1 + np.abs(zero).max())):
        raise _NotAttention("its output projection is not token-wise")
    bias = zero[0]
    wo = np.zeros((width, zero.shape[-1]))
    for k in range(-(-width // n)):
        view = np.zeros(o_view.shape)
        for i in range(n):
            f = k * n + i
            if f < width:
                view[f // dv, i, f % dv] = 1.0
        out = run(view) - bias
        for i in range(n):
            if k * n + i < width:
                wo[k * n + i] = out[i]
    check = np.random.default_rng(7).standard_normal(o_view.shape)
    got = run(check)
    linear = np.transpose(check, (1, 0, 2)).reshape(n, width) @ wo
    scale = _check_scale(linear, bias)
    if not np.allclose(got, linear + bias, rtol=0, atol=_TOL * scale):
        raise _NotAttention("its output projection is not a token-wise affine map of the "
                            "concatenated heads")
    return wo, bias, heads


def _l2_values(info: GraphInfo, nodes: list[Node], probe: _Probe,
               envs: Sequence[Mapping[str, Tensor]], xs: list[np.ndarray], v_name: str,
               layer: AttentionLayer, g: int, heads_o: int) -> None:
    """The value path must be `X A_h W^V_h` with `A_h = c' W^Q_h W^Q_h^T`: find the constant
    MatMul producing the values, probe its input Z (= X A_h) and check A_h."""
    reason = (f"attention at Softmax {layer.softmax}: L2 logits recognised, but the values do "
              "not pass through the query projection as X W^Q W^Q^T W^V (Theorem 3.2 needs "
              "that value path; independent values X W^V are not covered)")
    t = v_name
    by_name = {nd.name: nd for nd in nodes}
    mm = None
    while t in info.producer and info.producer[t].name in by_name:
        nd = info.producer[t]
        if nd.op_type == "MatMul" and nd.inputs[1] not in info.var:
            mm = nd
            break
        if nd.op_type not in ("Reshape", "Transpose", "Identity", "Squeeze", "Unsqueeze"):
            break
        t = nd.inputs[0]
    assert layer.wq is not None
    if mm is None or heads_o != g:
        layer.reason = reason
        return
    z_name = mm.inputs[0]
    wv_const = info.env[mm.inputs[1]].detach().numpy()
    try:
        ((wz, bz),) = probe.affine([(z_name, False)], envs, xs)
    except _NotAttention:
        layer.reason = reason
        return
    if wz.shape[0] != g or wz.shape[1] != wz.shape[2] or np.abs(bz).max() > 0:
        layer.reason = reason
        return
    wv = wv_const.reshape(-1, *wv_const.shape[-2:])
    wv = _per_head(wv, g)
    factors = []
    for h in range(g):
        m = layer.wq[h] @ layer.wq[h].T  # (D, D)
        cp = float((wz[h] * m).sum() / max((m * m).sum(), 1e-300))
        # 2^-20 relative: A = c' W^Q W^Q^T folded into a float32 constant by the exporter
        # (dynamo does) is read as the exact product the module computes (docs/bounds.md)
        if cp <= 0 or not np.abs(wz[h] - cp * m).max() <= _A_RTOL * np.abs(wz[h]).max():
            layer.reason = reason
            return
        factors.append(cp * math.sqrt(layer.wq.shape[-1]))
    # the values must then be Z_h W^V_h per head: check on the samples
    for env in envs:
        zv = _view(env[z_name], probe.n, False)
        vv = _view(env[v_name], probe.n, False)
        if zv.shape[0] != g or vv.shape[0] != g or not np.allclose(
                zv @ wv, vv, rtol=0,
                atol=_TOL * (1 + np.abs(vv).max())):
            layer.reason = reason
            return
    layer.wv = wv
    # f = P X (c' W W^T) W^V = theorem's map with W^V scaled by c' sqrt(d) (docs/bounds.md)
    layer.value_factor = math.nextafter(max(factors) * (1 + _FIT_MARGIN), math.inf)
