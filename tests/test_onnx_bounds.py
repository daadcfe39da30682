"""Soundness properties: the dot-product ball bound, and ONNX bounds versus lower bounds."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from lsa_models import DotProductMHA, Transformer, TransformerConfig, certify
from lsa_models.bounds.formulas import dp_mha_out_radius, dp_mha_radius_bound
from lsa_models.onnx import analyse, export_onnx, load_onnx
from lsa_models.onnx.empirical import lower_bound
from tests.profile import at_most


def _dp_reference(m: DotProductMHA):  # type: ignore[no-untyped-def]
    """DP-MHA from the definition in float64 (SDPA has no double backward)."""
    cfg = m.config
    h, dm = cfg.n_heads, cfg.d_model
    d = dm // h
    wq, wk, wv, wo = (lin.weight.detach().double() for lin in
                      (m.q_proj, m.k_proj, m.v_proj, m.out_proj))
    bo = m.out_proj.bias.detach().double()

    def f(x: torch.Tensor) -> torch.Tensor:  # (N, D) -> (N, D)
        n = x.shape[0]
        q = (x @ wq.T).view(n, h, d).transpose(0, 1)  # (H, N, d)
        k = (x @ wk.T).view(n, h, d).transpose(0, 1)  # (H, N, d)
        v = (x @ wv.T).view(n, h, d).transpose(0, 1)  # (H, N, d)
        logits = q @ k.transpose(-1, -2) / math.sqrt(d)  # (H, N, N)
        if cfg.causal:
            mask = torch.ones(n, n, dtype=torch.bool).triu(1)
            logits = logits.masked_fill(mask, float("-inf"))
        y = (torch.softmax(logits, -1) @ v).transpose(0, 1).reshape(n, dm)  # (N, D)
        return y @ wo.T + bo

    return f


def _jacobian(f, x: torch.Tensor, create_graph: bool = False) -> torch.Tensor:  # type: ignore[no-untyped-def]
    jac = torch.autograd.functional.jacobian(f, x, create_graph=create_graph)
    return jac.reshape(x.numel(), x.numel())


def _dp_case(dm: int, h: int, causal: bool, scale: float, seed: int) -> DotProductMHA:
    torch.manual_seed(seed)
    m = DotProductMHA(dm, h, causal=causal)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(scale)
        m.out_proj.bias.normal_()
    return m


def _in_ball(n: int, dm: int, radius: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dm, generator=g, dtype=torch.float64)
    r = radius * torch.rand(n, 1, generator=g, dtype=torch.float64) ** 0.5
    return x / x.norm(dim=-1, keepdim=True) * r


_shapes = st.sampled_from([(2, 1), (2, 2), (4, 1), (4, 2), (6, 3)])


@given(shape=_shapes, n=st.integers(1, 4), causal=st.booleans(),
       radius=st.floats(0.05, 6.0), scale=st.floats(0.2, 3.0), seed=st.integers(0, 10**6))
def test_dp_radius_bound_dominates_jacobian_inside_ball(shape: tuple[int, int], n: int,
                                                        causal: bool, radius: float,
                                                        scale: float, seed: int) -> None:
    dm, h = shape
    m = _dp_case(dm, h, causal, scale, seed)
    f = _dp_reference(m)
    x = _in_ball(n, dm, radius, seed + 1)
    jac = _jacobian(f, x)
    up2 = certify(m, "2", n, radius).upper
    upinf = certify(m, "inf", n, radius).upper
    assert up2 is not None and upinf is not None
    assert float(torch.linalg.matrix_norm(jac, 2)) <= up2
    assert float(jac.abs().sum(1).max()) <= upinf
    # the output radius bounds every output token
    wv = m.v_proj.weight.detach().T.reshape(dm, h, dm // h).permute(1, 0, 2)
    out_r = dp_mha_out_radius(wv, m.out_proj.weight.detach().T, radius, None,
                              m.out_proj.bias.detach())
    assert float(f(x).norm(dim=-1).max()) <= out_r


@settings(max_examples=at_most(40))  # an example costs ~370 ms on 2 shared cores
@given(shape=_shapes, n=st.integers(2, 4), causal=st.booleans(),
       radius=st.floats(0.5, 4.0), scale=st.floats(0.5, 3.0), seed=st.integers(0, 10**6))
def test_dp_radius_bound_dominates_projected_gradient_ascent(
        shape: tuple[int, int], n: int, causal: bool, radius: float, scale: float,
        seed: int) -> None:
    dm, h = shape
    m = _dp_case(dm, h, causal, scale, seed)
    f = _dp_reference(m)
    up2 = certify(m, "2", n, radius).upper
    assert up2 is not None
    x = _in_ball(n, dm, radius, seed + 2).requires_grad_(True)
    for _ in range(15):
        val = torch.linalg.matrix_norm(_jacobian(f, x, create_graph=True), 2)
        assert float(val.detach()) <= up2
        (g,) = torch.autograd.grad(val, x)
        with torch.no_grad():
            x += 0.25 * radius * g / (g.norm() + 1e-12)
            x *= torch.clamp(radius / x.norm(dim=-1, keepdim=True).clamp_min(1e-30), max=1.0)


def test_dp_radius_bound_grows_with_radius_and_needs_finite_radius() -> None:
    m = _dp_case(4, 2, False, 1.0, 0)
    ups = [certify(m, "2", 4, r).upper for r in (0.5, 1.0, 2.0, 4.0)]
    assert all(a is not None and b is not None and a < b
               for a, b in zip(ups, ups[1:], strict=False))
    wq = torch.randn(2, 4, 2)
    with pytest.raises(ValueError):
        dp_mha_radius_bound(wq, wq, wq, torch.eye(4), 3, math.inf, "2")


# ---- ONNX graphs: certified upper bound >= empirical lower bound --------------------------

def _mlp_onnx(seed: int, widths: list[int], acts: list[str], residual: bool,
              n: int) -> bytes:
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    cur = "x"
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        w = (rng.standard_normal((a, b)) * rng.uniform(0.3, 2.0) / math.sqrt(a)).astype(
            np.float32)
        bias = rng.standard_normal(b).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(bias, f"b{i}")]
        nodes += [helper.make_node("MatMul", [cur, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"], name=f"add{i}"),
                  helper.make_node(acts[i % len(acts)], [f"a{i}"], [f"h{i}"], name=f"act{i}")]
        cur = f"h{i}"
    if residual and widths[0] == widths[-1]:
        nodes.append(helper.make_node("Add", [cur, "x"], ["res"], name="residual"))
        cur = "res"
    nodes.append(helper.make_node("Identity", [cur], ["y"], name="out"))
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n, widths[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n, widths[-1]])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    onnx.checker.check_model(model)
    return model.SerializeToString()


@settings(max_examples=at_most(30))  # an example costs ~80 ms on 2 shared cores
@given(seed=st.integers(0, 10**6), depth=st.integers(1, 3), width=st.sampled_from([2, 3, 5]),
       acts=st.lists(st.sampled_from(["Relu", "Tanh", "Sigmoid", "Gelu"]), min_size=1,
                     max_size=3),
       residual=st.booleans(), n=st.integers(1, 3), norm=st.sampled_from(["2", "inf"]))
def test_onnx_mlp_certified_upper_dominates_lower_bound(
        seed: int, depth: int, width: int, acts: list[str], residual: bool, n: int,
        norm: str) -> None:
    data = _mlp_onnx(seed, [width] * (depth + 1), acts, residual, n)
    model = load_onnx(data)
    res = analyse(model, norm)  # type: ignore[arg-type]
    assert res.verdict == "certified" and res.upper is not None
    low = lower_bound(model, norm, n, restarts=1, steps=6, seed=seed)
    assert low.lower <= res.upper * (1 + 1e-12)


@pytest.fixture(scope="module")
def attention_models(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, Path, float
                                                                         | None]]:
    out = []
    root = tmp_path_factory.mktemp("att")
    for i, (kind, norm_first, causal, radius) in enumerate([
            ("l2", True, False, None), ("l2", False, True, None), ("dp", False, False, 1.5),
            ("dp", True, True, 2.0), ("l2", False, False, 1.0)]):
        torch.manual_seed(100 + i)
        model = Transformer(TransformerConfig(d_model=4, n_heads=2, n_layers=1, d_ff=6,
                                              attention=kind, norm_first=norm_first,
                                              causal=causal))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path = export_onnx(model, root / f"m{i}.onnx", 3, dynamo=False)
        out.append((kind, path, radius))
    return out


@pytest.mark.parametrize("index", range(5))
@pytest.mark.parametrize("norm", ["2", "inf"])
def test_onnx_attention_certified_upper_dominates_lower_bound(
        attention_models: list[tuple[str, Path, float | None]], index: int, norm: str) -> None:
    kind, path, radius = attention_models[index]
    model = load_onnx(path.read_bytes())
    res = analyse(model, norm, None, radius)  # type: ignore[arg-type]
    assert res.verdict == "certified", res.reason
    assert res.upper is not None
    low = lower_bound(model, norm, 3, radius=radius, restarts=2, steps=8, seed=index)
    assert 0 < low.lower <= res.upper
