"""L2 self-attention written by hand, four ways (Kim et al. 2021, Theorem 3.2's map).

Logits `-||q_i - k_j||^2 / sqrt(d)`; tied models use `k = q` and values `P X A W^V` with
`A = W^Q W^Q^T / sqrt(d)` (the Lipschitz form); untied models use `k = X W^K` and values
`X W^V` (not Lipschitz in general: lsa rightly refuses them). Each module maps `(..., N, D)`
to `(..., N, D)`, so one module serves the `(N, D)` and `(1, N, D)` layouts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class _L2Base(nn.Module):
    def __init__(self, d: int, heads: int, tied: bool = True, causal: bool = False) -> None:
        super().__init__()
        self.heads, self.dh, self.tied, self.causal = heads, d // heads, tied, causal
        scale = 1.0 / math.sqrt(d)
        self.wq = nn.Parameter(torch.randn(heads, d, self.dh) * scale)  # (H, D, d)
        self.wk = None if tied else nn.Parameter(torch.randn(heads, d, self.dh) * scale)
        self.wv = nn.Parameter(torch.randn(heads, d, self.dh) * scale)  # (H, D, d)
        self.out = nn.Linear(heads * self.dh, d, bias=False)

    def keys(self, x: Tensor, q: Tensor) -> Tensor:
        return q if self.wk is None else x.unsqueeze(-3) @ self.wk  # (..., H, N, d)

    def mask(self, logits: Tensor) -> Tensor:
        if not self.causal:
            return logits
        n = logits.shape[-1]
        above = torch.ones(n, n, dtype=torch.bool, device=logits.device).triu(1)  # (N, N)
        return logits.masked_fill(above, float("-inf"))

    def values(self, x: Tensor, p: Tensor) -> Tensor:
        """`P X A W^V` (tied) or `P X W^V` (untied), heads concatenated, projected out."""
        if self.wk is None:
            a = self.wq @ self.wq.transpose(-1, -2) / math.sqrt(self.dh)  # (H, D, D)
            v = x.unsqueeze(-3) @ a @ self.wv  # (..., H, N, d)
        else:
            v = x.unsqueeze(-3) @ self.wv  # (..., H, N, d)
        o = (p @ v).transpose(-3, -2)  # (..., N, H, d)
        return self.out(o.reshape(*o.shape[:-2], self.heads * self.dh))  # (..., N, D)


class L2Broadcast(_L2Base):
    """The paper's definition: pairwise differences by broadcasting."""

    def forward(self, x: Tensor) -> Tensor:  # (..., N, D)
        q = x.unsqueeze(-3) @ self.wq  # (..., H, N, d)
        k = self.keys(x, q)
        diff = q.unsqueeze(-2) - k.unsqueeze(-3)  # (..., H, N, N, d)
        logits = -(diff * diff).sum(-1) / math.sqrt(self.dh)  # (..., H, N, N)
        return self.values(x, torch.softmax(self.mask(logits), dim=-1))


class L2Cdist(_L2Base):
    """Squared distances by `torch.cdist(q, k) ** 2`."""

    def forward(self, x: Tensor) -> Tensor:  # (..., N, D)
        q = x.unsqueeze(-3) @ self.wq  # (..., H, N, d)
        k = self.keys(x, q)
        logits = -torch.cdist(q, k) ** 2 / math.sqrt(self.dh)  # (..., H, N, N)
        return self.values(x, torch.softmax(self.mask(logits), dim=-1))


class L2Expanded(_L2Base):
    """`-|q_i|^2 + 2 q_i.k_j - |k_j|^2`, the form efficient implementations use."""

    def forward(self, x: Tensor) -> Tensor:  # (..., N, D)
        q = x.unsqueeze(-3) @ self.wq  # (..., H, N, d)
        k = self.keys(x, q)
        qq = (q * q).sum(-1, keepdim=True)  # (..., H, N, 1)
        kk = (k * k).sum(-1).unsqueeze(-2)  # (..., H, 1, N)
        logits = (2 * q @ k.transpose(-1, -2) - qq - kk) / math.sqrt(self.dh)  # (..., H, N, N)
        return self.values(x, torch.softmax(self.mask(logits), dim=-1))


