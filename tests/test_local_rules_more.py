"""Property tests of the local rules of lsa_models/engine/enclosure/rules_more.py (masked softmax,
-inf masks, Where, comparisons, IsNaN, ReduceMax, fused tanh-Gelu): at sampled points of the ball
(corners and boundary included) the exact float64 Jacobian and value of the op must lie inside the
enclosure; whole graphs exported from torch must have their local bound at or above the exact
Jacobian norm at points of the ball and along projected ascent."""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lsa_models.empirical.local import local_lower_bound
from lsa_models.engine.drivers.jacobian import local_jacobian
from lsa_models.engine.enclosure.rules_more import (
    NEG_MASK,
    CompareRule,
    gelu_tanh,
    masked_softmax,
    reduce_max,
)
from lsa_models.engine.values import Ball, LocalNotCertified, LocalValue
from lsa_models.onnx import load_onnx
from lsa_models.onnx.loading import OnnxModel
from lsa_models.onnx.ops import Node
from tests.profile import at_most

from .test_local_primitives import P, _affine, _points

F32_MIN = float(np.finfo(np.float32).min)




def _check(fn: Callable[[torch.Tensor], torch.Tensor], v: LocalValue, c: np.ndarray,
           a: np.ndarray, pts: list[np.ndarray]) -> None:
    ct, at = torch.from_numpy(c), torch.from_numpy(a)
    for d in pts:
        dt = torch.tensor(d, dtype=torch.float64)
        jac = torch.autograd.functional.jacobian(
            lambda z: fn(ct + torch.einsum("...p,p->...", at, z)), dt).numpy()
        val = fn(ct + torch.einsum("...p,p->...", at, dt)).numpy()
        assert np.all(np.abs(jac - v.jc) <= v.jr + 1e-12 * (1 + np.abs(jac))), \
            float(np.max(np.abs(jac - v.jc) - v.jr))
        assert np.all(val >= v.lo - 1e-12) and np.all(val <= v.hi + 1e-12)


# ---- op level -------------------------------------------------------------------------------


@settings(max_examples=at_most(300), deadline=None)  # an example costs ~40 ms on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 1e-1, 1.0]),
       norm=st.sampled_from(["2", "inf"]), fill=st.sampled_from(["-inf", "f32min"]),
       scale=st.sampled_from([0.5, 3.0]))
def test_masked_softmax_encloses_jacobian_and_values(seed: int, eps: float, norm: str,
                                                     fill: str, scale: float) -> None:
    rng = np.random.default_rng(seed)
    rows, n = 3, 5
    c = rng.standard_normal((rows, n)) * scale  # (rows, n)
    a = rng.standard_normal((rows, n, P))  # (rows, n, P)
    mask = rng.random((rows, n)) < 0.4
    mask[:, 0] = False  # every row keeps one logit
    a[mask] = 0.0
    true_c = np.where(mask, -np.inf if fill == "-inf" else F32_MIN, c)
    ball = Ball(np.zeros(P), eps, norm)
    # the engine carries -inf as the NEG_MASK constant, a float32 fill as itself
    x = _affine(np.where(mask, NEG_MASK if fill == "-inf" else F32_MIN, c), a, ball)
    out_c = torch.softmax(torch.from_numpy(true_c), -1).numpy()
    y = masked_softmax(x, -1, out_c, ball)
    _check(lambda t: torch.softmax(t, -1), y, true_c, a, _points(rng, eps, norm))


@settings(deadline=None)
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 1e-1, 1.0]),
       norm=st.sampled_from(["2", "inf"]), keep=st.booleans(), spread=st.sampled_from(
           [0.01, 0.3, 3.0]))
def test_reduce_max_encloses_jacobian_and_values(seed: int, eps: float, norm: str, keep: bool,
                                                 spread: float) -> None:
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((4, 3)) * spread  # close entries: groups with several candidates
    a = rng.standard_normal((4, 3, P))
    ball = Ball(np.zeros(P), eps, norm)
    x = _affine(c, a, ball)
    out_c = c.max(axis=1, keepdims=keep)
    y = reduce_max(x, (1,), out_c, ball)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return t.amax(dim=1, keepdim=keep)
    pts = []
    for d in _points(rng, eps, norm):
        top = np.sort(c + a @ d, axis=1)
        if np.all(top[:, -1] - top[:, -2] > 1e-9):  # off the kinks (autograd's tie rule)
            pts.append(d)
    _check(fn, y, c, a, pts)


