"""L2 self-attention written from the paper's definition in the ways users write it (tests only).

Theorem 3.2's map per head h: `P_h X A_h W^V_h` with logits `-||x_i W^Q_h - x_j W^Q_h||^2 /
sqrt(d)` and `A_h = W^Q_h W^Q_h^T / sqrt(d)`; heads concatenated, then `W^O`. Every module
below computes that map (tied) or its untied variant (keys `x W^K_h`), spelled differently:

- `form="broadcast"`: pairwise differences `q.unsqueeze(-2) - k.unsqueeze(-3)`, squared, summed;
- `form="cdist"`: `torch.cdist(q, k) ** 2`;
- `form="expanded"`: `||q||^2 - 2 q k^T + ||k||^2`;
- `form="stpp"`: neural_stpp / semi-discrete-flow style: `(T, B, E)` layout, einsum over heads
  (causal: neural_stpp's additive `triu(full(-1e9), 1)[..., None, None]` on `(T, S, B, H)`).

The value path `X A_h W^V_h` is itself written in several association orders (`values=`):

- `"a_then_v"`: `(X A_h) W^V_h`, A_h a constant the exporter may fold;
- `"folded"`: `einsum(X, A_h W^V_h)`: one constant per head (the exporter folds the product);
- `"queries_first"`: `((P (X W^Q_h)) W^Q_h^T / sqrt(d)) W^V_h`: the weights applied after P;
- `"independent"`: `X W^V_h` (not Theorem 3.2's map: refused).

Inputs are `(B, N, D)` (or `(N, D)` with `rank=2`, `(T, B, E)` for `stpp`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class L2Attention(nn.Module):
    def __init__(self, d_model: int, heads: int, form: str = "broadcast", tied: bool = True,
                 causal: bool = False, residual: bool = False, seed: int = 0,
                 values: str = "a_then_v", additive_mask: bool = False) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.h, self.d = heads, d_model // heads
        self.form, self.tied, self.causal, self.residual = form, tied, causal, residual
        self.values, self.additive_mask = values, additive_mask
        scale = 1.0 / math.sqrt(d_model)
        self.wq = nn.Parameter(torch.randn(heads, d_model, self.d, generator=gen) * scale)
        self.wk = nn.Parameter(torch.randn(heads, d_model, self.d, generator=gen) * scale)
        self.wv = nn.Parameter(torch.randn(heads, d_model, self.d, generator=gen) * scale)
        self.wo = nn.Parameter(torch.randn(heads * self.d, d_model, generator=gen) * scale)

    def _logits(self, q: Tensor, k: Tensor) -> Tensor:  # q, k: (..., N, d)
        if self.form == "broadcast":
            diff = q.unsqueeze(-2) - k.unsqueeze(-3)  # (..., N, N, d)
            sq = (diff ** 2).sum(-1)  # (..., N, N)
        elif self.form == "cdist":
            sq = torch.cdist(q, k) ** 2  # (..., N, N)
        else:
            sq = (q * q).sum(-1, keepdim=True) - 2 * q @ k.transpose(-1, -2) + \
                (k * k).sum(-1).unsqueeze(-2)  # (..., N, N)
        return -sq / math.sqrt(self.d)

    def _mask(self, logits: Tensor) -> Tensor:
        if not self.causal:
            return logits
        n = logits.shape[-1]
        if self.additive_mask:  # very negative above the diagonal, added
            return logits + torch.triu(torch.full((n, n), -1e9), 1)
        keep = torch.ones(n, n, dtype=torch.bool).tril()
        return logits.masked_fill(~keep, float("-inf"))

    def forward(self, x: Tensor) -> Tensor:  # (B, N, D) or (N, D); stpp: (T, B, D)
        if self.form == "stpp":
            return self._stpp(x)
        xb = x.unsqueeze(-3)  # (..., 1, N, D)
        q = xb @ self.wq  # (..., H, N, d)
        k = q if self.tied else xb @ self.wk  # (..., H, N, d)
        p = torch.softmax(self._mask(self._logits(q, k)), dim=-1)  # (..., H, N, N)
        o = self._values(xb, q, p)  # (..., H, N, d)
        o = o.transpose(-3, -2).reshape(*x.shape[:-1], self.h * self.d)  # (..., N, H d)
        y = o @ self.wo  # (..., N, D)
        return x + y if self.residual else y

    def _values(self, xb: Tensor, q: Tensor, p: Tensor) -> Tensor:  # -> (..., H, N, d)
        a = self.wq @ self.wq.transpose(-1, -2) / math.sqrt(self.d)  # (H, D, D): constant
        if self.values == "a_then_v":
            return p @ ((xb @ a) @ self.wv)
        if self.values == "folded":
            return p @ torch.einsum("...nd,hde->...hne", xb.squeeze(-3), a @ self.wv)
        if self.values == "queries_first":
            return ((p @ q) @ self.wq.transpose(-1, -2) / math.sqrt(self.d)) @ self.wv
        if self.values == "independent":
            return p @ (xb @ self.wv)
        raise ValueError(f"unknown value path {self.values!r}")

    def _stpp(self, x: Tensor) -> Tensor:  # (T, B, D)
        q = torch.einsum("tbe,hed->tbhd", x, self.wq)  # (T, B, H, d)
        k = q if self.tied else torch.einsum("tbe,hed->tbhd", x, self.wk)
        sq = (q.unsqueeze(1) - k.unsqueeze(0)).pow(2).sum(-1)  # (T, S, B, H)
        logits = -sq / math.sqrt(self.d)
        if self.causal:  # neural_stpp's mask: added, very negative above the diagonal
            t = x.shape[0]
            mask = torch.triu(torch.full((t, t), -1e9), 1)  # (T, S)
            logits = logits + mask[..., None, None]
        p = torch.softmax(logits, dim=1)  # (T, S, B, H)
        a = torch.einsum("hed,hfd->hef", self.wq, self.wq) / math.sqrt(self.d)  # (H, D, D)
        xa = torch.einsum("sbe,hef->sbhf", x, a)  # (S, B, H, D)
        v = torch.einsum("sbhf,hfd->sbhd", xa, self.wv)  # (S, B, H, d)
        o = torch.einsum("tsbh,sbhd->tbhd", p, v)  # (T, B, H, d)
        o = o.reshape(x.shape[0], x.shape[1], self.h * self.d)  # (T, B, H d)
        y = o @ self.wo  # (T, B, D)
        return x + y if self.residual else y


class CdistHead(nn.Module):
    """One head on a 2-D input `(N, D)`: logits `-cdist(q, q)^2 / sqrt(d)`, the weights applied
    to `X A` and a biased `nn.Linear` after them: `V(P X A)`, Theorem 3.2's map with `W^V`
    applied after P."""

    def __init__(self, d_model: int, d: int, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.d = d
        self.wq = nn.Parameter(torch.randn(d_model, d, generator=gen) / math.sqrt(d_model))
        self.v = nn.Linear(d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:  # (N, D)
        q = x @ self.wq  # (N, d)
        p = torch.softmax(-torch.cdist(q, q) ** 2 / math.sqrt(self.d), dim=-1)  # (N, N)
        a = self.wq @ self.wq.T / math.sqrt(self.d)  # (D, D)
        return self.v(p @ (x @ a))  # (N, D)
