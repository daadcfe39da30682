"""Rotary position embeddings, SiLU and gated products (docs/bounds.md, "Rotary position
embeddings" and "Gated MLPs (SwiGLU)"): the bounds against exact float64 Jacobians, and
recognition of a rotary attention block exported by torch."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from lsa_models.bounds.formulas import dp_mha_radius_bound
from lsa_models.bounds.numerics import SILU_LIPSCHITZ, inv_sqrt_up, mul_up
from lsa_models.onnx import analyse, load_onnx
from lsa_models.onnx.attention import recognise
from lsa_models.onnx.attention_rotary import rotation_norm_upper
from lsa_models.onnx.graph import GraphInfo
from lsa_models.onnx.ops import Flow
from lsa_models.operators.linear import product_bound
from tests.profile import at_most

from .jacobians import jacobian_matrix, max_jacobian_norm
from .onnx_export import export_to


def _rotations(n: int, d: int, seed: int) -> Tensor:
    """n random orthogonal (d, d) matrices in float64 (QR of Gaussians)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, d, d, generator=g, dtype=torch.float64))
    return q  # (N, d, d)


def _rotary_attention(wq: Tensor, bq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor, rq: Tensor,
                      rk: Tensor, causal: bool,
                      bk: Tensor | None = None):  # type: ignore[no-untyped-def]
    """DP attention with per-position maps `q_i = (x_i W^Q_h + b^Q_h) R_i`,
    `k_j = (x_j W^K_h + b^K_h) R'_j` (b^K = 0 when not given)."""
    heads, _, d = wq.shape

    def f(x: Tensor) -> Tensor:  # (N, D) -> (N, D)
        n = x.shape[0]
        u = torch.einsum("nD,hDd->hnd", x, wq) + bq[:, None, :]  # (H, N, d)
        q = torch.einsum("hnd,nde->hne", u, rq)  # (H, N, d)
        w = torch.einsum("nD,hDd->hnd", x, wk)  # (H, N, d)
        if bk is not None:
            w = w + bk[:, None, :]
        k = torch.einsum("hnd,nde->hne", w, rk)  # (H, N, d)
        v = torch.einsum("nD,hDd->hnd", x, wv)  # (H, N, dv)
        logits = q @ k.transpose(-1, -2) / math.sqrt(d)  # (H, N, N)
        if causal:
            mask = torch.ones(n, n, dtype=torch.bool).triu(1)
            logits = logits.masked_fill(mask, float("-inf"))
        y = (torch.softmax(logits, -1) @ v).transpose(0, 1).reshape(n, -1)  # (N, H dv)
        return y @ wo

    return f


def _in_ball(n: int, dm: int, radius: float, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dm, generator=g, dtype=torch.float64)
    r = radius * torch.rand(n, 1, generator=g, dtype=torch.float64) ** 0.5
    return x / x.norm(dim=-1, keepdim=True) * r  # (N, D)


@settings(max_examples=at_most(60), deadline=None)  # an example costs ~70 ms on 2 shared cores
@given(shape=st.sampled_from([(2, 1, 2), (4, 1, 4), (4, 2, 2), (6, 2, 2)]),
       n=st.integers(1, 4), causal=st.booleans(), radius=st.floats(0.1, 5.0),
       scale=st.floats(0.3, 3.0), seed=st.integers(0, 10**6))