class L2Stpp(nn.Module):
    """neural_stpp / semi-discrete-flow style: `(T, B, E)` input, einsum over heads, additive
    causal mask, softmax over the key axis 1 of `(T, S, B, H)` logits."""

    def __init__(self, d: int, heads: int, causal: bool = True, mask: float = float("-inf")
                 ) -> None:
        super().__init__()
        self.heads, self.dh, self.causal, self.fill = heads, d // heads, causal, mask
        self.q_weight = nn.Parameter(torch.randn(d, heads, self.dh) / math.sqrt(d))  # (D, H, d)
        self.v_weight = nn.Parameter(torch.randn(heads, d, self.dh) / math.sqrt(d))  # (H, D, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:  # (T, B, E)
        t, b, e = x.shape
        q = torch.einsum("tbm,mhd->tbhd", x, self.q_weight)  # (T, B, H, d)
        sq = torch.einsum("tbhd,tbhd->tbh", q, q)  # (T, B, H)
        dist = sq.unsqueeze(1) + sq.unsqueeze(0) - 2 * torch.einsum(
            "tbhd,sbhd->tsbh", q, q)  # (T, S, B, H)
        logits = -dist / math.sqrt(self.dh)
        if self.causal:
            mask = torch.full((t, t), self.fill, device=x.device).triu(1)  # (T, S)
            logits = logits + mask[..., None, None]
        p = F.softmax(logits, dim=1)  # (T, S, B, H)
        a = torch.einsum("mhd,nhd->hmn", self.q_weight, self.q_weight) / math.sqrt(self.dh)
        xa = torch.einsum("tbm,hmn->tbhn", x, a)  # (T, B, H, D)
        pxa = torch.einsum("tsbh,sbhm->tbhm", p, xa)  # (T, B, H, D)
        pxav = torch.einsum("tbhm,hmd->tbhd", pxa, self.v_weight)  # (T, B, H, d)
        return self.out_proj(pxav.reshape(t, b, e))  # (T, B, E)


class L2EinsumHeads(nn.Module):
    """The paper's `f^h(X) = P^h X A^h W^{V,h}` with heads by einsum and the value weights
    folded into one matrix per head, `M^h = A^h W^{V,h}` (computed in forward: exporters fold
    it into a constant). `values="queries"` applies the weights to the queries first and
    `W^{Q,h T} W^{V,h} / sqrt(d)` after them; `values="independent"` uses `X W^{V,h}` (not
    Theorem 3.2's map)."""

    def __init__(self, d: int, heads: int, values: str = "folded") -> None:
        super().__init__()
        self.heads, self.dh, self.mode = heads, d // heads, values
        self.wq = nn.Parameter(torch.randn(heads, d, self.dh) / math.sqrt(d))  # (H, D, d)
        self.wv = nn.Parameter(torch.randn(heads, d, self.dh) / math.sqrt(d))  # (H, D, d)
        self.wo = nn.Parameter(torch.randn(heads * self.dh, d) / math.sqrt(d))  # (H d, D)

    def forward(self, x: Tensor) -> Tensor:  # (B, N, D)
        s = math.sqrt(self.dh)
        q = torch.einsum("bnd,hde->bhne", x, self.wq)  # (B, H, N, d)
        sq = (q * q).sum(-1)  # (B, H, N)
        dist = sq.unsqueeze(-1) + sq.unsqueeze(-2) - 2 * torch.einsum("bhne,bhme->bhnm", q, q)
        p = torch.softmax(-dist / s, dim=-1)  # (B, H, N, N)
        if self.mode == "queries":
            back = torch.einsum("hde,hdf->hef", self.wq, self.wv) / s  # (H, d, d)
            o = torch.einsum("bhnm,bhme,hef->bnhf", p, q, back)  # (B, N, H, d)
        else:
            m = torch.einsum("hde,hfe,hfg->hdg", self.wq, self.wq, self.wv) / s \
                if self.mode == "folded" else self.wv  # (H, D, d)
            o = torch.einsum("bhnm,bmd,hdg->bnhg", p, x, m)  # (B, N, H, d)
        return o.flatten(2) @ self.wo  # (B, N, D)


class CdistValuesAfter(nn.Module):
    """One head on `(N, D)`: `-cdist(q, q)^2 / sqrt(d)` logits, `V(P X A)` with `V` an
    `nn.Linear` applied after the weights."""

    def __init__(self, d: int, dh: int) -> None:
        super().__init__()
        self.dh = dh
        self.wq = nn.Parameter(torch.randn(d, dh) / math.sqrt(d))  # (D, d)
        self.v = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:  # (N, D)
        q = x @ self.wq  # (N, d)
        p = torch.softmax(-torch.cdist(q, q) ** 2 / math.sqrt(self.dh), dim=-1)  # (N, N)
        return self.v(p @ (x @ (self.wq @ self.wq.T) / math.sqrt(self.dh)))  # (N, D)


class Residual(nn.Module):
    """`x + f(x)`: the block every Transformer wraps attention in."""

    def __init__(self, f: nn.Module) -> None:
        super().__init__()
        self.f = f

    def forward(self, x: Tensor) -> Tensor:
        return x + self.f(x)


class SeqFirst(nn.Module):
    """A batch-first module called on a sequence-first `(N, 1, D)` tensor."""

    def __init__(self, f: nn.Module) -> None:
        super().__init__()
        self.f = f

    def forward(self, x: Tensor) -> Tensor:  # (N, 1, D)
        return self.f(x.transpose(0, 1)).transpose(0, 1)  # (N, 1, D)
