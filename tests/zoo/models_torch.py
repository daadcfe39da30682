"""Attention as torch users write it: `nn.TransformerEncoderLayer` / `DecoderLayer`,
`nn.MultiheadAttention` with masks, `F.scaled_dot_product_attention`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Unbatched(nn.Module):
    """`layer(x.unsqueeze(0)).squeeze(0)`: a batch-first layer on a 2-D `(N, D)` input."""

    def __init__(self, f: nn.Module) -> None:
        super().__init__()
        self.f = f

    def forward(self, x: Tensor) -> Tensor:  # (N, D)
        return self.f(x.unsqueeze(0)).squeeze(0)  # (N, D)


def encoder_layer(d: int, heads: int, norm_first: bool, batch_first: bool = True) -> nn.Module:
    return nn.TransformerEncoderLayer(d, heads, dim_feedforward=2 * d, dropout=0.0,
                                      batch_first=batch_first, norm_first=norm_first)


class DecoderOnly(nn.Module):
    """`nn.TransformerDecoderLayer` with one input: causal self-attention, and cross-attention
    to a fixed memory (a learned constant, as prefix-conditioned decoders use)."""

    def __init__(self, d: int, heads: int, n: int, norm_first: bool) -> None:
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(d, heads, dim_feedforward=2 * d, dropout=0.0,
                                                batch_first=True, norm_first=norm_first)
        self.memory = nn.Parameter(torch.randn(1, 3, d))  # (1, M, D)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(n))

    def forward(self, x: Tensor) -> Tensor:  # (1, N, D)
        return self.layer(x, self.memory, tgt_mask=self.causal)  # (1, N, D)


class MHABlock(nn.Module):
    """`nn.MultiheadAttention` self-attention with a mask, pre-norm residual or bare."""

    def __init__(self, d: int, heads: int, n: int, pre_norm: bool, bool_mask: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d) if pre_norm else None
        self.mha = nn.MultiheadAttention(d, heads, batch_first=True)
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)  # (N, N): True = masked
        mask = causal if bool_mask else torch.zeros(n, n).masked_fill(causal, float("-inf"))
        self.register_buffer("mask", mask)

    def forward(self, x: Tensor) -> Tensor:  # (1, N, D)
        h = x if self.norm is None else self.norm(x)
        a = self.mha(h, h, h, attn_mask=self.mask, need_weights=False)[0]  # (1, N, D)
        return a if self.norm is None else x + a


class SDPABlock(nn.Module):
    """Multi-head attention around `F.scaled_dot_product_attention` (causal or with a boolean
    padding-style mask), pre-norm residual or bare."""

    def __init__(self, d: int, heads: int, n: int, pre_norm: bool, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.norm = nn.LayerNorm(d) if pre_norm else None
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        keep = torch.ones(n, n, dtype=torch.bool)  # (N, N): True = attend
        keep[:, -1] = False  # the last key is padding
        self.register_buffer("keep", keep)

    def forward(self, x: Tensor) -> Tensor:  # (B, N, D)
        h = x if self.norm is None else self.norm(x)
        b, n, d = h.shape
        q, k, v = self.qkv(h).reshape(b, n, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4)  # each (B, H, N, d)
        if self.causal:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, N, d)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.keep)
        a = self.proj(o.transpose(1, 2).reshape(b, n, d))  # (B, N, D)
        return a if self.norm is None else x + a
