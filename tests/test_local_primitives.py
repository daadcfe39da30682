"""Property tests of the local enclosure arithmetic: for an input X = c + A d with d in the
ball, every op's exact float64 Jacobian and value at sampled points of the ball (and at the
ball's corners / boundary) must lie inside the enclosure the primitive computes."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from lsa_models.engine import elementwise_chains as fused
from lsa_models.engine.drivers.jacobian_walk import fused_chains
from lsa_models.engine.elementwise_chains import Chain
from lsa_models.engine.enclosure import primitives as pr
from lsa_models.engine.enclosure.rules import layernorm
from lsa_models.engine.remainders.structured_norms import _inf_to_one
from lsa_models.engine.values import Ball, LocalValue, enclose
from lsa_models.onnx import load_onnx
from lsa_models.onnx.ops import Node
from tests.jacobians import ball_points

P = 5


def _affine(c: np.ndarray, a: np.ndarray, ball: Ball) -> LocalValue:
    """x(d) = c + A d: Jacobian A exactly."""
    return enclose(c, a, np.zeros_like(a), ball)


def _points(rng: np.random.Generator, eps: float, norm: str, k: int = 8) -> list[np.ndarray]:
    return ball_points(rng, P, eps, norm, k)


def _check(fn, v: LocalValue, c: np.ndarray, a: np.ndarray, pts: list[np.ndarray]) -> None:  # type: ignore[no-untyped-def]
    for d in pts:
        dt = torch.tensor(d, dtype=torch.float64)
        jac = torch.autograd.functional.jacobian(
            lambda z: fn(torch.from_numpy(c) + torch.einsum("...p,p->...", torch.from_numpy(a),
                                                             z)), dt).numpy()
        val = fn(torch.from_numpy(c) + torch.einsum("...p,p->...", torch.from_numpy(a),
                                                     dt)).numpy()
        assert np.all(np.abs(jac - v.jc) <= v.jr + 1e-12 * (1 + np.abs(jac))), \
            float(np.max(np.abs(jac - v.jc) - v.jr))
        assert np.all(val >= v.lo - 1e-12) and np.all(val <= v.hi + 1e-12)


_FUNCS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": torch.nn.functional.gelu, "erf": torch.erf, "tanh": torch.tanh,
    "sigmoid": torch.sigmoid, "exp": torch.exp, "relu": torch.relu}


@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 1e-1, 1.0]),
       norm=st.sampled_from(["2", "inf"]), kind=st.sampled_from(sorted(_FUNCS) + [
           "sqrt", "reciprocal", "pow"]))
def test_local_elementwise_encloses_jacobian_and_values(seed: int, eps: float, norm: str,
                                                        kind: str) -> None:
    rng = np.random.default_rng(seed)
    c = rng.standard_normal(4) * 2
    if kind in ("sqrt", "reciprocal"):
        c = np.abs(c) + 0.5 + 3 * eps * 2
    a = rng.standard_normal((4, P))
    ball = Ball(np.zeros(P), eps, norm)
    x = _affine(c, a, ball)
    extra: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "sqrt": torch.sqrt, "reciprocal": torch.reciprocal, "pow": lambda t: t * t}
    fn = extra.get(kind) or _FUNCS[kind]
    if kind in ("sqrt", "reciprocal") and np.any(x.lo <= 0):
        return
    y = pr.elementwise(x, kind, fn(torch.from_numpy(c)).numpy(), ball)
    pts = [d for d in _points(rng, eps, norm)
           if kind != "relu" or np.all(np.abs(c + a @ d) > 1e-9)]  # relu: off its kink
    _check(fn, y, c, a, pts)


@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 1e-1, 1.0]),
       norm=st.sampled_from(["2", "inf"]), matmul=st.booleans())
def test_local_product_encloses_jacobian_and_values(seed: int, eps: float, norm: str,
                                                    matmul: bool) -> None:
    rng = np.random.default_rng(seed)
    ca, cb = rng.standard_normal((3, 4)), rng.standard_normal((4, 2) if matmul else (3, 4))
    aa, ab = rng.standard_normal((*ca.shape, P)), rng.standard_normal((*cb.shape, P))
    ball = Ball(np.zeros(P), eps, norm)
    va, vb = _affine(ca, aa, ball), _affine(cb, ab, ball)
    op = (lambda x, y: x @ y) if matmul else (lambda x, y: x * y)
    y = pr.product(va, vb, op(ca, cb), ball, matmul)
    na = ca.size

    def fn(z: torch.Tensor) -> torch.Tensor:  # z stacks a and b
        return op(z[:na].reshape(ca.shape), z[na:].reshape(cb.shape))

    c = np.concatenate([ca.reshape(-1), cb.reshape(-1)])
    a = np.concatenate([aa.reshape(na, P), ab.reshape(-1, P)])
    _check(fn, y, c, a, _points(rng, eps, norm))


@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 1e-1, 1.0]),
       norm=st.sampled_from(["2", "inf"]))
def test_local_softmax_encloses_jacobian_and_values(seed: int, eps: float, norm: str) -> None:
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((2, 4)) * 2
    a = rng.standard_normal((2, 4, P))
    ball = Ball(np.zeros(P), eps, norm)
    y = pr.softmax(_affine(c, a, ball), -1, torch.softmax(torch.from_numpy(c), -1).numpy(),
                   ball)
    _check(lambda t: torch.softmax(t, -1), y, c, a, _points(rng, eps, norm))


@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 1e-1]),
       norm=st.sampled_from(["2", "inf"]), ln_eps=st.sampled_from([1e-5, 1e-2, 1.0]))
def test_local_layernorm_encloses_jacobian_and_values(seed: int, eps: float, norm: str,
                                                      ln_eps: float) -> None:
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((2, 6)) * rng.choice([0.01, 0.1, 1.0, 3.0])  # 0.01: near eps
    a = rng.standard_normal((2, 6, P))
    g, b = rng.standard_normal(6), rng.standard_normal(6)
    ball = Ball(np.zeros(P), eps, norm)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(t, (6,), torch.from_numpy(g), torch.from_numpy(b),
                                              ln_eps)
    try:
        y = layernorm(_affine(c, a, ball), g, b, ln_eps, fn(torch.from_numpy(c)).numpy(), ball)
    except Exception as exc:  # a range reaching s <= 0 is refused, never wrong
        assert "LocalNotCertified" in type(exc).__name__
        return
    _check(fn, y, c, a, _points(rng, eps, norm))


# ---- fused elementwise chains (fused.py) ---------------------------------------------------

def _chain(kind: str) -> tuple[Chain, dict[str, float], Callable[[torch.Tensor], torch.Tensor]]:
    """The tanh form of GELU as torch exports it, or a chain with Pow/Erf/Sigmoid/Div/Sub."""
    if kind == "gelu_tanh":
        nodes = [Node("m", "Mul", ["x", "x"], ["x2"]), Node("m1", "Mul", ["x", "x2"], ["x3"]),
                 Node("m2", "Mul", ["a", "x3"], ["ax3"]), Node("ad", "Add", ["x", "ax3"], ["s"]),
                 Node("m3", "Mul", ["c", "s"], ["cs"]), Node("t", "Tanh", ["cs"], ["th"]),
                 Node("ad1", "Add", ["one", "th"], ["p"]), Node("m4", "Mul", ["x", "p"], ["xp"]),
                 Node("m5", "Mul", ["half", "xp"], ["y"])]
        consts = {"a": 0.044715, "c": 0.7978845608028654, "one": 1.0, "half": 0.5}
        return Chain("x", "y", nodes), consts, lambda x: torch.nn.functional.gelu(
            x, approximate="tanh")
    nodes = [Node("p", "Pow", ["x", "three"], ["x3"]), Node("e", "Erf", ["x3"], ["ex"]),
             Node("s", "Sigmoid", ["x"], ["sx"]), Node("m", "Mul", ["ex", "sx"], ["q"]),
             Node("d", "Div", ["q", "two"], ["q2"]), Node("b", "Sub", ["q2", "x"], ["r"]),
             Node("n", "Neg", ["r"], ["y"])]
    return Chain("x", "y", nodes), {"three": 3.0, "two": 2.0}, lambda x: -(
        torch.erf(x ** 3) * torch.sigmoid(x) / 2.0 - x)


@given(seed=st.integers(0, 10**6), width=st.sampled_from([1e-3, 0.1, 1.0, 4.0]),
       kind=st.sampled_from(["gelu_tanh", "mixed"]))
def test_local_fused_chain_encloses_values_and_slopes(seed: int, width: float, kind: str) -> None:
    rng = np.random.default_rng(seed)
    chain, consts, fn = _chain(kind)
    lo = rng.standard_normal(16) * 2
    hi = lo + width * rng.random(16)
    (vlo, vhi), (dlo, dhi) = fused.ranges(chain, consts, lo, hi)
    for t in [0.0, 1.0, *rng.random(6)]:
        x = torch.tensor(lo + t * (hi - lo), dtype=torch.float64, requires_grad=True)
        y = fn(x)
        (g,) = torch.autograd.grad(y.sum(), x)
        yv, gv = y.detach().numpy(), g.numpy()
        assert np.all(yv >= vlo - 1e-12 * (1 + np.abs(yv))) and np.all(yv <= vhi + 1e-12 * (
            1 + np.abs(yv)))
        assert np.all(gv >= dlo - 1e-12 * (1 + np.abs(gv))) and np.all(gv <= dhi + 1e-12 * (
            1 + np.abs(gv)))


def test_local_fused_chains_found_in_a_tanh_gelu_mlp(tmp_path: Path) -> None:
    """torch exports GELU's tanh form as 9 nodes; each activation becomes one fused chain."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(1), torch.nn.Linear(12, 8),
                              torch.nn.GELU("tanh"), torch.nn.Linear(8, 8),
                              torch.nn.GELU("tanh"), torch.nn.Linear(8, 2)).eval()
    path = tmp_path / "m.onnx"
    torch.onnx.export(net, (torch.randn(1, 3, 4),), str(path), dynamo=False, opset_version=18,
                      input_names=["x"], output_names=["y"])
    om = load_onnx(path.read_bytes())
    module = om.module.with_dtype(torch.float64)
    env = module.run_env(torch.zeros(1, 3, 4, dtype=torch.float64))
    chains, inside = fused_chains(om, module, env)
    assert len(chains) == 2 and all(len(c.nodes) == 9 for c in chains.values())
    assert len(inside) == 18


# ---- structured norms (structured.py) --------------------------------------------------------

@given(seed=st.integers(0, 10**6), n=st.integers(1, 6), p=st.integers(1, 8))
def test_local_inf_to_one_bound_is_above_the_brute_force_norm(seed: int, n: int, p: int) -> None:
    rng = np.random.default_rng(seed)
    c = np.abs(rng.standard_normal(n)) * (rng.random(n) < 0.8)
    jc = rng.standard_normal((n, p)) * rng.choice([1e-3, 1.0, 1e3])
    b = c[:, None] * jc
    exact = max(float(np.abs(b @ np.array(s)).sum()) for s in itertools.product([-1.0, 1.0],
                                                                              repeat=p))
    plain = float((c @ np.abs(jc).sum(axis=1)) * (1 + 1e-12))
    bound = _inf_to_one(c, jc, plain)
    assert exact <= bound * (1 + 1e-12) + 1e-300 and bound <= plain
