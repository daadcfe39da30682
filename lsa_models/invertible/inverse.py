"""Banach fixed-point inverse of `x + g(x)` with its a-posteriori error bound."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch import Tensor

InverseStatus = Literal["atol", "rtol", "max_iter", "diverged"]


class NotInvertibleError(RuntimeError):
    """A fixed-point inverse did not converge to a certified tolerance."""


@dataclass
class InverseResult:
    """Outcome of a fixed-point inverse.

    `x` is the last iterate; it is an inverse only when `converged` (the tolerance was met).
    `error_bound` bounds `max over sequences ||x - X*||_F` (Banach a-posteriori); it is inf
    when the branch has no certified constant < 1, and then `converged` is always False.
    `predicted_iterations` is Banach's a-priori count for atol (None without atol or bound).
    """

    x: Tensor
    iterations: int
    error_bound: float
    converged: bool
    status: InverseStatus
    lipschitz: float | None
    predicted_iterations: int | None = None
    residual: float = math.nan
    message: str = ""

    def unwrap(self) -> Tensor:
        """The inverse, or NotInvertibleError saying why there is none."""
        if not self.converged:
            raise NotInvertibleError(self.message)
        return self.x


def banach_iterations(lip: float, first_step: float, tol: float) -> int:
    """Smallest k with `lip^k / (1 - lip) * first_step <= tol`: the a-posteriori bound at
    iteration k is at most this, so the iteration stops no later than k."""
    if first_step <= 0:
        return 1
    if tol <= 0:
        return 2**62
    if lip == 0:
        return 1
    k = math.log(tol * (1.0 - lip) / first_step) / math.log(lip)
    return max(1, math.ceil(k - 1e-9))


def _per_seq_norm(t: Tensor) -> Tensor:
    return t.flatten(1).norm(dim=1)  # (B,)


def fixed_point_inverse(g: Callable[[Tensor], Tensor], y: Tensor, lipschitz: float | None,
                        atol: float = 1e-6, rtol: float = 0.0,
                        max_iter: int = 1000) -> InverseResult:
    """Solve `x + g(x) = y` by `x_{k+1} = y - g(x_k)`, from `x_0 = y`.

    Stops when, for every sequence, the bound `c/(1-c) ||x_k - x_{k-1}||_F` is <= atol
    (status "atol") or <= rtol ||x_k||_F ("rtol"); or after max_iter iterations ("max_iter");
    or when the steps blow up or turn non-finite ("diverged"). With no certified `c < 1` there
    is no bound: the steps are still tracked (so divergence is seen) but the result is never
    marked converged.
    """
    if atol < 0 or rtol < 0:
        raise ValueError(f"atol and rtol must be >= 0, got atol={atol}, rtol={rtol}")
    if atol == 0 and rtol == 0:
        raise ValueError("give atol > 0 or rtol > 0: with both 0 the iteration cannot stop")
    if not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter must be a positive integer, got {max_iter!r}")
    certified = lipschitz is not None and lipschitz < 1.0
    factor = lipschitz / (1.0 - lipschitz) if certified else math.inf  # type: ignore[operator]
    x = y
    first: float | None = None
    predicted: int | None = None
    bound = math.inf
    status: InverseStatus = "max_iter"
    it = 0
    for k in range(1, max_iter + 1):
        it = k
        x_new = y - g(x)  # (B, N, D)
        step = _per_seq_norm(x_new - x)  # (B,)
        x = x_new
        step_max = float(step.max())
        if not math.isfinite(step_max):
            status = "diverged"
            break
        if first is None:
            first = step_max
            if certified and atol > 0:
                predicted = banach_iterations(lipschitz, first, atol)  # type: ignore[arg-type]
        elif first > 0 and step_max > 1e6 * first:
            status = "diverged"
            break
        if not certified:
            # Without a contraction constant a small step proves nothing; keep iterating so
            # that a divergent or cycling iteration shows itself.
            continue
        seq_bound = step * factor  # (B,)
        bound = float(seq_bound.max())
        if bool((seq_bound <= atol).all()):
            status = "atol"
            break
        if rtol > 0 and bool((seq_bound <= rtol * _per_seq_norm(x)).all()):
            status = "rtol"
            break
    residual = float(_per_seq_norm(x + g(x) - y).max()) if status != "diverged" else math.inf
    converged = certified and status in ("atol", "rtol")
    if converged:
        msg = f"converged in {it} iterations; error bound {bound:.3g}"
    elif not certified:
        msg = ("the residual branch has no certified Lipschitz constant < 1, so the fixed-point "
               f"iteration has no convergence guarantee; it ended with status {status!r} after "
               f"{it} iterations (residual {residual:.3g}): no inverse is returned")
        bound = math.inf
    else:
        msg = (f"no convergence within max_iter={max_iter} iterations (error bound "
               f"{bound:.3g}); raise max_iter or loosen atol/rtol")
    return InverseResult(x, it, bound, converged, status, lipschitz, predicted, residual, msg)
