"""Projected gradient descent on one classification margin inside a ball, shared by the
tests of the margins' lower bounds (affine forms, deferred head); points on a ball's
boundary, shared by the tests that check a bound or a radius there."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch


def boundary_point(rng: np.random.Generator, shape: tuple[int, ...], radius: float,
                   norm: str) -> np.ndarray:
    """An offset on the ball's boundary: a random corner (inf) or sphere point (2)."""
    if norm == "inf":
        return rng.choice([-1.0, 1.0], size=shape) * radius
    d = rng.standard_normal(shape)
    return d * (radius / np.linalg.norm(d))


def descend_margin(f: Callable[[torch.Tensor], torch.Tensor], x0: torch.Tensor, label: int,
                   j: int, eps: float, norm: str, d: torch.Tensor, steps: int = 40
                   ) -> Iterator[float]:
    """From the offset d (inside the ball), `steps` projected signed (inf) or normalised (2)
    gradient steps of eps / 10 down f_label - f_j; yields the margin at every point visited
    and at the last one."""
    for _ in range(steps):
        d.requires_grad_(True)
        out = f(x0 + d).reshape(-1)
        m = out[label] - out[j]
        yield float(m.detach())
        (gd,) = torch.autograd.grad(m, d)
        with torch.no_grad():
            if norm == "inf":
                d = (d - eps / 10 * gd.sign()).clamp(-eps, eps)
            else:
                d = d - eps / 10 * gd / gd.norm().clamp_min(1e-300)
                d = d * min(1.0, eps / float(d.norm()))
    with torch.no_grad():
        out = f(x0 + d).reshape(-1)
    yield float(out[label] - out[j])


def with_and_without_heads(om: object, x0: np.ndarray, eps: float, norm: str, label: int
                           ) -> tuple[dict[int, float], dict[int, float]]:
    """The margins' lower bounds with the heads' refinements (deferred LayerNorm / RMSNorm
    product, one-token sign, ReLU head) and with the plain output form alone
    (margins.DEFER off)."""
    from lsa_models.engine.drivers import margins

    low = margins.margin_lower_bounds(om, x0, eps, norm, label)  # type: ignore[arg-type]
    token = margins.DEFER
    margins.DEFER = False
    try:
        plain = margins.margin_lower_bounds(om, x0, eps, norm, label)  # type: ignore[arg-type]
    finally:
        margins.DEFER = token
    assert low is not None and plain is not None
    return low, plain
