"""Matrix-free Jacobian norms against the materialised Jacobian (jacrev + SVD / row sums)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lsa_models import (
    L2MHA,
    AttentionConfig,
    BlockConfig,
    DotProductMHA,
    FFNConfig,
    TransformerBlock,
)
from lsa_models.empirical import jacobian_norm
from lsa_models.empirical.jacobian import (
    JacobianConfig,
    auto_chunk,
    differentiable_attention,
    inf_norm_rows,
)


def _seq(module: nn.Module):  # (N, D) -> (N, D)
    return lambda x: module(x.unsqueeze(0)).squeeze(0)


def _randomised(module: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64)
                    / max(1, p.shape[-1]) ** 0.5)
    for p in module.parameters():
        p.requires_grad_(False)
    return module.double().eval()


def _models() -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    for seed, (d, h) in enumerate([(1, 1), (4, 2), (6, 3)]):
        out.append((f"l2-{d}-{h}", _randomised(L2MHA(d, h), seed)))
        out.append((f"dp-{d}-{h}", _randomised(DotProductMHA(d, h), seed)))
    out.append(("l2-causal", _randomised(L2MHA(4, 2, causal=True), 7)))
    for norm_first in (True, False):
        cfg = BlockConfig(AttentionConfig(4, 2), FFNConfig(4, 8, "tanh"), norm_first=norm_first)
        out.append((f"block-{norm_first}", _randomised(TransformerBlock(cfg), 11)))
    return out


MODELS = _models()


def _width(model: nn.Module) -> int:
    return int(model.config.d_model)  # type: ignore[union-attr,arg-type]


def _full_jacobian(f, x: Tensor) -> Tensor:
    with differentiable_attention():  # the fused kernel has no batching rule for jacrev
        return torch.func.jacrev(f)(x).reshape(-1, x.numel())  # (numel out, numel in)


# Power iteration needs many more products for 1e-8; a few models show it agrees too.
CASES = [(n, m, "lanczos") for n, m in MODELS] + [
    (n, m, "power") for n, m in MODELS if n in ("l2-4-2", "dp-4-2", "block-False")]


@pytest.mark.parametrize(("name", "model", "method"), CASES,
                         ids=[f"{k}-{n}" for n, _, k in CASES])
def test_jacobian_two_norm_equals_jacrev_svd_float64(name: str, model: nn.Module,
                                                     method: str) -> None:
    f = _seq(model)
    d = _width(model)
    for seed, (n, scale) in enumerate([(2, 1.0), (5, 0.5), (7, 2.0)]):
        x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed),
                        dtype=torch.float64) * scale
        exact = float(torch.linalg.matrix_norm(_full_jacobian(f, x), ord=2))
        got = jacobian_norm(f, x, "2", tol=1e-13, max_iter=5000, method=method)  # type: ignore
        assert got.converged
        assert abs(got.value - exact) <= 1e-8 * exact, (name, n, got, exact)
        assert got.vector is not None and got.vector.shape == x.shape


@pytest.mark.parametrize(("name", "model"), MODELS, ids=[n for n, _ in MODELS])
def test_jacobian_inf_norm_equals_largest_row_sum(name: str, model: nn.Module) -> None:
    f = _seq(model)
    d = _width(model)
    x = torch.randn(6, d, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    sums = _full_jacobian(f, x).abs().sum(dim=1)  # (numel out,)
    for chunk in (1, 5, None):
        got = jacobian_norm(f, x, "inf", chunk_size=chunk)
        assert got.value == pytest.approx(float(sums.max()), rel=1e-12, abs=1e-12)
        assert got.row == int(sums.argmax())
        assert got.rows_evaluated == sums.numel()
    rows = torch.tensor([0, 3, sums.numel() - 1])
    sub = inf_norm_rows(f, x, rows)
    assert sub.value == pytest.approx(float(sums[rows].max()), rel=1e-12)
    assert sub.rows_evaluated == 3


def test_jacobian_linear_map_known_norms() -> None:
    # f(X) = X W (row convention): J = I_N (x) W^T, so ||J||_2 = ||W||_2 and the row sums of J
    # are W's absolute column sums: ||J||_inf = ||W||_1.
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 3, generator=g, dtype=torch.float64)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64)
    two = jacobian_norm(lambda z: z @ w, x, "2", tol=1e-14)
    assert two.value == pytest.approx(float(torch.linalg.matrix_norm(w, ord=2)), rel=1e-10)
    inf = jacobian_norm(lambda z: z @ w, x, "inf")
    assert inf.value == pytest.approx(float(w.abs().sum(dim=0).max()), rel=1e-14)


def test_jacobian_float32_close_to_float64() -> None:
    model = _randomised(L2MHA(8, 2), 5)
    x64 = torch.randn(16, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = jacobian_norm(_seq(model), x64, "2", tol=1e-12).value
    model32 = model.float()
    got = jacobian_norm(_seq(model32), x64.float(), "2", tol=1e-6)
    assert abs(got.value - ref) <= 1e-4 * ref
    inf64 = jacobian_norm(_seq(model.double()), x64, "inf").value
    inf32 = jacobian_norm(_seq(model.float()), x64.float(), "inf").value
    assert abs(inf32 - inf64) <= 1e-4 * inf64


def test_jacobian_iteration_cap_reports_not_converged_and_stays_below() -> None:
    model = _randomised(L2MHA(6, 2), 2)
    f = _seq(model)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 2
    exact = float(torch.linalg.matrix_norm(_full_jacobian(f, x), ord=2))
    for method in ("lanczos", "power"):
        for cap in (1, 2, 3):
            got = jacobian_norm(f, x, "2", tol=1e-14, max_iter=cap, method=method)  # type: ignore
            assert got.iterations == cap
            assert not got.converged
            # The value is ||J u|| for a unit u: never above the true norm.
            assert got.value <= exact * (1 + 1e-12)


def test_jacobian_same_seed_same_value() -> None:
    model = _randomised(L2MHA(4, 2), 9)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    a = jacobian_norm(_seq(model), x, "2", max_iter=3, seed=5)
    b = jacobian_norm(_seq(model), x, "2", max_iter=3, seed=5)
    assert a.value == b.value
    assert a.vector is not None and b.vector is not None and torch.equal(a.vector, b.vector)


def test_jacobian_rejects_bad_arguments() -> None:
    x = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="norm"):
        jacobian_norm(lambda z: z, x, "1")
    with pytest.raises(ValueError, match="tol"):
        JacobianConfig(tol=0.0)
    with pytest.raises(ValueError, match="max_iter"):
        jacobian_norm(lambda z: z, x, "2", max_iter=0)
    with pytest.raises(ValueError, match="rows"):
        inf_norm_rows(lambda z: z, x, torch.tensor([4]))
    with pytest.raises(ValueError, match="v0"):
        jacobian_norm(lambda z: z, x, "2", v0=torch.ones(3))
    with pytest.raises(TypeError, match="floating"):
        jacobian_norm(lambda z: z, torch.zeros(2, 2, dtype=torch.long), "2")


def test_jacobian_auto_chunk_shrinks_with_sequence_length() -> None:
    assert auto_chunk(torch.zeros(4, 2), 8) == 64
    assert auto_chunk(torch.zeros(1000, 4), 4000) == 1
