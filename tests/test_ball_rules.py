"""Soundness of the per-layer local rules on the layer graph (lsa_models/bounds/layer_graph/
ball.py, docs/local-layer-graph.md "Per-layer local rules on the layer graph"): exact float64
Jacobians at points of the ball, including the worst-placed ones, never exceed them."""

from __future__ import annotations

import math
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lsa_models.bounds.layer_graph import DPAttention
from lsa_models.bounds.layer_graph.ball import BallValue, dp_probs_bound, norm_ball_factors
from tests.jacobians import ascend, jacobian_norm


def _in_token_balls(c: torch.Tensor, rho: torch.Tensor, gen: torch.Generator
                    ) -> torch.Tensor:
    """A point with every token within its radius (half of them on the sphere)."""
    u = torch.randn(c.shape, generator=gen, dtype=torch.float64)
    u = u / u.norm(dim=-1, keepdim=True)
    r = torch.rand(c.shape[:-1] + (1,), generator=gen, dtype=torch.float64)
    r = torch.where(torch.rand(r.shape, generator=gen, dtype=torch.float64) < 0.5,
                    torch.ones_like(r), r)
    return c + u * r * rho[..., None]


@settings(deadline=None)
@given(n=st.integers(1, 4), d=st.integers(2, 6), seed=st.integers(0, 10**6),
       log_eps=st.floats(-6, 0), scale=st.floats(0.01, 5.0), rel=st.floats(0.0, 1.5),
       rms=st.booleans())
def test_norm_ball_factor_dominates_token_jacobians_on_the_ball(
        n: int, d: int, seed: int, log_eps: float, scale: float, rel: float, rms: bool
) -> None:
    gen = torch.Generator().manual_seed(seed)
    eps = 10.0 ** log_eps
    gamma = torch.randn(d, generator=gen, dtype=torch.float64)
    c = scale * torch.randn(n, d, generator=gen, dtype=torch.float64)
    centred = c if rms else c - c.mean(-1, keepdim=True)
    rho = rel * centred.norm(dim=-1)  # radii up to 1.5x the centred norm
    factors = norm_ball_factors(gamma.numpy(), eps, BallValue(c.numpy(), 1.0, rho.numpy()),
                                rms)

    def token_map(x: torch.Tensor) -> torch.Tensor:  # (D,) -> (D,)
        z = x if rms else x - x.mean()
        return gamma * z / torch.sqrt((z * z).mean() + eps)

    # the worst point: each token moved straight towards the mean line (smallest ||P x||)
    toward = c - centred / centred.norm(dim=-1, keepdim=True).clamp_min(1e-300) * \
        torch.minimum(rho, centred.norm(dim=-1))[:, None]
    for x in (_in_token_balls(c, rho, gen), toward):
        for i in range(n):
            assert jacobian_norm(token_map, x[i], "2") <= factors[i]
            moved = (token_map(x[i]) - token_map(c[i])).norm()
            assert float(moved) <= factors[i] * float(rho[i]) * (1 + 1e-9) + 1e-12


def _dp_layer(h: int, dm: int, scale: float, gen: torch.Generator) -> DPAttention:
    d = dm // h

    def w(*shape: int) -> np.ndarray:
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)
                / math.sqrt(dm)).numpy()

    return DPAttention("attn", w(h, dm, d), w(h, dm, d), w(h, dm, d), w(h * d, dm), 0,
                       bq=w(h, d), bv=w(h, d), bo=w(dm))


def _dp_map(layer: DPAttention, causal: bool):  # type: ignore[no-untyped-def]
    wq, wk, wv, wo = (torch.from_numpy(np.asarray(a)) for a in
                      (layer.wq, layer.wk, layer.wv, layer.wo))
    bq, bv, bo = (torch.from_numpy(np.asarray(a)) for a in (layer.bq, layer.bv, layer.bo))
    s = 1.0 / math.sqrt(wq.shape[-1])

    def probs(x: torch.Tensor) -> torch.Tensor:  # (N, D) -> (H, N, N)
        q = torch.einsum("nd,hde->hne", x, wq) + bq[:, None, :]
        k = torch.einsum("nd,hde->hne", x, wk)
        z = s * q @ k.transpose(-1, -2)
        if causal:
            mask = torch.ones(x.shape[0], x.shape[0], dtype=torch.bool).triu(1)
            z = z.masked_fill(mask, float("-inf"))
        return torch.softmax(z, -1)

    def f(x: torch.Tensor) -> torch.Tensor:  # (N, D) -> (N, D)
        v = torch.einsum("nd,hde->hne", x, wv) + bv[:, None, :]
        heads = probs(x) @ v  # (H, N, d)
        return heads.transpose(0, 1).reshape(x.shape[0], -1) @ wo + bo

    return f, probs


