"""Shared pieces of attention recognition (attention.py): the layer record, and the float64
probes that read token-wise affine maps (projections, output projection) off a graph region.

A probe evaluates the region at chosen values of the layer input: zero, basis inputs (token i
of run k is e_{kN+i}: exact in float64, the coefficients are read off directly) and random
inputs (each read-out is confirmed there: a map mixing tokens or features differently
disagrees with probability one).
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch
from torch import Tensor

from ..operators.linear import Gemm
from .graph import GraphInfo
from .ops import OPS, Node

TOL = 1e-8  # relative tolerance of the read-out checks, far above float64 rounding
FIT_MARGIN = 1e-12  # relative allowance for constants fitted by least squares in float64
_POSITION_HINT = (" (position-dependent maps are covered only as rotary embeddings of "
                  "dot-product queries and keys; a model without them, or with learned "
                  "absolute positions added to its input, is)")


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
    bk: np.ndarray | None = None  # (H, d): counts only when logits are replaced (`replaced`)
    wv: np.ndarray | None = None  # (H, D, dv)
    bv: np.ndarray | None = None
    wo: np.ndarray | None = None  # (H dv, D_out)
    bo: np.ndarray | None = None
    scale: float = 1.0  # DP: max_h |c_h|
    # DP logits replaced by constants on a fixed set of entries (masked_fill with a finite
    # value): the bound takes the key bias into account (docs/bounds.md)
    replaced: bool = False
    extra: dict[str, float] = field(default_factory=dict)
    n: int = 0  # tokens the attention sees (N + 1 after a class token); 0: not recognised
    # DP with rotary embeddings: certified rho_q rho_k >= max_i ||R_i||_2 (query, key), folded
    # into `scale` (docs/bounds.md, "Rotary position embeddings"); 1.0 without them
    position_factor: float = 1.0
    # rotary keys with a key bias: `b^K R'_j` rotates with the key's position, so the bound
    # takes the key bias into account as for replaced logits (docs/bounds.md, "Rotary")
    rotated_key_bias: bool = False
    # float32 readings this layer relies on (docs/bounds.md, Conventions): the certificate is
    # for the exact constants, and the report says so
    notes: list[str] = field(default_factory=list)


class NotAttention(Exception):
    pass


def token_view(v: Tensor, n: int, transposed: bool) -> np.ndarray:
    a = v.detach().numpy()
    if transposed:
        a = np.swapaxes(a, -1, -2)
    return a.reshape(-1, n, a.shape[-1])


def data_consumers(info: GraphInfo, t: str) -> list[Node]:
    """Consumers that read values (a Shape of a tensor is a constant at a fixed size)."""
    return [c for c in info.consumers.get(t, [])
            if c.op_type not in ("Shape", "Size") and c.name in info.live]


class Probe:
    """Evaluates the region at chosen values of one tensor and reads token-wise affine maps.

    `targets` are the tensors the analysis reads; only the nodes they depend on run (the
    softmax and the output projection are not needed to read the projections). The basis
    probes only read `projections` (not the logits made from them)."""

    def __init__(self, info: GraphInfo, nodes: list[Node], source: str,
                 targets: list[str], projections: list[str], n: int) -> None:
        self.info, self.source = info, source
        self.nodes = info.needed(nodes, targets)
        self.basis_nodes = info.needed(self.nodes, projections)
        actual = info.shape(source)
        self.n = n  # the tokens the attention sees (N, or N + 1 with a class token)
        self.width = actual[-1]
        # probes are written (batch, N, width); a sequence-first source (N, 1, width) holds
        # the same rows in the same memory order (`GraphInfo.is_token`)
        self.shape = (int(np.prod(actual[:-1])) // self.n, self.n, self.width)
        self._actual = actual
        self._exponents = exact_exponents(info, self.nodes)
        self.exact_exponents = bool(self._exponents)

    def run(self, x: np.ndarray, basis: bool = False) -> Mapping[str, Tensor]:
        src = {self.source: torch.from_numpy(x.reshape(self._actual)), **self._exponents}
        if not basis:
            with torch.no_grad():
                return self.info.eval_nodes(self.nodes, src)
        return eval_unit_rows(self.info, self.basis_nodes, src)

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
            b_all = token_view(zero[name], n, tr)  # (G, N, w)
            if not np.allclose(b_all, b_all[:, :1, :], rtol=0, atol=1e-12 * (
                    1 + np.abs(b_all).max())):
                raise NotAttention(f"tensor {name} is not the same map of the layer input at "
                                   f"every position{_POSITION_HINT}")
            b = b_all[:, 0, :]  # (G, w)
            g, _, w = b_all.shape
            # filled in (width, G, w) order: the check below is then one plain 2-D product
            stacked = np.empty((width, g, w))
            for k, env in enumerate(bases):
                rows = min(n, width - k * n)
                v = token_view(env[name], n, tr)[:, :rows, :]  # (G, rows, w)
                np.subtract(v.transpose(1, 0, 2), b_all[:, :rows, :].transpose(1, 0, 2),
                            out=stacked[k * n:k * n + rows])
            got = token_view(samples[0][name], n, tr).transpose(1, 0, 2)  # (N, G, w)
            xs = sample_inputs[0].reshape(-1, n, width)[0]  # (N, width)
            pred = (xs @ stacked.reshape(width, g * w)).reshape(n, g, w)
            scale = check_scale(pred, b)
            pred += b[None, :, :]
            pred -= got
            if not np.abs(pred).max() <= TOL * scale:
                raise NotAttention(f"tensor {name} is not the same affine map of the layer "
                                   f"input at every position{_POSITION_HINT}")
            weight = stacked.transpose(1, 0, 2)  # (G, width, w)
            results.append((weight, b))
        return results


_EXPONENT_RTOL = 1e-6  # float32 spellings of 1/p: torch writes cdist's 1/2 as 0.49999976


def exact_exponents(info: GraphInfo, nodes: list[Node]) -> dict[str, Tensor]:
    """`Pow(Pow(s, e), p)` with a constant p and `e p` within float32 rounding of 1 (torch's
    TorchScript export of `torch.cdist(q, k) ** 2` writes `e = 0.49999976`) is read as the
    exact `s`: the exponent the user wrote (docs/bounds.md, Conventions). The probes evaluate
    with `e = 1/p` exactly; the certificate concerns that model."""
    out: dict[str, Tensor] = {}
    for nd in nodes:
        if nd.op_type != "Pow" or len(nd.inputs) != 2 or nd.inputs[1] in info.var:
            continue
        cons = data_consumers(info, nd.outputs[0])
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


def eval_unit_rows(info: GraphInfo, nodes: list[Node],
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
    return Gemm(node.op_type, node.attrs).epilogue(out, ins) if gemm else out


def check_scale(linear: np.ndarray, bias: np.ndarray) -> float:
    """The size a read-out check's tolerance is relative to: the input-dependent part, not a
    constant bias on top of it (a huge bias would otherwise hide a token-mixing term). Its
    rounding (~u |bias|) must stay far below that tolerance, which caps the bias."""
    scale = 1.0 + float(np.abs(linear).max())
    if float(np.abs(bias).max(initial=0.0)) > 1e6 * scale:
        raise NotAttention("a projection bias is over 1e6 times its input-dependent part; "
                            "its rounding would hide what the checks must see")
    return scale


def per_head(w: np.ndarray, heads: int) -> np.ndarray:
    if w.shape[0] == heads:
        return w
    if w.shape[0] == 1:
        return np.repeat(w, heads, axis=0)
    raise NotAttention(f"projection with {w.shape[0]} groups for {heads} heads")


def probe_tail(info: GraphInfo, nodes: list[Node], o_name: str, y: str,
                n: int) -> tuple[np.ndarray, np.ndarray, int]:
    """W^O (H dv, D_out) and b^O with Y_i = [o^1_i, ..., o^H_i] W^O + b^O."""
    tail = info.region(o_name, y)
    if tail is None:
        raise NotAttention("its output projection reads other tensors")
    o_shape = info.shape(o_name)
    o_view = token_view(info.env[o_name], n, False)
    heads, _, dv = o_view.shape
    width = heads * dv

    def run(view: np.ndarray) -> np.ndarray:
        o = torch.from_numpy(np.ascontiguousarray(view).reshape(o_shape))
        env = eval_unit_rows(info, tail, {o_name: o})
        return env[y].detach().numpy().reshape(-1, n, info.shape(y)[-1])[0]

    zero = run(np.zeros(o_view.shape))
    if not np.allclose(zero, zero[:1], rtol=0, atol=1e-12 * (1 + np.abs(zero).max())):
        raise NotAttention("its output projection is not token-wise")
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
    scale = check_scale(linear, bias)
    if not np.allclose(got, linear + bias, rtol=0, atol=TOL * scale):
        raise NotAttention("its output projection is not a token-wise affine map of the "
                            "concatenated heads")
    return wo, bias, heads
