"""Certified invertible blocks: contraction certificates, fixed-point inverse, log-det."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lsa_models import certify
from lsa_models.bounds.formulas import l2_mha_candidates
from lsa_models.config import AttentionConfig, ConfigError
from lsa_models.invertible import (
    ContractiveFFNBlock,
    ContractiveFFNConfig,
    ContractiveL2Block,
    ContractiveL2Config,
    ContractiveTrunk,
    ContractiveTrunkConfig,
    DPResidualBlock,
    NotInvertibleError,
    banach_iterations,
    fixed_point_inverse,
    frozen_scales,
    logdet_estimate,
    trunk_logdet_estimate,
)
from lsa_models.invertible.estimate import estimate_norms, estimate_norms_warm
from tests.profile import at_most

F64 = torch.float64


def _seq_err(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).flatten(1).norm(dim=1)  # (B,)


def _jac(fn, x: torch.Tensor) -> torch.Tensor:
    """Jacobian of a (N, D) -> (N, D) map at one sequence, as an (ND, ND) matrix."""
    # Row by row (no vmap): SDPA has no batching rule for its CPU backward, and these are tiny.
    j = torch.autograd.functional.jacobian(lambda z: fn(z[None])[0], x, vectorize=False)
    return j.reshape(x.numel(), x.numel())


def _trunk(seed: int, d: int, h: int, layers: int, n: int, c: float, causal: bool = True,
           weight_scale: float = 1.0) -> ContractiveTrunk:
    torch.manual_seed(seed)
    trunk = ContractiveTrunk(ContractiveTrunkConfig(d, h, layers, 2 * d, n, c, causal)).double()
    with torch.no_grad():
        for p in trunk.parameters():
            p.mul_(weight_scale)
    return trunk.eval()  # certified scales (training mode uses estimates)


@settings(max_examples=at_most(40))  # an example costs ~70 ms on 2 shared cores
@given(seed=st.integers(0, 10_000), d_h=st.sampled_from([(2, 1), (4, 2), (6, 3), (8, 2)]),
       layers=st.integers(1, 2), n=st.integers(1, 6), c=st.floats(0.3, 0.97),
       causal=st.booleans(), scale=st.sampled_from([0.3, 1.0, 4.0]))
def test_trunk_inverse_reconstructs_with_sound_bound(seed, d_h, layers, n, c, causal, scale):
    d, h = d_h
    trunk = _trunk(seed, d, h, layers, n, c, causal, scale)
    x = torch.randn(2, n, d, dtype=F64, generator=torch.Generator().manual_seed(seed)) * 2
    with torch.no_grad():
        y = trunk(x)
        res = trunk.inverse(y, atol=1e-9, max_iter=5000)
    assert res.converged
    assert (res.x - x).abs().max() <= 1e-5
    # The trunk bound accumulates the blocks' Banach bounds; rounding adds ~1e-15 per step.
    assert float(_seq_err(res.x, x).max()) <= res.error_bound + 1e-12
    for blk_res in res.blocks:
        assert blk_res.status == "atol"
        assert blk_res.predicted_iterations is not None
        assert blk_res.iterations <= blk_res.predicted_iterations


@given(seed=st.integers(0, 10_000), kind=st.sampled_from(["attn", "ffn"]),
       c=st.floats(0.5, 0.99), atol=st.sampled_from([1e-4, 1e-6, 1e-8]),
       scale=st.sampled_from([0.5, 1.0, 3.0]))
def test_block_inverse_bound_covers_true_error_and_banach_count(seed, kind, c, atol, scale):
    torch.manual_seed(seed)
    blk = (ContractiveL2Block(ContractiveL2Config(4, 2, 5, c, causal=seed % 2 == 0))
           if kind == "attn" else ContractiveFFNBlock(ContractiveFFNConfig(4, 8, c, "gelu")))
    blk = blk.double()
    with torch.no_grad():
        for p in blk.parameters():
            p.mul_(scale)
        x = torch.randn(3, 5, 4, dtype=F64) * 3
        y = blk(x)
        res = blk.inverse(y, atol=atol, max_iter=10_000)
    assert res.converged and res.status == "atol"
    assert res.error_bound <= atol
    assert float(_seq_err(res.x, x).max()) <= res.error_bound + 1e-12
    assert res.iterations <= res.predicted_iterations


def _ffn_block(c: float = 0.9) -> ContractiveFFNBlock:
    torch.manual_seed(3)
    return ContractiveFFNBlock(ContractiveFFNConfig(4, 8, c)).double()


def test_inverse_atol_branch():
    blk = _ffn_block()
    x = torch.randn(2, 3, 4, dtype=F64)
    with torch.no_grad():
        res = blk.inverse(blk(x), atol=1e-8, rtol=0.0)
    assert (res.status, res.converged) == ("atol", True)
    assert res.error_bound <= 1e-8
    assert torch.equal(res.unwrap(), res.x)


def test_inverse_rtol_branch():
    blk = _ffn_block()
    x = torch.randn(2, 3, 4, dtype=F64) * 100
    with torch.no_grad():
        res = blk.inverse(blk(x), atol=0.0, rtol=1e-6)
    assert (res.status, res.converged) == ("rtol", True)
    assert res.error_bound <= 1e-6 * float(res.x.flatten(1).norm(dim=1).max())
    assert float(_seq_err(res.x, x).max()) <= res.error_bound
    assert res.predicted_iterations is None  # Banach's a-priori count needs an absolute atol


def test_inverse_rtol_branch_wins_when_atol_is_unreachable_first():
    blk = _ffn_block()
    x = torch.randn(2, 3, 4, dtype=F64) * 1e4
    with torch.no_grad():
        res = blk.inverse(blk(x), atol=1e-30, rtol=1e-4)
    assert res.status == "rtol"


def test_inverse_max_iter_branch_reports_failure():
    blk = _ffn_block(c=0.99)
    x = torch.randn(2, 3, 4, dtype=F64) * 10
    with torch.no_grad():
        res = blk.inverse(blk(x), atol=1e-14, max_iter=2)
    assert (res.status, res.converged, res.iterations) == ("max_iter", False, 2)
    assert math.isfinite(res.error_bound) and res.error_bound > 1e-14
    assert "max_iter=2" in res.message
    with pytest.raises(NotInvertibleError, match="max_iter"):
        res.unwrap()


def test_inverse_rejects_impossible_tolerances():
    blk = _ffn_block()
    y = torch.randn(1, 3, 4, dtype=F64)
    with pytest.raises(ValueError, match="atol > 0 or rtol > 0"):
        blk.inverse(y, atol=0.0, rtol=0.0)
    with pytest.raises(ValueError, match="max_iter"):
        blk.inverse(y, max_iter=0)
    with pytest.raises(ValueError, match="atol and rtol"):
        blk.inverse(y, atol=-1.0)


def test_fixed_point_inverse_detects_blow_up():
    y = torch.ones(1, 2, 2, dtype=F64)
    res = fixed_point_inverse(lambda x: -3.0 * x, y, lipschitz=None, atol=1e-6, max_iter=1000)
    assert res.status == "diverged" and not res.converged
    assert res.iterations < 1000 and res.error_bound == math.inf


def test_banach_iterations_is_the_smallest_sufficient_count():
    for c, first, tol in [(0.9, 1.0, 1e-6), (0.5, 3.0, 1e-3), (0.99, 0.1, 1e-8)]:
        k = banach_iterations(c, first, tol)
        assert c**k / (1 - c) * first <= tol * (1 + 1e-12)
        assert k == 1 or c ** (k - 1) / (1 - c) * first > tol


def _theorem31_dp_block() -> tuple[DPResidualBlock, torch.Tensor]:
    """D = H = 1, all weights 1, x_1 = 0 and the other tokens spread out (docs/theory.md)."""
    blk = DPResidualBlock(AttentionConfig(1, 1, "dp")).double()
    with torch.no_grad():
        for lin in (blk.attn.q_proj, blk.attn.k_proj, blk.attn.v_proj, blk.attn.out_proj):
            lin.weight.fill_(1.0)
        blk.attn.out_proj.bias.zero_()
    spread = torch.linspace(-1.0, 1.0, 9, dtype=F64) * 10
    x = torch.cat([torch.zeros(1, dtype=F64), spread])[None, :, None]  # (1, 10, 1)
    return blk, x


def test_dp_residual_fixed_point_fails_and_is_reported():
    blk, x_true = _theorem31_dp_block()
    # The Jacobian of the DP branch at this input is far above 1: no contraction.
    assert torch.linalg.matrix_norm(_jac(blk.branch, x_true[0]), 2) > 10
    with torch.no_grad():
        y = blk(x_true)
        res = blk.inverse(y, atol=1e-8, max_iter=300)
    assert not res.converged
    assert res.status in ("max_iter", "diverged")
    assert res.error_bound == math.inf and res.lipschitz is None
    assert "no certified Lipschitz constant" in res.message
    # What the iteration ended on is no inverse: far from X* and not solving x + g(x) = y.
    assert float((res.x - x_true).abs().max()) > 1.0
    assert res.residual > 1.0
    with pytest.raises(NotInvertibleError, match="no inverse is returned"):
        res.unwrap()


@pytest.mark.parametrize("kind", ["attn", "ffn"])
def test_logdet_estimate_within_three_standard_errors(kind):
    torch.manual_seed(11)
    if kind == "attn":
        blk = ContractiveL2Block(ContractiveL2Config(4, 2, 3, 0.9, causal=False)).double()
    else:
        blk = ContractiveFFNBlock(ContractiveFFNConfig(4, 8, 0.9, "tanh")).double()
    blk.eval()  # the certified scale (training mode uses power-iteration estimates)
    x = torch.randn(1, 3, 4, dtype=F64) * 2
    jac = _jac(blk.branch, x[0])
    exact = torch.linalg.slogdet(torch.eye(jac.shape[0], dtype=F64) + jac).logabsdet
    rho = float(torch.linalg.matrix_norm(jac, 2))
    assert rho <= blk.lipschitz_upper() <= 0.9
    n_terms = 30
    # Truncation bias with the true ||J||_2 (far below the certified c):
    bias = jac.shape[0] * rho ** (n_terms + 1) / ((n_terms + 1) * (1 - rho))
    with torch.no_grad():
        est = logdet_estimate(blk.branch, x, n_terms=n_terms, n_samples=200,
                              lipschitz=blk.lipschitz_upper(),
                              generator=torch.Generator().manual_seed(5))
    assert float(est.stderr[0]) > 0
    assert abs(float(est.value[0]) - float(exact)) <= 3 * float(est.stderr[0]) + bias
    assert est.truncation_bound >= bias


def test_certificates_bound_the_jacobian_and_compose_in_the_analyzer():
    trunk = _trunk(7, 4, 2, 2, 5, 0.8, causal=True, weight_scale=2.0)
    x = torch.randn(5, 4, dtype=F64)
    for blk in trunk.residual_blocks():
        lip = blk.lipschitz_upper()
        assert lip <= 0.8
        assert float(torch.linalg.matrix_norm(_jac(blk.branch, x), 2)) <= lip
    result = certify(trunk, "2", 5)
    assert result.verdict == "certified"
    assert result.upper == pytest.approx(trunk.lipschitz_upper(), rel=1e-12)
    assert result.upper >= float(torch.linalg.matrix_norm(_jac(trunk, x), 2))
    assert certify(trunk, "inf", 5).verdict == "not_certified"
    # Longer sequences than max_len are not covered by the cached bound: recomputed.
    assert trunk.blocks[0].lipschitz_upper(50) > trunk.blocks[0].lipschitz_upper(5)


def test_scale_follows_weight_updates():
    torch.manual_seed(0)
    attn = ContractiveL2Block(ContractiveL2Config(4, 2, 6, 0.9)).double()
    ffn = ContractiveFFNBlock(ContractiveFFNConfig(4, 8, 0.9)).double()
    x = torch.randn(2, 6, 4, dtype=F64)
    with torch.no_grad():
        before = attn.branch(x), ffn.branch(x)
        u_before = attn._certified()[0]
        # W^O x10 multiplies U by 10 and F by 10; W1, W2 x10 multiply s1, s2 by 10.
        attn.attn.out_proj.weight.mul_(10.0)
        ffn.fc1.weight.mul_(10.0)
        ffn.fc2.weight.mul_(10.0)
        after = attn.branch(x), ffn.branch(x)
    assert attn._certified()[0] == pytest.approx(10 * u_before, rel=1e-9)
    for b, a in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)
    assert attn.lipschitz_upper() <= 0.9 and ffn.lipschitz_upper() <= 0.9


def test_forward_uses_certified_scale_and_surrogate_gradient():
    """The slower scheme (`estimate_in_training = False`, and any grad-enabled call outside
    training mode): the forward value is the certified scale, the gradient the surrogate's."""
    torch.manual_seed(1)
    blk = ContractiveL2Block(ContractiveL2Config(4, 2, 8, 0.9))
    blk.estimate_in_training = False
    u_cert, s_cert = blk._certified()
    s = blk.scale()
    assert isinstance(s, torch.Tensor) and s.requires_grad
    assert float(s.detach()) == s_cert  # the value is the certified one, not the surrogate
    assert s_cert <= 0.9 / u_cert
    u_sur = float(blk._surrogate_u().detach())
    assert abs(u_sur - u_cert) <= 1e-4 * u_cert  # same formula, float32 vs certified float64
    s.backward()
    g = blk.attn.out_proj.weight.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    with torch.no_grad():
        assert blk.scale() == s_cert  # no surrogate without grad