def test_rotary_dp_bound_never_below_exact_jacobian(shape: tuple[int, int, int], n: int,
                                                    causal: bool, radius: float, scale: float,
                                                    seed: int) -> None:
    """The ball bound on the unrotated weights, its scale times rho_q rho_k, dominates the
    exact Jacobian of attention with random per-position rotations (inside the ball and
    after a short ascent)."""
    dm, h, d = shape
    g = torch.Generator().manual_seed(seed)
    wq, wk, wv = (scale * torch.randn(h, dm, d, generator=g, dtype=torch.float64)
                  for _ in range(3))
    wo = scale * torch.randn(h * d, dm, generator=g, dtype=torch.float64)
    bq = scale * torch.randn(h, d, generator=g, dtype=torch.float64)
    rq, rk = _rotations(n, d, seed + 1), _rotations(n, d, seed + 2)
    rho_q, _ = rotation_norm_upper(rq.numpy())
    rho_k, _ = rotation_norm_upper(rk.numpy())
    s = mul_up(inv_sqrt_up(d), rho_q, rho_k)
    bound = dp_mha_radius_bound(wq.numpy(), wk.numpy(), wv.numpy(), wo.numpy(), n, radius,
                                "2", scale=s, bq=bq.numpy())
    f = _rotary_attention(wq, bq, wk, wv, wo, rq, rk, causal)
    x = _in_ball(n, dm, radius, seed + 3)
    assert float(torch.linalg.matrix_norm(jacobian_matrix(f, x), 2)) <= bound
    # a short ascent, projected back onto the ball
    xa = x.clone()
    for _ in range(3):
        xa = xa + 0.3 * radius * torch.randn(xa.shape, generator=g, dtype=torch.float64)
        xa = xa * torch.clamp(radius / xa.norm(dim=-1, keepdim=True).clamp_min(1e-30), max=1.0)
        assert float(torch.linalg.matrix_norm(jacobian_matrix(f, xa), 2)) <= bound


@settings(max_examples=at_most(60), deadline=None)  # an example costs ~70 ms on 2 shared cores
@given(shape=st.sampled_from([(2, 1, 2), (4, 1, 4), (4, 2, 2), (6, 2, 2)]),
       n=st.integers(2, 4), causal=st.booleans(), radius=st.floats(0.1, 5.0),
       scale=st.floats(0.3, 3.0), bias=st.sampled_from([1.0, 10.0, 30.0]),
       seed=st.integers(0, 10**6))
def test_rotary_dp_bound_with_key_bias_never_below_exact_jacobian(
        shape: tuple[int, int, int], n: int, causal: bool, radius: float, scale: float,
        bias: float, seed: int) -> None:
    """A key bias rotating with the key's position (Qwen2's k_proj bias): the bound without
    row centring (Kmax = R ||W^K|| + ||b^K||, `replaced=True`) at the scale times rho_q rho_k
    dominates the exact Jacobian inside the ball and after a short ascent."""
    dm, h, d = shape
    g = torch.Generator().manual_seed(seed)
    wq, wk, wv = (scale * torch.randn(h, dm, d, generator=g, dtype=torch.float64)
                  for _ in range(3))
    wo = scale * torch.randn(h * d, dm, generator=g, dtype=torch.float64)
    bq = scale * torch.randn(h, d, generator=g, dtype=torch.float64)
    bk = bias * scale * torch.randn(h, d, generator=g, dtype=torch.float64)
    rq, rk = _rotations(n, d, seed + 1), _rotations(n, d, seed + 2)
    rho_q, _ = rotation_norm_upper(rq.numpy())
    rho_k, _ = rotation_norm_upper(rk.numpy())
    s = mul_up(inv_sqrt_up(d), rho_q, rho_k)
    bound = dp_mha_radius_bound(wq.numpy(), wk.numpy(), wv.numpy(), wo.numpy(), n, radius,
                                "2", scale=s, bq=bq.numpy(), bk=bk.numpy(), replaced=True)
    f = _rotary_attention(wq, bq, wk, wv, wo, rq, rk, causal, bk)
    x = _in_ball(n, dm, radius, seed + 3)
    assert float(torch.linalg.matrix_norm(jacobian_matrix(f, x), 2)) <= bound
    xa = x.clone()
    for _ in range(3):
        xa = xa + 0.3 * radius * torch.randn(xa.shape, generator=g, dtype=torch.float64)
        xa = xa * torch.clamp(radius / xa.norm(dim=-1, keepdim=True).clamp_min(1e-30), max=1.0)
        assert float(torch.linalg.matrix_norm(jacobian_matrix(f, xa), 2)) <= bound


