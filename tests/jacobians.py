"""Exact Jacobian norms (float64, torch.func.jacrev) for soundness tests."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor
from torch.func import grad, jacrev, jvp, vjp

Fn = Callable[[Tensor], Tensor]


def jacobian_matrix(f: Fn, x: Tensor) -> Tensor:
    """J of vec(f(X)) with respect to vec(X): (numel out, numel in)."""
    j = jacrev(f)(x)
    return j.reshape(-1, x.numel())


def norm_of(j: Tensor, norm: str) -> float:
    if norm == "2":
        return float(torch.linalg.matrix_norm(j.detach(), ord=2))
    return float(j.detach().abs().sum(dim=1).max())


def jacobian_norm(f: Fn, x: Tensor, norm: str) -> float:
    return norm_of(jacobian_matrix(f, x), norm)


def _surrogate(f: Fn, x: Tensor, norm: str) -> Fn:
    """A smooth objective whose value at x equals ||J(x)|| and whose gradient is the envelope
    gradient of the norm: u^T J v for the top singular pair (2), or the signed sum of the
    largest-row-sum row (inf). Cheap: one jvp or vjp instead of differentiating an SVD."""
    j = jacobian_matrix(f, x)
    if norm == "2":
        _, _, vh = torch.linalg.svd(j)
        v = vh[0].reshape(x.shape)

        def obj2(z: Tensor) -> Tensor:
            return jvp(f, (z,), (v,))[1].norm()

        return obj2
    row = int(j.abs().sum(dim=1).argmax())
    signs = torch.sign(j[row]).reshape(x.shape)

    def obj_inf(z: Tensor) -> Tensor:
        out, pull = vjp(f, z)
        e = torch.zeros_like(out).reshape(-1)
        e[row] = 1.0
        return (pull(e.reshape(out.shape))[0] * signs).sum()

    return obj_inf


def ascend(f: Fn, x: Tensor, norm: str, steps: int, lr: float = 0.3) -> tuple[Tensor, float]:
    """Push x towards a larger Jacobian norm by normalised gradient ascent; best (x, ||J||)."""
    best, best_val = x, jacobian_norm(f, x, norm)
    scale = float(x.abs().max().clamp_min(1.0))
    for _ in range(steps):
        step = grad(_surrogate(f, x, norm))(x)
        n = step.norm()
        if not torch.isfinite(n) or n == 0:
            break
        x = (x + lr * scale * step / n).detach()
        val = jacobian_norm(f, x, norm)
        if val > best_val:
            best, best_val = x, val
    return best, best_val


def max_jacobian_norm(f: Fn, x: Tensor, norm: str, steps: int = 3) -> float:
    """max of ||J_f|| at x and along a short gradient ascent from x."""
    return ascend(f, x, norm, steps)[1]


def ball_points(rng: np.random.Generator, p: int, eps: float, norm: str, k: int = 8
                ) -> list[np.ndarray]:
    """k offsets d in the eps-ball of R^p: half on its boundary (inf: a vertex; 2: the
    sphere), where a Jacobian enclosure is tightest-pressed, half inside."""
    out = []
    for _ in range(k):
        if norm == "inf":
            d = rng.choice([-1.0, 1.0], size=p) * eps if rng.random() < 0.5 else \
                rng.uniform(-eps, eps, size=p)
        else:
            d = rng.standard_normal(p)
            d *= eps / np.linalg.norm(d) * (1.0 if rng.random() < 0.5 else rng.random())
        out.append(d)
    return out


def assert_arb_holds(op: object, x: np.ndarray) -> None:
    """The op's 256-bit ball arithmetic (`op.arb`) holds f at each float64 point of x to
    1e-13 relative, with a radius below 1e-60 (an elementwise op: `op.point` is f)."""
    import flint

    from lsa_models.engine.rounding.forward_ball import PREC

    old = flint.ctx.prec
    flint.ctx.prec = PREC
    try:
        f = op.arb(flint.arb)  # type: ignore[attr-defined]
        for v, want in zip(x, op.point(x), strict=True):  # type: ignore[attr-defined]
            b = f(flint.arb(float(v)))
            assert float((b - flint.arb(float(want))).abs_upper()) <= 1e-13 * (1 + abs(want))
            assert float(b.rad()) < 1e-60 * (1 + abs(want))
    finally:
        flint.ctx.prec = old
