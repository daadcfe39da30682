"""RMSNorm (LLaMA/Qwen): the bound of docs/bounds.md against exact float64 Jacobians, and the
decomposed form recognised in exported graphs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lsa_models.bounds.layer_graph.families import rmsnorm_bound
from lsa_models.onnx import analyse, load_onnx

from .jacobians import jacobian_norm
from .onnx_export import export_to


def _rms(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:  # (N, D) -> (N, D)
    return g * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@settings(deadline=None)
@given(d=st.integers(1, 6), n=st.integers(1, 3), seed=st.integers(0, 10_000),
       log_eps=st.floats(-8, 0), log_scale=st.floats(-5, 1))
def test_rmsnorm_bound_dominates_exact_jacobians(d: int, n: int, seed: int, log_eps: float,
                                                 log_scale: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    eps = 10.0 ** log_eps
    g = 3 * torch.randn(d, generator=gen, dtype=torch.float64)
    # inputs of every size relative to sqrt(eps): the Jacobian peaks near x = 0
    x = 10.0 ** log_scale * np.sqrt(eps) * torch.randn(n, d, generator=gen,
                                                       dtype=torch.float64)
    for norm in ("2", "inf"):
        exact = jacobian_norm(lambda z: _rms(z, g, eps), x, norm)
        assert exact <= rmsnorm_bound(g.numpy(), eps, norm)


def test_rmsnorm_bound_is_attained_at_zero_in_the_2_norm() -> None:
    g = torch.tensor([0.5, -2.0, 1.0], dtype=torch.float64)
    exact = jacobian_norm(lambda z: _rms(z, g, 1e-3), torch.zeros(2, 3, dtype=torch.float64),
                          "2")
    assert exact == pytest.approx(rmsnorm_bound(g.numpy(), 1e-3, "2"), rel=1e-12)


class _RMSBlock(nn.Module):
    """LLaMA's RMSNorm as transformers writes it (float32 upcast, rsqrt), then a linear map."""

    def __init__(self, d: int, eps: float, cast: bool) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.weight = nn.Parameter(1 + 0.5 * torch.randn(d))
        self.proj = nn.Linear(d, d)
        self.eps, self.cast = eps, cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D)
        h = x.to(torch.float32) if self.cast else x
        var = h.pow(2).mean(-1, keepdim=True)  # (B, N, 1)
        h = h * torch.rsqrt(var + self.eps)  # (B, N, D)
        return self.proj(self.weight * h.to(x.dtype))  # (B, N, D)


@pytest.mark.parametrize("dynamo", [False, True])
def test_rmsnorm_decomposed_is_recognised(tmp_path: Path, dynamo: bool) -> None:
    d, eps = 8, 1e-5
    m = _RMSBlock(d, eps, cast=True).eval()
    x = torch.randn(1, 5, d)
    path = export_to(m, x, tmp_path / "m.onnx", dynamo, opset=18)
    got = analyse(load_onnx(path.read_bytes()), "2")
    assert got.verdict == "certified", got.reason
    rms = [lb for lb in got.layers if lb.kind == "rmsnorm"]
    assert len(rms) == 1
    want = rmsnorm_bound(m.weight.detach().double().numpy(), eps, "2")
    assert rms[0].upper is not None and want <= rms[0].upper <= want * (1 + 1e-8)
    md = _RMSBlock(d, eps, cast=False).double()  # same weights (same seed), no float32 cast
    gen = torch.Generator().manual_seed(0)
    for scale in (1e-3, 1.0):
        xs = scale * torch.randn(1, 5, d, generator=gen, dtype=torch.float64)
        assert jacobian_norm(md, xs, "2") <= got.upper
