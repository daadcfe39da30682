"""Property tests of the local enclosure arithmetic: for an input X = c + A d with d in the
ball, every op's exact float64 Jacobian and value at sampled points of the ball (and at the
ball's corners / boundary) must lie inside the enclosure the primitive computes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lsa_models.engine import primitives as pr
from lsa_models.engine.rules import layernorm
from lsa_models.engine.values import Ball, LocalValue, enclose

P = 5


def _affine(c: np.ndarray, a: np.ndarray, ball: Ball) -> LocalValue:
    """x(d) = c + A d: Jacobian A exactly."""
    return enclose(c, a, np.zeros_like(a), ball)


def _points(rng: np.random.Generator, eps: float, norm: str, k: int = 8) -> list[np.ndarray]:
    out = []
    for _ in range(k):
        if norm == "inf":
            d = rng.choice([-1.0, 1.0], size=P) * eps if rng.random() < 0.5 else \
                rng.uniform(-eps, eps, size=P)
        else:
            d = rng.standard_normal(P)
            d *= eps / np.linalg.norm(d) * (1.0 if rng.random() < 0.5 else rng.random())
        out.append(d)
    return out


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


@settings(max_examples=500)
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


@settings(max_examples=500)
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


@settings(max_examples=500)
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


@settings(max_examples=500)
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-3, 1e-2, 1e-1]),
       norm=st.sampled_from(["2", "inf"]), ln_eps=st.sampled_from([1e-5, 1e-2, 1.0]))
def test_local_layernorm_encloses_jacobian_and_values(seed: int, eps: float, norm: str,
                                                      ln_eps: float) -> None:
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((2, 6)) * rng.choice([0.1, 1.0, 3.0])
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
