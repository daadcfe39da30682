"""The local engine on whole ONNX graphs (the issue-15 classifiers): the certified constant
on the ball is never below an exact float64 Jacobian norm at a point of the ball (random
points, corners, and projected Jacobian ascent), and tends to ||J(X0)|| as eps -> 0."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.local_models import N, build, center, export
from lsa_models.empirical.local import jacobian_norm, local_lower_bound
from lsa_models.engine import local_jacobian
from lsa_models.engine.local import certify_local
from lsa_models.onnx import OnnxModel, load_onnx


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, OnnxModel]:
    tmp = tmp_path_factory.mktemp("local")
    return {k: load_onnx(export(build(k, seed=3), Path(tmp) / f"{k}.onnx").read_bytes())
            for k in ("mlp", "tf1")}


def _jac_norm(om: OnnxModel, x: np.ndarray, norm: str) -> float:
    f = om.module.with_dtype(torch.float64)
    xt = torch.from_numpy(x)
    jac = torch.autograd.functional.jacobian(lambda z: f(z).reshape(-1), xt)
    return float(jacobian_norm(jac.reshape(-1, x.size), norm))


@settings(max_examples=12)
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 1e-1]),
       norm=st.sampled_from(["2", "inf"]), kind=st.sampled_from(["mlp", "tf1"]))
def test_local_bound_is_never_below_jacobians_in_the_ball(
        models: dict[str, OnnxModel], seed: int, eps: float, norm: str, kind: str) -> None:
    om = models[kind]
    x0 = center(seed % 1000).numpy().astype(np.float64)
    upper = local_jacobian(om, x0, eps, norm).upper()
    rng = np.random.default_rng(seed)
    for _ in range(4):
        if norm == "inf":
            d = rng.choice([-1.0, 1.0], size=x0.shape) * eps
        else:
            d = rng.standard_normal(x0.shape)
            d *= eps / np.linalg.norm(d)
        assert _jac_norm(om, x0 + d, norm) <= upper
    f64 = om.module.with_dtype(torch.float64)
    lb = local_lower_bound(f64, x0, eps, norm, restarts=2, steps=6, seed=seed)
    assert lb.lower <= upper
    assert float(np.abs(lb.witness - x0).max() if norm == "inf"
                 else np.linalg.norm(lb.witness - x0)) <= eps * (1 + 1e-9)


def test_local_bound_tends_to_the_centre_jacobian(models: dict[str, OnnxModel]) -> None:
    x0 = center(7).numpy().astype(np.float64)
    for kind, om in models.items():
        for norm in ("2", "inf"):
            exact = _jac_norm(om, x0, norm)
            at0 = local_jacobian(om, x0, 0.0, norm).upper()
            small = local_jacobian(om, x0, 1e-4, norm).upper()
            assert exact <= at0 <= exact * (1 + 1e-4), (kind, norm)
            assert at0 <= small <= exact * 1.1, (kind, norm)


def test_local_certify_reports_domain_and_layer_rules(models: dict[str, OnnxModel]) -> None:
    x0 = center(2).numpy()
    res = certify_local(models["tf1"], x0, 1e-2, "2")
    assert res.verdict == "certified" and res.upper is not None
    assert res.domain is not None and res.domain["eps"] == 1e-2
    assert res.domain["norm"] == "2" and len(res.domain["center_sha256"]) == 64
    ln = [lb for lb in res.layers if lb.kind == "layernorm"]
    assert ln and all(lb.global_upper is not None and lb.upper is not None
                      and lb.upper < lb.global_upper and lb.rule for lb in ln)


@pytest.mark.parametrize("bad", [np.zeros((N, 3)), np.zeros((2, N, 16)), np.zeros(5)])
def test_local_certify_rejects_a_bad_center_shape(models: dict[str, OnnxModel],
                                                  bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match="shape"):
        certify_local(models["mlp"], bad, 1e-2, "2")


@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf")])
def test_local_certify_rejects_a_bad_eps(models: dict[str, OnnxModel], eps: float) -> None:
    with pytest.raises(ValueError, match="eps"):
        certify_local(models["mlp"], center().numpy(), eps, "2")