@settings(deadline=None)
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 1e-1, 1.0]),
       norm=st.sampled_from(["2", "inf"]), scale=st.sampled_from([0.5, 2.0, 6.0]))
def test_gelu_tanh_encloses_jacobian_and_values(seed: int, eps: float, norm: str,
                                                scale: float) -> None:
    rng = np.random.default_rng(seed)
    c = rng.standard_normal(6) * scale
    a = rng.standard_normal((6, P))
    ball = Ball(np.zeros(P), eps, norm)
    x = _affine(c, a, ball)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(t, approximate="tanh")
    y = gelu_tanh(x, fn(torch.from_numpy(c)).numpy(), ball)
    _check(fn, y, c, a, _points(rng, eps, norm))


@settings(deadline=None)
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 1e-1]),
       norm=st.sampled_from(["2", "inf"]),
       op=st.sampled_from(["Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Equal"]))
def test_compare_rule_is_constant_on_the_ball_or_refuses(seed: int, eps: float, norm: str,
                                                         op: str) -> None:
    rng = np.random.default_rng(seed)
    c = rng.standard_normal(6)
    a = rng.standard_normal((6, P))
    ball = Ball(np.zeros(P), eps, norm)
    x = _affine(c, a, ball)
    thr = np.round(rng.standard_normal(6), 1)
    fns = {"Greater": np.greater, "Less": np.less, "GreaterOrEqual": np.greater_equal,
           "LessOrEqual": np.less_equal, "Equal": np.equal}
    node = Node(name="cmp", op_type=op, inputs=["x", "t"], outputs=["y"], attrs={})
    try:
        out = CompareRule().apply(node, [x, thr], [fns[op](c, thr)], ball)[0]
    except LocalNotCertified:
        return
    assert isinstance(out, np.ndarray)
    for d in _points(rng, eps, norm):
        assert np.array_equal(fns[op](c + a @ d, thr), out)


# ---- whole graphs ---------------------------------------------------------------------------

N, D = 5, 8


