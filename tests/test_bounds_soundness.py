"""Soundness: exact Jacobian norms never exceed the certified bound.

For every bound kind, hypothesis draws random weights (at several scales) and inputs (at
several scales), computes the exact float64 Jacobian with jacrev at the input and along a short
gradient ascent from it, and checks ||J|| <= certified upper bound. Examples per kind: 500 in
`make test-all` (CI), 20 in `make test`, 10^4 with HYPOTHESIS_PROFILE=soak.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from lsa_models import (
    L2MHA,
    AttentionConfig,
    BlockConfig,
    FFNConfig,
    TransformerBlock,
    certify,
)
from lsa_models.bounds.formulas import g_lipschitz, l2_mha_candidates
from tests.jacobians import max_jacobian_norm

NORMS = st.sampled_from(["2", "inf"])
SCALES = st.sampled_from([0.1, 0.5, 1.0, 2.0, 5.0])
SEEDS = st.integers(0, 2**31 - 1)


def _randomise(module: nn.Module, seed: int, weight_scale: float) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * weight_scale
                    / max(1, p.shape[-1]) ** 0.5)
    return module.double().eval()


def _input(seed: int, shape: tuple[int, ...], scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


def _check(module: nn.Module, x: torch.Tensor, norm: str) -> None:
    n = x.shape[0]
    bound = certify(module, norm, n)  # type: ignore[arg-type]
    assert bound.verdict == "certified", bound.reason
    assert bound.upper is not None

    def f(z: torch.Tensor) -> torch.Tensor:
        return module(z[None])[0]

    observed = max_jacobian_norm(f, x, norm, steps=2)
    assert observed <= bound.upper, (observed, bound.upper)


@given(seed=SEEDS, n=st.integers(2, 5), heads=st.integers(1, 2), head_dim=st.integers(1, 3),
       norm=NORMS, w_scale=SCALES, x_scale=SCALES)
def test_l2_mha_bound_never_below_jacobian_norm(seed: int, n: int, heads: int, head_dim: int,
                                                norm: str, w_scale: float,
                                                x_scale: float) -> None:
    m = _randomise(L2MHA(heads * head_dim, heads), seed, w_scale)
    _check(m, _input(seed, (n, heads * head_dim), x_scale), norm)


@given(seed=SEEDS, n=st.integers(2, 5), heads=st.integers(1, 2), head_dim=st.integers(1, 3),
       norm=NORMS, w_scale=SCALES, x_scale=SCALES)
def test_causal_l2_mha_bound_never_below_jacobian_norm(seed: int, n: int, heads: int,
                                                       head_dim: int, norm: str,
                                                       w_scale: float, x_scale: float) -> None:
    m = _randomise(L2MHA(heads * head_dim, heads, causal=True), seed, w_scale)
    _check(m, _input(seed, (n, heads * head_dim), x_scale), norm)


@given(seed=SEEDS, n=st.integers(2, 5), heads=st.integers(1, 3), head_dim=st.integers(1, 3),
       norm=NORMS, causal=st.booleans(), w_scale=SCALES, x_scale=SCALES)
def test_l2_mha_every_candidate_never_below_jacobian_norm(seed: int, n: int, heads: int,
                                                          head_dim: int, norm: str,
                                                          causal: bool, w_scale: float,
                                                          x_scale: float) -> None:
    """Each bound `l2_mha_bound` takes the minimum of holds on its own (docs/certification.md,
    "A tighter L2 attention bound"): a wrong derivation cannot hide behind a looser one."""
    cfg = AttentionConfig(heads * head_dim, heads, causal=causal)
    m = L2MHA.from_config(cfg)
    _randomise(m, seed, w_scale)
    bounds = l2_mha_candidates(m.query_weights().detach(), m.value_weights().detach(),
                               m.output_weight().detach(), n, norm, causal)

    def f(z: torch.Tensor) -> torch.Tensor:
        return m(z[None])[0]

    observed = max_jacobian_norm(f, _input(seed, (n, heads * head_dim), x_scale), norm, steps=2)
    for name, upper in bounds.items():
        assert observed <= upper, (name, observed, upper)


def _g_map(d: int, causal: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """`G(Q) = P(Q) Q`, logits `-||q_i - q_j||^2 / sqrt(d)`, written out (N, d) -> (N, d)."""

    def g(q: torch.Tensor) -> torch.Tensor:  # (N, d)
        diff = q[:, None, :] - q[None, :, :]  # (N, N, d)
        logits = -(diff * diff).sum(-1) / math.sqrt(d)  # (N, N)
        if causal:
            n = q.shape[0]
            mask = torch.ones(n, n, dtype=torch.bool).triu(1)
            logits = logits.masked_fill(mask, float("-inf"))
        return torch.softmax(logits, dim=-1) @ q  # (N, d)

    return g


@given(seed=SEEDS, n=st.integers(2, 8), d=st.integers(1, 4), norm=NORMS,
       causal=st.booleans(), x_scale=st.sampled_from([0.3, 1.0, 2.0, 4.0]),
       clustered=st.booleans())
def test_g_lipschitz_never_below_jacobian_norm(seed: int, n: int, d: int, norm: str,
                                               causal: bool, x_scale: float,
                                               clustered: bool) -> None:
    """The identity-weight map every chained candidate goes through. `clustered` starts from
    the proof's extremal shape: one token apart from a cluster of the others."""
    x = _input(seed, (n, d), x_scale)
    if clustered:
        x = x[:1].repeat(n, 1) * 0.05 + torch.cat([torch.zeros(1, d), x[1:2].repeat(n - 1, 1)])
    observed = max_jacobian_norm(_g_map(d, causal), x, norm, steps=3)
    assert observed <= g_lipschitz(n, norm, d, causal)


