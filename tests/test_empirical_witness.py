"""The Theorem 3.1 witness: DP attention's Jacobian norm grows without bound."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lsa_models import (
    L2MHA,
    DotProductMHA,
    Transformer,
    TransformerConfig,
    certify,
)
from lsa_models.empirical import (
    GrowthConfig,
    dp_growth,
    estimate,
    growth_direction,
    jacobian_norm,
    witness_input,
)
from lsa_models.empirical.jacobian import differentiable_attention
from service.reports import bound_report, with_empirical


def _seq(module: nn.Module):  # (N, D) -> (N, D)
    return lambda x: module(x.unsqueeze(0)).squeeze(0)


def _dp(d: int, h: int, seed: int) -> DotProductMHA:
    torch.manual_seed(seed)
    m = DotProductMHA(d, h).double().eval()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def _dp_scalar(wq: float, wk: float, wv: float, wo: float) -> DotProductMHA:
    m = _dp(1, 1, 0)
    with torch.no_grad():
        m.q_proj.weight.fill_(wq)
        m.k_proj.weight.fill_(wk)
        m.v_proj.weight.fill_(wv)
        m.out_proj.weight.fill_(wo)
    return m


def _strictly_increasing(pairs: list[tuple[float, float]]) -> bool:
    return all(b[0] > a[0] and b[1] > a[1] for a, b in zip(pairs, pairs[1:], strict=False))


@pytest.mark.parametrize("norm", ["2", "inf"])
@pytest.mark.parametrize(("d", "h", "n", "seed"), [(1, 1, 10, 0), (4, 2, 6, 1), (8, 4, 5, 2)])
def test_growth_pairs_strictly_increasing(norm: str, d: int, h: int, n: int, seed: int) -> None:
    g = dp_growth(_seq(_dp(d, h, seed)), (n, d), norm, seed=seed)
    assert len(g.pairs) >= GrowthConfig().points
    assert _strictly_increasing(g.pairs)
    assert g.increasing
    # DP attention alone: ||J|| ~ s^2 (the variance term), so the log-log slope tends to 2.
    assert g.exponent is not None and 1.8 < g.exponent < 2.2


@pytest.mark.parametrize("bound", [1e3, 1e6, 1e9])
def test_growth_exceeds_any_given_number(bound: float) -> None:
    cfg = GrowthConfig(points=3, exceed=bound)
    g = dp_growth(_seq(_dp(4, 2, 3)), (5, 4), "inf", seed=0, config=cfg)
    assert g.pairs[-1][1] > bound
    assert _strictly_increasing(g.pairs)


@pytest.mark.parametrize(("wq", "wk", "wv", "wo"),
                         [(1.0, 1.0, 1.0, 1.0), (0.5, -2.0, 1.5, -0.7), (2.0, 0.3, -1.0, 1.0)])
def test_growth_input_matches_theorem_3_1_entry(wq: float, wk: float, wv: float,
                                                wo: float) -> None:
    # D = H = 1: d f_1 / d x_1 = W^V W^O (1/N + a Var(x)), a = W^Q W^K / sqrt(d), Var over
    # all N tokens (x_1 = 0 included) with the uniform weights of row 1.
    n = 10
    m = _dp_scalar(wq, wk, wv, wo)
    for s in (1.0, 10.0, 100.0):
        x = witness_input((n, 1), s, seed=4)  # (N, 1)
        assert torch.all(x[0] == 0)
        with differentiable_attention():
            j = torch.func.jacrev(_seq(m))(x).reshape(n, n)  # (N, N)
        var = float(x[:, 0].var(unbiased=False))
        expected = wv * wo * (1.0 / n + wq * wk * var)
        assert float(j[0, 0]) == pytest.approx(expected, rel=1e-9, abs=1e-12)
        inf = jacobian_norm(_seq(m), x, "inf").value
        assert inf >= abs(expected) * (1 - 1e-12)


def test_growth_handles_negative_query_key_product() -> None:
    # a < 0: 1/N + a Var(x) dips through zero before it grows; the returned tail still
    # increases strictly and without bound.
    m = _dp_scalar(1.0, -1.0, 1.0, 1.0)
    g = dp_growth(_seq(m), (10, 1), "inf", seed=0,
                  config=GrowthConfig(start=0.05, factor=2.0, points=4, exceed=1e4))
    assert _strictly_increasing(g.pairs) and g.pairs[-1][1] > 1e4
    assert g.scanned >= len(g.pairs)


def test_growth_same_seed_same_pairs() -> None:
    f = _seq(_dp(4, 2, 5))
    a = dp_growth(f, (5, 4), "2", seed=9)
    b = dp_growth(f, (5, 4), "2", seed=9)
    assert a.pairs == b.pairs
    z = growth_direction((5, 4), 9)
    assert torch.equal(witness_input((5, 4), 3.0, 9), z * 3.0)


def test_growth_rejects_single_token() -> None:
    with pytest.raises(ValueError, match="N >= 2"):
        growth_direction((1, 4), 0)


@pytest.mark.parametrize("norm", ["2", "inf"])
def test_estimate_dp_models_carry_growth(norm: str) -> None:
    torch.manual_seed(0)
    post = Transformer(TransformerConfig(4, 2, 2, 8, attention="dp", norm_first=False))
    for model in (DotProductMHA(4, 2), post):
        res = estimate(model, (5, 4), norm, restarts=1, steps=3, seed=2)
        assert res.dot_product and res.growth is not None
        assert _strictly_increasing(res.growth)
        assert res.lower >= res.growth[-1][1]
        # The reported lower bound is realised at the reported witness.
        f = _seq(model.double())
        again = jacobian_norm(f, res.witness.double(), norm, tol=1e-10).value
        assert again == pytest.approx(res.lower, rel=1e-5)
        model.float()
        if res.witness_source == "growth":
            assert res.witness_scale is not None
            assert torch.equal(res.witness.double(),
                               witness_input((5, 4), res.witness_scale, 2))
        verdict = certify(model, norm, 5)  # type: ignore[arg-type]
        assert verdict.verdict == "not_lipschitz"
        report = with_empirical(bound_report(verdict, "0" * 64), res)
        assert report.ratio is None and report.lower == res.lower
        assert report.witness is not None and report.witness.growth is not None
        assert [(p.scale, p.jacobian_norm) for p in report.witness.growth] == res.growth


def test_estimate_l2_and_bounded_dp_have_no_growth() -> None:
    torch.manual_seed(1)
    l2 = estimate(L2MHA(4, 2), (4, 4), "2", restarts=1, steps=2)
    assert l2.growth is None and not l2.dot_product
    dp = estimate(DotProductMHA(4, 2), (4, 4), "2", restarts=1,
                  steps=2, radius=1.0)
    assert dp.dot_product and dp.growth is None  # Theorem 3.1 needs an unbounded domain
    assert float(dp.witness.norm(dim=-1).max()) <= 1.0 + 1e-6
    assert math.isfinite(dp.lower)


def test_estimate_time_budget_cuts_growth_scan() -> None:
    torch.manual_seed(2)
    res = estimate(DotProductMHA(4, 2), (5, 4), "2", restarts=100,
                   steps=10_000, time_budget_s=0.3)
    assert res.stopped_early
    assert math.isfinite(res.lower)
