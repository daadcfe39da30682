"""Each certified formula against an independent float64 evaluation (numpy/scipy/mpmath).

The certified value must be >= the independent one (it rounds upward) and within a relative
1e-9 of it (the margins are tiny): a larger gap would mean a wrong formula, not rounding.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch
from scipy.special import lambertw

from lsa_models import (
    L2MHA,
    Transformer,
    TransformerConfig,
    certify,
)
from lsa_models.bounds.formulas import (
    g_lipschitz,
    l2_mha_bound,
    l2_mha_candidates,
    layernorm_bound,
    linear_bound,
)
from lsa_models.bounds.numerics import (
    GELU_LIPSCHITZ,
    inf_norm_upper,
    lambert_w0_upper,
    one_norm_upper,
    phi_inv_upper,
    spectral_norm_upper,
)

REL = 1e-9


def _close_above(certified: float, reference: float) -> None:
    assert certified >= reference
    assert certified <= reference * (1 + REL) + 1e-300


def _weights(seed: int, heads: int, d_model: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    d = d_model // heads
    return (rng.normal(size=(heads, d_model, d)), rng.normal(size=(heads, d_model, d)),
            rng.normal(size=(d_model, d_model)))


@pytest.mark.parametrize("x", [1e-12, 0.1, 1 / math.e, 1.0, 3.3, 99.0, 1e6, 1e12])
def test_lambert_w0_upper_is_above_the_exact_value(x: float) -> None:
    mpmath.mp.dps = 50
    exact = mpmath.lambertw(mpmath.mpf(x))
    w = lambert_w0_upper(x)
    assert mpmath.mpf(w) >= exact
    assert w <= float(exact) * (1 + 1e-14)
    assert w == pytest.approx(float(lambertw(x).real), rel=1e-14)


@pytest.mark.parametrize("n", [2, 3, 10, 50, 1000])
def test_phi_inv_upper_bounds_the_exact_inverse(n: int) -> None:
    mpmath.mp.dps = 50
    exact = mpmath.lambertw((n - 1) / mpmath.e)
    assert mpmath.mpf(phi_inv_upper(n - 1)) >= exact


def test_gelu_constant_bounds_the_exact_supremum() -> None:
    mpmath.mp.dps = 30
    s2 = mpmath.sqrt(2)
    exact = mpmath.ncdf(s2) + s2 * mpmath.npdf(s2)  # derivative of x Phi(x) peaks at sqrt 2
    assert mpmath.mpf(GELU_LIPSCHITZ) >= exact
    assert GELU_LIPSCHITZ - float(exact) < 1e-3


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (40, 20), (64, 256)])
def test_spectral_norm_upper_is_at_least_the_largest_singular_value(shape: tuple[int, int]) -> None:
    w = np.random.default_rng(0).normal(size=shape)
    _close_above(spectral_norm_upper(w), float(np.linalg.svd(w, compute_uv=False)[0]))


def test_spectral_norm_upper_of_zero_matrix_is_zero() -> None:
    assert spectral_norm_upper(np.zeros((3, 4))) == 0.0


def test_gelu_constant_bounds_the_tanh_approximation_too() -> None:
    """GPT-2's tanh GELU peaks a little higher than the exact one (1.128993 vs 1.128904) and
    dips to -0.129: the one constant still bounds |d/dx| of both."""
    mpmath.mp.dps = 30
    a, b = mpmath.sqrt(2 / mpmath.pi), mpmath.mpf("0.044715")

    def gelu_tanh(x: mpmath.mpf) -> mpmath.mpf:
        return x * (1 + mpmath.tanh(a * (x + b * x**3))) / 2

    grid = [mpmath.mpf(i) / 50 for i in range(-400, 401)]
    slopes = [mpmath.diff(gelu_tanh, x) for x in grid]
    top = grid[max(range(len(grid)), key=lambda i: slopes[i])]
    peak = mpmath.diff(gelu_tanh, mpmath.findroot(lambda x: mpmath.diff(gelu_tanh, x, 2), top))
    assert mpmath.mpf(GELU_LIPSCHITZ) >= peak >= max(slopes)
    assert GELU_LIPSCHITZ - float(peak) < 1e-4
    assert -min(slopes) < GELU_LIPSCHITZ
    # beyond the grid (|x| > 8) tanh is saturated: the slope is within 1e-15 of 1 or 0
    for x in (8, 20):
        assert abs(mpmath.diff(gelu_tanh, x) - 1) < 1e-15
        assert abs(mpmath.diff(gelu_tanh, -x)) < 1e-15


def test_matrix_inf_and_one_norms_match_numpy() -> None:
    w = np.random.default_rng(1).normal(size=(5, 9))
    _close_above(inf_norm_upper(w), float(np.linalg.norm(w, np.inf)))
    _close_above(one_norm_upper(w), float(np.linalg.norm(w, 1)))


@pytest.mark.parametrize("heads,d_model,n", [(1, 1, 2), (2, 4, 5), (4, 16, 100)])
def test_l2_mha_inf_bound_matches_independent_formula(heads: int, d_model: int, n: int) -> None:
    wq, wv, wo = _weights(heads + n, heads, d_model)
    d = d_model // heads
    w0 = float(lambertw((n - 1) / math.e).real)
    q = max(np.linalg.norm(wq[h], np.inf) * np.linalg.norm(wq[h].T, np.inf) for h in range(heads))
    v = max(np.linalg.norm(wv[h].T, np.inf) for h in range(heads))
    ref = (4 * w0 + 1 / math.sqrt(d)) * np.linalg.norm(wo.T, np.inf) * q * v
    _close_above(l2_mha_candidates(wq, wv, wo, n, "inf")["theorem_3_2"], float(ref))


@pytest.mark.parametrize("heads,d_model,n", [(1, 1, 2), (2, 4, 5), (4, 16, 100)])
def test_l2_mha_two_bound_matches_independent_formula(heads: int, d_model: int, n: int) -> None:
    wq, wv, wo = _weights(heads * n, heads, d_model)
    d = d_model // heads
    w0 = float(lambertw((n - 1) / math.e).real)
    s = sum(np.linalg.norm(wq[h], 2) ** 4 * np.linalg.norm(wv[h], 2) ** 2 for h in range(heads))
    ref = math.sqrt(n) / math.sqrt(d) * (4 * w0 + 1) * math.sqrt(s) * np.linalg.norm(wo, 2)
    _close_above(l2_mha_candidates(wq, wv, wo, n, "2")["theorem_3_2"], float(ref))


def test_causal_l2_mha_bounds_follow_the_prefix_derivation() -> None:
    wq, wv, wo = _weights(7, 2, 4)
    n = 6
    causal_inf = l2_mha_candidates(wq, wv, wo, n, "inf", causal=True)
    for name, value in l2_mha_candidates(wq, wv, wo, n, "inf").items():
        _close_above(causal_inf[name], value / (1 + REL))
    per_prefix = [l2_mha_candidates(wq, wv, wo, max(i, 2), "2")["theorem_3_2"]
                  for i in range(1, n + 1)]
    ref = math.sqrt(sum(u * u for u in per_prefix))
    _close_above(l2_mha_candidates(wq, wv, wo, n, "2", causal=True)["theorem_3_2"], ref)
    # G's causal constant is the root sum of squares of its prefix constants.
    lead = [math.sqrt(max(i, 2)) * (4 * float(lambertw((max(i, 2) - 1) / math.e).real) + 1)
            for i in range(1, n + 1)]
    _close_above(g_lipschitz(n, "2", 2, causal=True), math.sqrt(sum(c * c for c in lead)))


def _chained_reference(wq: np.ndarray, wv: np.ndarray, wo: np.ndarray, n: int,
                       norm: str) -> dict[str, float]:
    """The chained candidates of docs/certification.md in plain numpy (SVD / column sums)."""
    heads, _, d = wq.shape
    w0 = float(lambertw((n - 1) / math.e).real)
    o = float(np.linalg.norm(wo, 2 if norm == "2" else 1))
    m = [wq[h].T @ wv[h] / math.sqrt(d) for h in range(heads)]  # (d, d)
    b = [m[h] @ wo[h * d:(h + 1) * d] for h in range(heads)]  # (d, D)
    q_all = np.concatenate(list(wq), axis=1)  # (D, H d)
    if norm == "2":
        lip = math.sqrt(n) * (4 * w0 + 1)

        def nrm(a: np.ndarray) -> float:
            return float(np.linalg.norm(a, 2))
        per_head = lip * o * math.sqrt(sum((nrm(wq[h]) * nrm(m[h])) ** 2 for h in range(heads)))
        return {"per_head": per_head,
                "head_sum": lip * sum(nrm(wq[h]) * nrm(b[h]) for h in range(heads)),
                "concat": lip * nrm(q_all) * nrm(np.concatenate(b, axis=0))}
    lip = math.sqrt(d) * (4 * w0 + 1 / math.sqrt(d))

    def one(a: np.ndarray) -> float:
        return float(np.linalg.norm(a, 1))
    return {"per_head": lip * o * max(one(wq[h]) * one(m[h]) for h in range(heads)),
            "concat": lip * one(q_all) * one(np.concatenate(b, axis=0))}


@pytest.mark.parametrize("norm", ["2", "inf"])
@pytest.mark.parametrize("heads,d_model,n", [(1, 1, 2), (2, 4, 5), (3, 12, 30), (4, 16, 100)])
def test_l2_mha_chained_candidates_match_independent_formula(heads: int, d_model: int, n: int,
                                                             norm: str) -> None:
    wq, wv, wo = _weights(heads * n + 1, heads, d_model)
    got = l2_mha_candidates(wq, wv, wo, n, norm)
    ref = _chained_reference(wq, wv, wo, n, norm)
    assert set(got) == set(ref) | {"theorem_3_2"}
    for name, value in ref.items():
        _close_above(got[name], value)
    assert l2_mha_bound(wq, wv, wo, n, norm) == min(got.values())


@pytest.mark.parametrize("norm", ["2", "inf"])
@pytest.mark.parametrize("seed", range(8))
def test_l2_mha_per_head_candidate_is_never_above_theorem_3_2(seed: int, norm: str) -> None:
    rng = np.random.default_rng(seed)
    heads, d = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    scale = float(rng.choice([0.1, 1.0, 10.0]))
    wq, wv, wo = (rng.normal(size=(heads, heads * d, d)) * scale,
                  rng.normal(size=(heads, heads * d, d)), rng.normal(size=(heads * d, heads * d)))
    for causal in (False, True):
        got = l2_mha_candidates(wq, wv, wo, 9, norm, causal)
        # Proved in docs/certification.md (||M_h|| <= ||W^Q_h|| ||W^V_h|| / sqrt(d)); the
        # tiny slack covers the product's rounding allowance.
        assert got["per_head"] <= got["theorem_3_2"] * (1 + 1e-12)
        assert l2_mha_bound(wq, wv, wo, 9, norm, causal) <= got["theorem_3_2"]


def test_l2_mha_bound_tightens_the_d8_h2_case() -> None:
    """The random-weight tightness case of issue 15 (D = 8, H = 2, N = 12, entries of scale 0.6):
    the chained bound is below Theorem 3.2 in both norms."""
    rng = np.random.default_rng(0)
    wq, wv, wo = (rng.normal(size=(2, 8, 4)) * 0.6, rng.normal(size=(2, 8, 4)) * 0.6,
                  rng.normal(size=(8, 8)) * 0.6)
    for norm in ("2", "inf"):
        got = l2_mha_candidates(wq, wv, wo, 12, norm)
        assert l2_mha_bound(wq, wv, wo, 12, norm) < 0.9 * got["theorem_3_2"]


def test_l2_bounds_grow_like_log_n_minus_log_log_n() -> None:
    wq, wv, wo = _weights(3, 1, 1)
    ratios = [l2_mha_bound(wq, wv, wo, 10 * n, "inf") / l2_mha_bound(wq, wv, wo, n, "inf")
              for n in (10, 100, 1000)]
    # Logarithmic growth: a tenfold N multiplies the bound by about 2, less and less.
    assert all(1 < r < 2.2 for r in ratios)
    assert ratios[0] > ratios[1] > ratios[2]


@pytest.mark.parametrize("dim,eps", [(1, 1e-5), (2, 1e-5), (8, 0.1)])
def test_layernorm_bounds_match_the_stated_form(dim: int, eps: float) -> None:
    gamma = np.random.default_rng(dim).normal(size=dim)
    g = float(np.abs(gamma).max())
    if dim == 1:
        assert layernorm_bound(gamma, eps, "2") == 0.0
        return
    _close_above(layernorm_bound(gamma, eps, "2"), g / math.sqrt(eps))
    _close_above(layernorm_bound(gamma, eps, "inf"), g / math.sqrt(eps) * (dim**2 - 2) / dim)


def test_linear_bound_uses_the_row_vector_convention() -> None:
    w = np.random.default_rng(2).normal(size=(3, 5))  # torch layout (out, in)
    _close_above(linear_bound(w, "2"), float(np.linalg.svd(w, compute_uv=False)[0]))
    # y = x W^T with inf-norms: the largest absolute row sum of the torch weight.
    _close_above(linear_bound(w, "inf"), float(np.abs(w).sum(axis=1).max()))


def test_native_l2_mha_bound_uses_its_own_weights() -> None:
    torch.manual_seed(0)
    m = L2MHA(8, 2)
    r = certify(m, "2", 16)
    assert r.verdict == "certified" and r.upper is not None
    ref = l2_mha_bound(m.query_weights().detach(), m.value_weights().detach(),
                       m.output_weight().detach(), 16, "2")
    assert r.upper == ref


def test_transformer_bound_is_the_product_of_its_block_bounds() -> None:
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(d_model=4, n_heads=2, n_layers=3, d_ff=8))
    r = certify(model, "inf", 8)
    blocks = [lb.upper for lb in r.layers if lb.kind == "block"]
    assert len(blocks) == 3 and r.upper is not None
    assert r.upper >= math.prod(b for b in blocks if b is not None)
    assert r.upper == pytest.approx(math.prod(b for b in blocks if b is not None), rel=1e-12)
    names = {lb.name for lb in r.layers}
    assert {"blocks.0.attn", "blocks.2.ffn.fc2", "blocks.1.ln1"} <= names


def test_untied_l2_is_not_certified_with_a_reason() -> None:
    r = certify(L2MHA(4, 2, tied=False), "2", 4)
    assert r.verdict == "not_certified" and r.upper is None and r.lipschitz is None
    assert r.reason is not None and "tied" in r.reason


def test_dot_product_attention_is_not_lipschitz_on_unbounded_domain() -> None:
    model = Transformer(TransformerConfig(d_model=4, n_heads=2, n_layers=2, d_ff=8,
                                          attention="dp", norm_first=False))
    r = certify(model, "2", 8)
    assert r.verdict == "not_lipschitz" and r.upper is None and r.lipschitz is False
    assert r.reason is not None and "Theorem 3.1" in r.reason
