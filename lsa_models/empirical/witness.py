"""The Theorem 3.1 witness: dot-product attention's Jacobian grows without bound.

Construction (docs/theory.md, "Dot-product multi-head attention"): put token 1 at 0, so its
attention row is uniform whatever the other tokens are, and spread the others by a scale s:
`X(s) = s Z` with Z a seeded random (N, D) matrix whose first row is zeroed. For D = H = 1,
`d f_1 / d x_1 = W^V W^O (1/N + a Var(x_1..x_N))` with `a = W^Q W^K / sqrt(d)` and the
population variance over all N tokens, which is `s^2` times a constant: the Jacobian norm
grows like s^2. The same input is applied to a whole model (the first attention layer sees
it directly in post-norm blocks).

`dp_growth` evaluates `||J(X(s))||` on a geometric grid of s. The pairs it returns are the
longest strictly increasing tail of that scan (small s can sit on the 1/N plateau or, for
a < 0, dip through zero first), extended until the last value exceeds `exceed` when asked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .jacobian import Fn, Norm, check_norm, inf_norm_rows, jacobian_norm


@dataclass(frozen=True)
class GrowthConfig:
    """Scales `start * factor^k`; at least `points` strictly increasing pairs are returned
    when the scan finds them before `max_scale`. inf-norm: token 1's rows are evaluated (the
    theorem's entry lives there) when f has more than `full_eval_limit` outputs."""

    start: float = 1.0
    factor: float = 2.0
    points: int = 8
    max_scale: float = 1e6
    exceed: float | None = None
    full_eval_limit: int = 512
    tol: float = 1e-8
    max_iter: int = 200
    dtype: torch.dtype = torch.float64

    def __post_init__(self) -> None:
        if not self.start > 0:
            raise ValueError(f"start must be > 0, got {self.start!r}")
        if not self.factor > 1:
            raise ValueError(f"factor must be > 1, got {self.factor!r}")
        if self.points < 2:
            raise ValueError(f"points must be >= 2, got {self.points!r}")
        if not self.max_scale >= self.start:
            raise ValueError(f"max_scale must be >= start, got {self.max_scale!r}")


@dataclass
class Growth:
    """`pairs[i] = (s_i, ||J(X(s_i))||)`, s and the norm both strictly increasing."""

    pairs: list[tuple[float, float]]
    norm: Norm
    seed: int
    scanned: int  # scales evaluated, including the discarded non-increasing head

    @property
    def exponent(self) -> float | None:
        """Log-log slope of the last two pairs: about 2 for DP attention alone (norm ~ s^2),
        1 after a post-norm LayerNorm, near 0 when something bounds the growth (pre-norm)."""
        if len(self.pairs) < 2:
            return None
        (s0, v0), (s1, v1) = self.pairs[-2], self.pairs[-1]
        return math.log(v1 / v0) / math.log(s1 / s0)

    @property
    def increasing(self) -> bool:
        return len(self.pairs) >= 2 and all(
            b[0] > a[0] and b[1] > a[1] for a, b in zip(self.pairs, self.pairs[1:], strict=False))


def growth_direction(input_shape: tuple[int, int], seed: int,
                     dtype: torch.dtype = torch.float64) -> Tensor:
    """Z: seeded standard normal (N, D) with its first token zeroed (the uniform-row token)."""
    n, d = input_shape
    if n < 2:
        raise ValueError("the Theorem 3.1 witness needs N >= 2 tokens")
    g = torch.Generator().manual_seed(seed)
    z = torch.randn((n, d), generator=g, dtype=torch.float64)  # (N, D)
    z[0] = 0.0
    return z.to(dtype)


def witness_input(input_shape: tuple[int, int], scale: float, seed: int,
                  dtype: torch.dtype = torch.float64) -> Tensor:
    """`X(s) = s Z`: reproducible from (shape, s, seed)."""
    return growth_direction(input_shape, seed, dtype) * scale  # (N, D)


def dp_growth(f: Fn, input_shape: tuple[int, int], norm: str = "2", seed: int = 0,
              config: GrowthConfig | None = None,
              on_point: Callable[[float, float], None] | None = None) -> Growth:
    """Evaluate `||J_f(X(s))||_norm` at growing s; see the module docstring."""
    cfg = config or GrowthConfig()
    norm = check_norm(norm)
    shape = (int(input_shape[0]), int(input_shape[1]))
    z = growth_direction(shape, seed, cfg.dtype)  # (N, D)
    scanned: list[tuple[float, float]] = []
    s = cfg.start
    while s <= cfg.max_scale:
        value = _norm_at(f, z * s, norm, cfg, seed)
        if not math.isfinite(value):
            break  # overflow: the scan has gone as far as this dtype allows
        scanned.append((s, value))
        if on_point is not None:
            on_point(s, value)
        tail = _increasing_tail(scanned)
        enough = len(tail) >= cfg.points
        if enough and (cfg.exceed is None or tail[-1][1] > cfg.exceed):
            break
        s *= cfg.factor
    return Growth(_increasing_tail(scanned), norm, seed, len(scanned))


def _norm_at(f: Fn, x: Tensor, norm: Norm, cfg: GrowthConfig, seed: int) -> float:
    if norm == "2":
        return jacobian_norm(f, x, "2", tol=cfg.tol, max_iter=cfg.max_iter, seed=seed).value
    with torch.no_grad():
        m = f(x).numel()
    rows = None if m <= cfg.full_eval_limit else torch.arange(min(m, x.shape[-1]))
    return inf_norm_rows(f, x, rows).value


def _increasing_tail(pairs: list[tuple[float, float]]) -> list[tuple[float, float]]:
    start = len(pairs) - 1
    while start > 0 and pairs[start - 1][1] < pairs[start][1]:
        start -= 1
    return pairs[max(start, 0):]


__all__ = ["Growth", "GrowthConfig", "dp_growth", "growth_direction", "witness_input"]