def test_rotation_norm_upper_bounds_and_flags_non_rotations() -> None:
    r = _rotations(5, 4, 0).numpy()
    rho, defect = rotation_norm_upper(r)
    assert 1.0 <= rho <= 1.0 + 1e-12 and defect < 1e-14
    # a float32 rotation table: rho covers its largest singular value, just above 1
    r32 = r.astype(np.float32).astype(np.float64)
    rho32, _ = rotation_norm_upper(r32)
    assert max(np.linalg.norm(m, 2) for m in r32) <= rho32 < 1 + 1e-6
    rho2, defect2 = rotation_norm_upper(1.5 * r)
    assert rho2 >= 1.5 and defect2 > 1.0


@settings(deadline=None)
@given(seed=st.integers(0, 10**6), width=st.integers(1, 4), n=st.integers(1, 3),
       radius=st.floats(0.05, 8.0), scale=st.floats(0.2, 3.0))
def test_product_flow_never_below_exact_jacobian(seed: int, width: int, n: int, radius: float,
                                                 scale: float) -> None:
    """`a * b` with a = silu(x G), b = x U on the ball (a gated MLP's product): the rule's
    constant and radius dominate the exact Jacobian norm and the output token norms."""
    g = torch.Generator().manual_seed(seed)
    dm = 3
    wg = scale * torch.randn(dm, width, generator=g, dtype=torch.float64)
    wu = scale * torch.randn(dm, width, generator=g, dtype=torch.float64)
    sg, su = (float(torch.linalg.matrix_norm(w, 2)) * (1 + 1e-12) for w in (wg, wu))
    a = Flow(SILU_LIPSCHITZ * sg, sg * radius * (1 + 1e-12), (n, width))
    b = Flow(su, su * radius * (1 + 1e-12), (n, width))
    out = product_bound(a, b, (n, width))

    def f(x: Tensor) -> Tensor:  # (N, D) -> (N, width)
        return torch.nn.functional.silu(x @ wg) * (x @ wu)

    x = _in_ball(n, dm, radius, seed + 1)
    assert max_jacobian_norm(f, x, "2", steps=0) <= out.lip
    assert out.radius is not None
    assert float(f(x).norm(dim=-1).max()) <= out.radius


def test_silu_constant_bounds_its_derivative() -> None:
    x = torch.linspace(-20, 20, 400001, dtype=torch.float64)
    s = torch.sigmoid(x)
    deriv = s * (1 + x * (1 - s))
    assert float(deriv.abs().max()) <= SILU_LIPSCHITZ
    assert float(deriv.abs().max()) >= SILU_LIPSCHITZ - 2e-4  # tight to the rounding
    assert bool((torch.nn.functional.silu(x).abs() <= x.abs()).all())


class _RotaryBlock(nn.Module):
    """A pre-norm (RMSNorm) rotary attention block written as LLaMA does (rotate_half)."""

    def __init__(self, dm: int, heads: int, n: int, key_bias: bool = False,
                 kv_heads: int | None = None) -> None:
        super().__init__()
        self.h, self.d = heads, dm // heads
        self.kv = kv_heads or heads  # grouped-query attention: kv_heads < heads
        self.g = nn.Parameter(1 + 0.1 * torch.randn(dm))
        self.q = nn.Linear(dm, dm, bias=False)
        self.k = nn.Linear(dm, self.kv * self.d, bias=key_bias)
        self.v = nn.Linear(dm, self.kv * self.d, bias=False)
        self.o = nn.Linear(dm, dm, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, self.d, 2).float() / self.d))
        ang = torch.arange(n).float()[:, None] * inv[None, :]  # (N, d/2)
        emb = torch.cat([ang, ang], dim=-1)  # (N, d)
        self.register_buffer("cos", emb.cos())
        self.register_buffer("sin", emb.sin())

    @staticmethod
    def _half(t: Tensor) -> Tensor:
        a, b = t.chunk(2, dim=-1)
        return torch.cat([-b, a], dim=-1)

    def forward(self, x: Tensor) -> Tensor:  # (1, N, D)
        b, n, dm = x.shape
        z = self.g * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)  # LLaMA's RMSNorm
        q = self.q(z).view(b, n, self.h, self.d).transpose(1, 2)  # (1, H, N, d)
        k, v = (p(z).view(b, n, self.kv, self.d).transpose(1, 2)
                for p in (self.k, self.v))  # (1, Hkv, N, d)
        q = q * self.cos + self._half(q) * self.sin
        k = k * self.cos + self._half(k) * self.sin
        rep = self.h // self.kv  # HF's repeat_kv: each key/value head serves `rep` heads
        k, v = (t[:, :, None].expand(b, self.kv, rep, n, self.d).reshape(b, self.h, n, self.d)
                for t in (k, v))  # (1, H, N, d)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.d), dim=-1)  # (1, H, N, N)
        return x + self.o((att @ v).transpose(1, 2).reshape(b, n, dm))


