"""Class (and distillation) tokens concatenated before the attention (ViT, DeiT): the
attention sees N + k tokens, and its certified bound uses N + k, never the graph input's N
(a smaller count would be unsound: Theorem 3.2's bound grows with N)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from lsa_models.bounds.formulas import l2_mha_bound
from lsa_models.onnx import analyse, load_onnx

from .onnx_l2_models import L2Attention
from .test_onnx_recognition import _export, _jacobian_lower

N, D = 5, 16


class _WithTokens(nn.Module):
    """`k` learned rows concatenated in front of the input, positions added, then `inner`."""

    def __init__(self, inner: nn.Module, k: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.tokens = nn.Parameter(torch.randn(1, k, D, generator=gen))
        self.pos = nn.Parameter(0.1 * torch.randn(1, N + k, D, generator=gen))
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:  # (B, N, D)
        t = self.tokens.expand(x.shape[0], -1, -1)  # (B, k, D)
        return self.inner(torch.cat([t, x], dim=1) + self.pos)  # (B, N + k, D)


class _PreNormDP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, D)
        h = self.norm(x)  # (B, T, D)
        return x + self.attn(h, h, h, need_weights=False)[0]  # (B, T, D)


@pytest.mark.parametrize("k,dynamo", [(1, False), (1, True), (2, True)])
def test_onnx_recognition_cls_l2_bound_uses_the_attention_token_count(
        tmp_path: Path, k: int, dynamo: bool) -> None:
    inner = L2Attention(D, 2, "broadcast", seed=k).eval()
    m = _WithTokens(inner, k, seed=7).eval()
    x = torch.randn(1, N, D)
    got = analyse(load_onnx(_export(m, x, tmp_path / "m.onnx", dynamo)), "2")
    assert got.verdict == "certified", got.reason
    wq, wv, wo = (t.detach().double().numpy() for t in (inner.wq, inner.wv, inner.wo))
    want = l2_mha_bound(wq, wv, wo, N + k, "2", False)
    assert want > l2_mha_bound(wq, wv, wo, N, "2", False)  # the count matters
    # the Concat is linear with constant 1 on the input rows: the layer's bound is the model's
    assert got.upper is not None and want * (1 - 1e-9) <= got.upper <= want * (1 + 1e-6)
    assert got.upper >= _jacobian_lower(m, x, "2")


@pytest.mark.parametrize("dynamo", [False, True])
def test_onnx_recognition_cls_prenorm_dp_certified_above_jacobian(tmp_path: Path,
                                                                  dynamo: bool) -> None:
    torch.manual_seed(0)
    m = _WithTokens(_PreNormDP(), 1, seed=3).eval()
    x = torch.randn(1, N, D)
    got = analyse(load_onnx(_export(m, x, tmp_path / "m.onnx", dynamo)), "2")
    assert got.verdict == "certified", got.reason
    assert any(lb.kind == "dp_mha_radius" for lb in got.layers)
    assert got.upper is not None and got.upper >= _jacobian_lower(m, x, "2")