def test_contractive_scale_uses_the_tighter_bound():
    torch.manual_seed(1)
    blk = ContractiveL2Block(ContractiveL2Config(8, 2, 12, 0.9)).eval()
    a = blk.attn
    found = l2_mha_candidates(a.query_weights(), a.value_weights(), a.output_weight(), 12, "2",
                              causal=True)
    u_cert, s_cert = blk._certified()
    assert u_cert == min(found.values()) < found["theorem_3_2"]
    assert blk.scale() == s_cert and blk.lipschitz_upper() <= 0.9


@pytest.mark.parametrize("kind", ["attn", "ffn"])
def test_training_scale_is_a_cheap_estimate_and_eval_is_certified(kind):
    torch.manual_seed(2)
    blk = (ContractiveL2Block(ContractiveL2Config(8, 2, 12, 0.9)) if kind == "attn"
           else ContractiveFFNBlock(ContractiveFFNConfig(8, 16, 0.9)))
    opt = torch.optim.SGD(blk.parameters(), lr=1e-2)
    x = torch.randn(2, 12, 8)
    for _ in range(5):  # a few optimiser steps in training mode: estimates, no certificate
        blk.train()
        opt.zero_grad()
        blk(x).square().sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all()
                   for p in blk.parameters())
        opt.step()
    blk.eval()
    if isinstance(blk, ContractiveL2Block):
        blk.train()
        est = float(blk.estimated_u().detach())
        blk.eval()
        u_cert, s_cert = blk._certified()
        a = blk.attn
        followed = l2_mha_candidates(a.query_weights(), a.value_weights(), a.output_weight(),
                                     12, "2", causal=True)["concat"]
        # Rayleigh quotients: an estimate from below, close to the certified candidate.
        assert 0.95 * followed <= est <= followed * (1 + 1e-5)
        assert u_cert <= followed  # eval: the minimum of all candidates
        with torch.enable_grad():
            assert blk.scale() == s_cert  # eval mode: the certified value even with grad
    else:
        s1, s2, a_cert, b_cert = blk._certified()
        blk.train()
        a_est, b_est = blk.scales()
        assert isinstance(a_est, torch.Tensor) and isinstance(b_est, torch.Tensor)
        assert a_cert <= float(a_est.detach()) <= a_cert * 1.05
        assert b_cert <= float(b_est.detach()) <= b_cert * 1.05
        blk.eval()
    # Certified on the final weights, as used in eval mode:
    lip = blk.lipschitz_upper()
    assert lip <= 0.9
    with torch.no_grad():
        jac = _jac(blk.branch, x[0].double().float())
    assert float(torch.linalg.matrix_norm(jac, 2)) <= lip