def _export(m: nn.Module, x: Tensor, path: Path, dynamo: bool) -> Path:
    return export_to(m, x, path, dynamo)


@pytest.mark.parametrize("dynamo", [False, True])
@pytest.mark.parametrize("kv_heads", [None, 1])
def test_onnx_rotary_block_certified_above_jacobian(tmp_path: Path, dynamo: bool,
                                                    kv_heads: int | None) -> None:
    """Rotary attention, with grouped-query attention too (one key/value head shared)."""
    torch.manual_seed(0)
    n, dm = 5, 8
    m = _RotaryBlock(dm, 2, n, kv_heads=kv_heads).eval()
    x = torch.randn(1, n, dm)
    path = _export(m, x, tmp_path / "rot.onnx", dynamo)
    model = load_onnx(path.read_bytes(), path.name)
    (layer,) = recognise(GraphInfo(model.module, n))
    assert layer.kind == "dp" and layer.reason is None
    assert 1.0 < layer.position_factor < 1.0 + 1e-6
    res = analyse(model, "2")
    assert res.verdict == "certified" and res.upper is not None
    assert "rotary position embeddings" in res.method
    f64 = m.double()
    lower = max_jacobian_norm(lambda z: f64(z.unsqueeze(0)).squeeze(0),
                              torch.randn(n, dm, dtype=torch.float64), "2", steps=2)
    assert lower <= res.upper


@pytest.mark.parametrize("dynamo", [False, True])
def test_onnx_rotary_key_bias_certified_with_the_key_bias_counted(tmp_path: Path,
                                                                  dynamo: bool) -> None:
    """A trained Qwen2-style k_proj bias (here 3x N(0, 1)): recognised, certified with the
    Kmax form, and above the module's float64 Jacobian norm; the same block without the bias
    gets a smaller number (the bias counts)."""
    torch.manual_seed(1)
    n, dm = 4, 8
    m = _RotaryBlock(dm, 2, n, key_bias=True).eval()
    with torch.no_grad():
        m.k.bias.normal_(std=3.0)
    x = torch.randn(1, n, dm)
    path = _export(m, x, tmp_path / "rotb.onnx", dynamo)
    model = load_onnx(path.read_bytes(), path.name)
    (layer,) = recognise(GraphInfo(model.module, n))
    assert layer.kind == "dp" and layer.reason is None and layer.rotated_key_bias
    res = analyse(model, "2")
    assert res.verdict == "certified" and res.upper is not None, res.reason
    f64 = m.double()
    lower = max_jacobian_norm(lambda z: f64(z.unsqueeze(0)).squeeze(0),
                              torch.randn(n, dm, dtype=torch.float64), "2", steps=2)
    assert lower <= res.upper
    with torch.no_grad():
        m.float().k.bias.zero_()
    plain = analyse(load_onnx(_export(m, x, tmp_path / "rot0.onnx", dynamo).read_bytes()), "2")
    assert plain.verdict == "certified" and plain.upper is not None
    assert plain.upper < res.upper