@given(seed=SEEDS, n=st.integers(1, 4), dim=st.integers(2, 6), norm=NORMS,
       eps=st.sampled_from([1e-5, 1e-3, 0.1, 1.0]), x_scale=st.sampled_from([1e-3, 0.01, 0.1, 1.0]))
def test_layernorm_bound_never_below_jacobian_norm(seed: int, n: int, dim: int, norm: str,
                                                   eps: float, x_scale: float) -> None:
    ln = nn.LayerNorm(dim, eps=eps)
    _randomise(ln, seed, 1.0)
    # The largest Jacobians sit at inputs with variance comparable to eps.
    _check(ln, _input(seed, (n, dim), x_scale * eps**0.5 * 10), norm)


@given(seed=SEEDS, n=st.integers(1, 4), d_in=st.integers(1, 6), d_out=st.integers(1, 6),
       norm=NORMS, w_scale=SCALES)
def test_linear_bound_never_below_jacobian_norm(seed: int, n: int, d_in: int, d_out: int,
                                                norm: str, w_scale: float) -> None:
    lin = _randomise(nn.Linear(d_in, d_out), seed, w_scale)
    _check(lin, _input(seed, (n, d_in), 1.0), norm)


@given(seed=SEEDS, n=st.integers(2, 4), heads=st.integers(1, 2), head_dim=st.integers(1, 2),
       norm=NORMS, norm_first=st.booleans(), w_scale=SCALES, x_scale=SCALES,
       act=st.sampled_from(["relu", "gelu", "tanh", "sigmoid"]))
def test_block_bound_never_below_jacobian_norm(seed: int, n: int, heads: int, head_dim: int,
                                               norm: str, norm_first: bool, w_scale: float,
                                               x_scale: float, act: str) -> None:
    d = heads * head_dim
    cfg = BlockConfig(AttentionConfig(d, heads), FFNConfig(d, 2 * d, act),  # type: ignore[arg-type]
                      norm_first=norm_first, ln_eps=0.1)
    blk = _randomise(TransformerBlock(cfg), seed, w_scale)
    _check(blk, _input(seed, (n, d), x_scale), norm)