def test_frozen_scales_match_live_scales_and_restore():
    trunk = _trunk(2, 4, 2, 1, 4, 0.9)
    x = torch.randn(1, 4, 4, dtype=F64)
    with torch.no_grad():
        live = trunk(x)
        with frozen_scales(trunk):
            assert all(b.frozen is not None for b in trunk.residual_blocks())
            frozen = trunk(x)
    assert torch.equal(live, frozen)
    assert all(b.frozen is None for b in trunk.residual_blocks())


def test_contractive_block_rejects_long_sequences_and_bad_c():
    blk = ContractiveL2Block(ContractiveL2Config(4, 2, 3))
    with pytest.raises(ValueError, match="max_len=3"):
        blk(torch.randn(1, 4, 4))
    for bad in (1.0, 0.0, 1.5, -0.1):
        with pytest.raises(ConfigError) as info:
            ContractiveL2Config(4, 2, 3, c=bad)
        assert info.value.field == "c"
    with pytest.raises(ConfigError) as info:
        ContractiveFFNConfig(4, 8, activation="swish")  # type: ignore[arg-type]
    assert info.value.field == "activation"


def test_trunk_logdet_estimate_within_three_standard_errors():
    trunk = _trunk(2, 4, 2, 2, 3, 0.95, causal=True)
    x = torch.randn(1, 3, 4, dtype=F64, generator=torch.Generator().manual_seed(2))
    exact = float(torch.linalg.slogdet(_jac(trunk, x[0])).logabsdet)
    rhos = []
    h = x
    for blk in trunk.residual_blocks():
        rhos.append(float(torch.linalg.matrix_norm(_jac(blk.branch, h[0]), 2)))
        with torch.no_grad():
            h = blk(h)
    n_terms = 40
    bias = sum(12 * r ** (n_terms + 1) / ((n_terms + 1) * (1 - r)) for r in rhos)
    assert bias < 0.01
    with torch.no_grad():
        est = trunk_logdet_estimate(trunk, x, n_terms=n_terms, n_samples=1000,
                                    generator=torch.Generator().manual_seed(9))
    assert abs(exact) > 0.5 > 5 * float(est.stderr[0])  # an estimator returning 0 fails
    assert abs(float(est.value[0]) - exact) <= 3 * float(est.stderr[0]) + bias