@settings(deadline=None)
@given(shape=st.sampled_from([(2, 1), (4, 2), (6, 3), (4, 1)]), n=st.integers(1, 4),
       causal=st.booleans(), seed=st.integers(0, 10**6), scale=st.floats(0.2, 4.0),
       tokens=st.floats(0.1, 5.0), log_rho=st.floats(-4, 0.5))
def test_dp_bound_around_the_centre_dominates_jacobians_and_moves(
        shape: tuple[int, int], n: int, causal: bool, seed: int, scale: float, tokens: float,
        log_rho: float) -> None:
    dm, h = shape
    gen = torch.Generator().manual_seed(seed)
    layer = _dp_layer(h, dm, scale, gen)
    f, probs = _dp_map(layer, causal)
    c = tokens * torch.randn(n, dm, generator=gen, dtype=torch.float64)
    rho = 10.0 ** log_rho * torch.rand(n, generator=gen, dtype=torch.float64)
    x0 = BallValue(c.numpy(), 1.0, rho.numpy())
    with torch.no_grad():
        p0 = probs(c).numpy()
    jac, dev = dp_probs_bound(layer, x0, p0)
    with torch.no_grad():
        y0 = f(c)
    starts = [_in_token_balls(c, rho, gen) for _ in range(2)]
    # and a point pushed up by Jacobian ascent, projected back onto the token balls
    pushed = ascend(f, starts[0].clone(), "2", 3)[0].detach()
    step = pushed - c
    norms = step.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    starts.append(c + step * torch.minimum(torch.ones_like(norms), rho[:, None] / norms))
    for x in starts:
        assert jacobian_norm(f, x, "2") <= jac
        with torch.no_grad():
            moved = (f(x) - y0).norm(dim=-1).numpy()
        assert np.all(moved <= dev * (1 + 1e-9) + 1e-12)


def test_ball_bound_of_an_encoder_is_sound_and_below_the_global_one() -> None:
    from lsa_models.engine.local import _global
    from lsa_models.onnx import LoadOptions, load_onnx
    from lsa_models.onnx.ball import ball_bound

    class Encoder(nn.Module):  # post-norm, ReLU: the bench's encoder, one layer
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x, src_mask=None, is_causal=False)

    torch.manual_seed(0)
    layer = Encoder().eval()
    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "enc.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(layer, (x,), str(path), dynamo=False, opset_version=18,
                              input_names=["x"], output_names=["y"])
        om = load_onnx(path.read_bytes(), "enc.onnx", LoadOptions(check_ort=False))
    x0 = x.double().numpy()
    f64 = om.module.with_dtype(torch.float64)
    gen = torch.Generator().manual_seed(2)
    for eps in (1e-3, 1e-1):
        upper, layers = ball_bound(om, x0, eps)
        glob = _global(om, "2", x0, eps).upper
        assert glob is not None and upper <= glob
        assert any(lb.kind == "dp_mha_ball" for lb in layers)
        for _ in range(3):
            u = torch.randn(x.shape, generator=gen, dtype=torch.float64)
            xs = torch.from_numpy(x0) + eps * u / u.norm()
            assert jacobian_norm(f64, xs, "2") <= upper


def test_probabilities_are_used_only_when_they_are_the_layers_own() -> None:
    from lsa_models.onnx.ball import _probabilities_match

    gen = torch.Generator().manual_seed(3)
    layer = _dp_layer(2, 4, 2.0, gen)
    _, probs = _dp_map(layer, causal=True)
    x = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        p = probs(x).numpy()
    assert _probabilities_match(layer, x.numpy(), p)
    assert not _probabilities_match(layer, x.numpy(), p[::-1].copy())  # heads swapped
    assert not _probabilities_match(layer, x.numpy(), p.transpose(0, 2, 1).copy())
