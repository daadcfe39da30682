"""L2 self-attention written from the paper's definition in the ways users write it (tests only).

Theorem 3.2's map per head h: `P_h X A_h W^V_h` with logits `-||x_i W^Q_h - x_j W^Q_h||^2 /
sqrt(d)` and `A_h = W^Q_h W^Q_h^T / sqrt(d)`; heads concatenated, then `W^O`. Every module
below computes that map (tied) or its untied variant (keys `x W^K_h`), spelled differently:

- `form="broadcast"`: pairwise differences `q.unsqueeze(-2) - k.unsqueeze(-3)`, squared, summed;
- `form="cdist"`: `torch.cdist(q, k) ** 2`;
- `form="expanded"`: `||q||^2 - 2 q k^T + ||k||^2`;
- `form="stpp"`: neural_stpp / semi-discrete-flow style: `(T, B, E)` layout, einsum over heads.

Inputs are `(B, N, D)` (or `(N, D)` with `rank=2`, `(T, B, E)` for `stpp`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class L2Attention(nn.Module):
    def __init__(self, d_model: int, heads: int, form: str = "broadcast", tied: bool = True,
                 causal: bool = False, residual: bool = False, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.h, self.d = heads, d_model // heads
        self.form, self.tied, self.causal, self.residual = form, tied, causal, residual
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
        keep = torch.ones(n, n, dtype=torch.bool).tril()
        return logits.masked_fill(~keep, float("-inf"))

    def forward(self, x: Tensor) -> Tensor:  # (B, N, D) or (N, D); stpp: (T, B, D)
        if self.form == "stpp":
            return self._stpp(x)
        xb = x.unsqueeze(-3)  # (..., 1, N, D)
        q = xb @ self.wq  # (..., H, N, d)
        k = q if self.tied else xb @ self.wk  # (..., H, N, d)
        p = torch.softmax(self._mask(self._logits(q, k)), dim=-1)  # (..., H, N, N)
        a = self.wq @ self.wq.transpose(-1, -2) / math.sqrt(self.d)  # (H, D, D): constant
        v = (xb @ a) @ self.wv  # (..., H, N, d)
        o = p @ v  # (..., H, N, d)
        o = o.transpose(-3, -2).reshape(*x.shape[:-1], self.h * self.d)  # (..., N, H d)
        y = o @ self.wo  # (..., N, D)
        return x + y if self.residual else y

    def _stpp(self, x: Tensor) -> Tensor:  # (T, B, D)
        q = torch.einsum("tbe,hed->tbhd", x, self.wq)  # (T, B, H, d)
        k = q if self.tied else torch.einsum("tbe,hed->tbhd", x, self.wk)
        sq = (q.unsqueeze(1) - k.unsqueeze(0)).pow(2).sum(-1)  # (T, S, B, H)
        logits = -sq / math.sqrt(self.d)
        if self.causal:
            t = x.shape[0]
            keep = torch.ones(t, t, dtype=torch.bool).tril()[:, :, None, None]
            logits = logits.masked_fill(~keep, float("-inf"))
        p = torch.softmax(logits, dim=1)  # (T, S, B, H)
        a = torch.einsum("hed,hfd->hef", self.wq, self.wq) / math.sqrt(self.d)  # (H, D, D)
        xa = torch.einsum("sbe,hef->sbhf", x, a)  # (S, B, H, D)
        v = torch.einsum("sbhf,hfd->sbhd", xa, self.wv)  # (S, B, H, d)
        o = torch.einsum("tsbh,sbhd->tbhd", p, v)  # (T, B, H, d)
        o = o.reshape(x.shape[0], x.shape[1], self.h * self.d)  # (T, B, H d)
        y = o @ self.wo  # (T, B, D)
        return x + y if self.residual else y