class MaskedMHA(nn.Module):
    """Pre-norm causal nn.MultiheadAttention with a float -inf mask (an Add of -inf)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.mha = nn.MultiheadAttention(D, 2, batch_first=True)
        self.register_buffer("mask", torch.triu(torch.full((N, N), float("-inf")), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (1, N, D)
        h = self.ln(x)
        return x + self.mha(h, h, h, attn_mask=self.mask, need_weights=False)[0]


class FilledAttention(nn.Module):
    """Causal attention by masked_fill (Where) with float32's smallest value, then IsNaN
    cleaning (torch's SDPA decomposition), a ReduceMax pooling and a fused tanh-Gelu."""

    def __init__(self, fill: float) -> None:
        super().__init__()
        self.fill = fill
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.ff = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (1, N, D)
        s = self.q(x) @ self.k(x).transpose(-1, -2) / D ** 0.5  # (1, N, N)
        causal = torch.ones(N, N, dtype=torch.bool).triu(1)
        p = torch.softmax(s.masked_fill(causal, self.fill), dim=-1)
        p = torch.where(torch.isnan(p), torch.zeros_like(p), p)
        y = x + p @ self.v(x)  # (1, N, D)
        g = nn.functional.gelu(self.ff(y), approximate="tanh")
        return torch.cat([g, g.amax(dim=1, keepdim=True)], dim=1)  # (1, N + 1, D)


class Thresholded(nn.Module):
    """where(x > -10, tanh(x W), 0): a comparison the ball never crosses (inputs ~ N(0, 1))."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > -10.0, torch.tanh(self.lin(x)), torch.zeros_like(x))


def _export(model: nn.Module, path: Path, opset: int,
            shape: tuple[int, ...] = (1, N, D)) -> OnnxModel:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), (torch.randn(*shape),), str(path), dynamo=False,
                          opset_version=opset, input_names=["x"], output_names=["y"])
    return load_onnx(path.read_bytes())


@pytest.fixture(scope="module")
def graphs() -> dict[str, OnnxModel]:
    torch.manual_seed(0)
    made = {"mha-inf-mask": (MaskedMHA(), 18), "where-f32min": (FilledAttention(F32_MIN), 20),
            "where-inf": (FilledAttention(float("-inf")), 20), "compare": (Thresholded(), 18)}
    with tempfile.TemporaryDirectory() as tmp:
        return {k: _export(m, Path(tmp) / f"{k}.onnx", o) for k, (m, o) in made.items()}


def test_local_rules_more_graphs_hold_the_ops(graphs: dict[str, OnnxModel]) -> None:
    ops = {k: {n.op_type for n in g.module.runtime_nodes}  # type: ignore[union-attr]
           for k, g in graphs.items()}
    assert {"Where", "IsNaN", "ReduceMax", "Gelu"} <= ops["where-f32min"]
    assert "Greater" in ops["compare"] and "Where" in ops["compare"]
    assert "Softmax" in ops["mha-inf-mask"]


def _jac_norm(om: OnnxModel, x: np.ndarray, norm: str) -> float:
    f = om.module.with_dtype(torch.float64)
    j = torch.autograd.functional.jacobian(f, torch.from_numpy(x)).reshape(-1, x.size)
    return float(torch.linalg.matrix_norm(j, ord=2 if norm == "2" else float("inf")))


@settings(max_examples=at_most(10), deadline=None)  # an example costs ~1.1 s on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 1e-1]),
       norm=st.sampled_from(["2", "inf"]),
       kind=st.sampled_from(["mha-inf-mask", "where-f32min", "where-inf", "compare"]))
def test_local_rules_more_bound_is_never_below_jacobians_in_the_ball(
        graphs: dict[str, OnnxModel], seed: int, eps: float, norm: str, kind: str) -> None:
    om = graphs[kind]
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal((1, N, D))
    upper = local_jacobian(om, x0, eps, norm).upper()
    f64 = om.module.with_dtype(torch.float64)
    lb = local_lower_bound(f64, x0, eps, norm, restarts=1, steps=6, seed=seed)
    assert upper >= lb.lower
    for _ in range(3):
        d = rng.standard_normal(x0.shape)
        d = d / (np.abs(d).max() if norm == "inf" else np.linalg.norm(d)) * eps
        assert upper >= _jac_norm(om, x0 + d, norm)


def test_local_rules_more_bound_tends_to_the_centre_jacobian(
        graphs: dict[str, OnnxModel]) -> None:
    x0 = np.random.default_rng(3).standard_normal((1, N, D))
    for kind, om in graphs.items():
        exact = _jac_norm(om, x0, "2")
        upper = local_jacobian(om, x0, 1e-6, "2").upper()
        assert exact <= upper <= exact * 1.01, kind


def test_local_compare_refuses_a_ball_across_the_threshold(
        graphs: dict[str, OnnxModel]) -> None:
    x0 = np.full((1, N, D), -10.0)  # on the threshold: where(x > -10, ...) jumps there
    with pytest.raises(LocalNotCertified, match="crosses the comparison"):
        local_jacobian(graphs["compare"], x0, 1e-3, "2")


class LNDifference(nn.Module):
    """LN(x)_0 - LN(x)_1 on D = 2 (LayerNorm eps 1e-2): the output's adjoint has both signs
    against the centred input, which is what the LayerNorm's telescoped term must respect."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(2, eps=1e-2)
        self.register_buffer("w", torch.tensor([[1.0], [-1.0]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (1, 3, 2) -> (1, 3, 1)
        return self.ln(x) @ self.w


def test_local_layernorm_enclosure_holds_at_the_corners_of_the_ball(tmp_path: Path) -> None:
    torch.manual_seed(0)
    om = _export(LNDifference(), tmp_path / "ln.onnx", 18, (1, 3, 2))
    x0 = np.random.default_rng(0).standard_normal((1, 3, 2)) * 0.1
    eps = 1e-2
    lj = local_jacobian(om, x0, eps, "inf")
    f = om.module.with_dtype(torch.float64)
    for k in range(2 ** x0.size):  # every corner of the inf-ball
        d = np.array([1.0 if k >> i & 1 else -1.0 for i in range(x0.size)]).reshape(x0.shape)
        jac = torch.autograd.functional.jacobian(f, torch.from_numpy(x0 + eps * d)) \
            .reshape(-1, x0.size).numpy()
        assert np.all(np.abs(jac - lj.jc) <= lj.jr + 1e-12), \
            float(np.max(np.abs(jac - lj.jc) - lj.jr))