# --- training-time norm estimates (lsa_models/invertible/estimate.py) -------------------------


@settings(deadline=None)
@given(seed=st.integers(0, 10_000),
       shape=st.sampled_from([(5, 3), (3, 5), (2, 4, 4), (3, 2, 6), (8, 1), (1, 6), (7, 7)]),
       scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_estimate_norms_is_a_rayleigh_quotient_within_its_proven_range(seed, shape, scale):
    """`sigma = ||W v||`, v = G^16 e_j / ||.||, G = W^T W, j its largest column: never above
    sigma_1, and (log-convexity of the moments e_j^T G^q e_j, docs/certification.md) never
    below sigma_1 k^(-1/4), k the short side."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    true = torch.linalg.matrix_norm(w.double(), 2)
    est = estimate_norms([w])[0].double()
    k = min(shape[-2:])
    assert est.shape == true.shape
    assert (est <= true * (1 + 1e-5)).all()
    assert (est >= true * k ** -0.25 * (1 - 1e-5)).all()


def test_estimate_norms_is_close_on_the_lm_shapes_and_warm_steps_converge():
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(64, 64, generator=g), torch.randn(256, 64, generator=g),
            torch.randn(64, 256, generator=g), torch.randn(4, 64, 16, generator=g)]
    true = [torch.linalg.matrix_norm(m.double(), 2) for m in mats]
    for est, t in zip(estimate_norms(mats), true, strict=True):
        # Gaussian matrices have small gaps at the top of the spectrum: the cold estimate is
        # the hard case (trained weights have larger gaps, and warm steps accumulate).
        assert ((est.double() / t) >= 0.97).all() and ((est.double() / t) <= 1 + 1e-5).all()
    warm = estimate_norms_warm(mats, None)[1]
    for _ in range(200):
        norms, warm = estimate_norms_warm(mats, warm)
    for est, t in zip(norms, true, strict=True):
        assert ((est.double() / t) >= 0.995).all()
    # A matrix with a clear gap: warm steps from a poor start reach sigma_1.
    u, _, vh = torch.linalg.svd(torch.randn(32, 16, generator=g), full_matrices=False)
    sv = torch.cat([torch.tensor([3.0]), torch.linspace(2.0, 0.1, 15)])
    w = u @ torch.diag(sv) @ vh  # (32, 16), sigma_1 = 3, sigma_2 = 2
    starts = [torch.ones(16)]
    values = []
    for _ in range(40):
        norms, starts = estimate_norms_warm([w], starts)
        values.append(float(norms[0]))
    assert values[0] < 2.99 and abs(values[-1] - 3.0) < 1e-4
    assert all(b >= a - 1e-5 for a, b in zip(values, values[1:], strict=False))  # monotone
    # A start in the weight's null space (weights replaced since): a cold start, not 0.
    w = torch.tensor([[2.0, 0.0], [0.0, 0.0], [0.0, 0.0]])  # (3, 2), null space e_2
    norms, _ = estimate_norms_warm([w, torch.eye(2)], [torch.tensor([0.0, 1.0]),
                                                       torch.tensor([1.0, 0.0])])
    assert float(norms[0]) == pytest.approx(2.0) and float(norms[1]) == pytest.approx(1.0)


@pytest.mark.parametrize("warm", [False, True])
def test_estimate_norms_gradient_is_u_v_transposed(warm):
    """The one autograd node's backward equals autograd through `||W_t v||` (cold) or
    `||W_t^T u||` (warm) with the returned vectors held fixed."""
    g = torch.Generator().manual_seed(3)
    mats = [torch.randn(6, 4, generator=g, requires_grad=True),
            torch.randn(3, 7, generator=g, requires_grad=True),
            torch.randn(2, 5, 5, generator=g, requires_grad=True)]
    starts = [torch.randn(4, generator=g), torch.randn(3, generator=g),
              torch.randn(2, 5, generator=g)] if warm else None
    norms, vs = estimate_norms_warm(mats, starts)
    weights = [torch.tensor(1.5), torch.tensor(-0.5), torch.tensor([2.0, 0.25])]
    got = torch.autograd.grad(sum((c * n).sum() for c, n in zip(weights, norms, strict=True)),
                              mats)
    for i, (w, v, c, gw) in enumerate(zip(mats, vs, weights, got, strict=True)):
        tall = w.mT if w.shape[-1] > w.shape[-2] else w
        if starts is not None:  # u the unit W_t v0, sigma = ||W_t^T u||, v = W_t^T u / sigma
            u = torch.nn.functional.normalize((tall @ starts[i].unsqueeze(-1)).squeeze(-1),
                                              dim=-1).detach()
            ref = (tall.mT @ u.unsqueeze(-1)).squeeze(-1).norm(dim=-1)
            torch.testing.assert_close((tall.mT @ u.unsqueeze(-1)).squeeze(-1).detach()
                                       / ref.detach()[..., None], v)
        else:  # v the returned unit vector, sigma = ||W_t v||
            ref = (tall @ v.unsqueeze(-1)).squeeze(-1).norm(dim=-1)
        torch.testing.assert_close(ref.detach(), norms[i].detach(), rtol=1e-5, atol=1e-6)
        (want,) = torch.autograd.grad((c * ref).sum(), w)
        torch.testing.assert_close(gw, want, rtol=1e-4, atol=1e-5)


def _train_trunk(trunk: ContractiveTrunk, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(trunk.parameters(), lr=3e-2)
    trunk.train()
    cfg = trunk.config
    for _ in range(steps):
        x = torch.randn(4, cfg.max_len, cfg.d_model, generator=g)
        opt.zero_grad()
        (trunk(x) - x.flip(1)).square().mean().backward()  # move every weight
        opt.step()


def test_trunk_training_forward_batches_the_blocks_estimates():
    """One batched estimate for the whole trunk gives the block-by-block forward and
    gradients, and the training map is the eval map at the estimated scale."""
    torch.manual_seed(4)
    trunk = ContractiveTrunk(ContractiveTrunkConfig(8, 2, 2, 16, 6, 0.9))
    _train_trunk(trunk, 3)
    x = torch.randn(3, 6, 8)
    blocks = trunk.residual_blocks()
    saved = [b.power.vectors for b in blocks]
    out = trunk(x)
    grads = torch.autograd.grad(out.square().sum(), list(trunk.parameters()))
    for b, v in zip(blocks, saved, strict=True):
        b.power.vectors = v
    h = x
    for b in blocks:
        h = b(h)  # each block estimates on its own
    torch.testing.assert_close(h, out, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(h.square().sum(), list(trunk.parameters())), grads,
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # First forward of a fresh block: the cold estimate, i.e. `estimated_u()`; the folded,
    # scaled weights give the eval-form map `F(X) * c / U_est`.
    attn = ContractiveL2Block(ContractiveL2Config(8, 2, 6, 0.9)).train()
    want = attn.attn(x) * (0.9 / attn.estimated_u())
    torch.testing.assert_close(attn.branch(x), want, rtol=1e-5, atol=1e-6)
    ffn = ContractiveFFNBlock(ContractiveFFNConfig(8, 16, 0.9)).train()
    a, b = ffn.scales()
    want = torch.nn.functional.linear(
        ffn.act(torch.nn.functional.linear(x, ffn.fc1.weight) * a + ffn.fc1.bias),
        ffn.fc2.weight) * b + ffn.fc2.bias
    torch.testing.assert_close(ffn.branch(x), want, rtol=1e-5, atol=1e-6)


def test_warm_started_training_tracks_the_bound_and_stays_certified_and_invertible():
    """After training with one warm power step per step, the training estimate of each
    attention bound is within 2% below the certified candidate it follows (and never
    above it); the certified constants are < c and the inverse converges."""
    torch.manual_seed(5)
    trunk = ContractiveTrunk(ContractiveTrunkConfig(8, 2, 2, 16, 6, 0.8))
    _train_trunk(trunk, 40)
    for blk in trunk.residual_blocks():
        est = blk.training_estimate()
        assert est is not None and blk.power.starts(est.mats) is not None
        if isinstance(blk, ContractiveL2Block):
            norms, _ = estimate_norms_warm(est.mats, blk.power.starts(est.mats))
            u_est = float(blk._u_from(blk.training_bounds, norms).detach())
            a = blk.attn
            with torch.no_grad():
                followed = l2_mha_candidates(a.query_weights(), a.value_weights(),
                                             a.output_weight(), 6, "2", causal=True)["concat"]
            assert 0.98 * followed <= u_est <= followed * (1 + 1e-5)
    trunk.eval()
    assert all(c < 0.8 for c in trunk.branch_constants())
    x = torch.randn(2, 6, 8)
    with torch.no_grad():
        y = trunk(x)
    res = trunk.inverse(y, atol=1e-5)
    assert float(_seq_err(res.unwrap(), x).max()) <= max(res.error_bound, 1e-4)
