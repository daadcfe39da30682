"""Empirical Lipschitz lower bounds: matrix-free Jacobian norms, input search, DP witness.

`estimate(module, input_shape=(N, D), norm=...)` is the one entry point the CLI and the
service call. Every value it reports is a Jacobian norm evaluated at a concrete, reproducible
input, hence a lower bound on the true constant (never a certificate).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..attention import DotProductMHA
from .jacobian import check_norm, jacobian_norm
from .search import SearchConfig, SearchResult, lower_bound, search
from .witness import Growth, GrowthConfig, dp_growth, growth_direction, witness_input

Progress = Callable[[float, str], None]

# Share of the progress bar (and of the time budget) for the search when a DP growth scan
# follows it; the scan is a fixed number of careful evaluations.
_SEARCH_SHARE = 0.75


@dataclass
class EmpiricalResult:
    """`lower` is realised at `witness`: `||J(witness)||_norm == lower` up to rounding.

    `growth` (dot-product models only): `(s, ||J(X(s))||)` pairs, strictly increasing, for the
    Theorem 3.1 inputs `X(s)` (see `witness.witness_input(input_shape, s, seed)`)."""

    lower: float
    witness: Tensor  # (N, D)
    seed: int
    history: list[float]
    growth: list[tuple[float, float]] | None
    norm: str
    input_shape: tuple[int, int]
    restarts: int
    steps: int
    growth_exponent: float | None = None  # log-log slope of the last two growth pairs
    witness_source: str = "search"  # "search" | "growth" (a growth input beat the search)
    witness_scale: float | None = None  # the growth scale s when witness_source == "growth"
    dot_product: bool = False
    stopped_early: bool = False  # the time budget cut the search or the growth scan short
    radius: float | None = None  # the bounded domain searched (None: all of R^{N x D})
    elapsed_s: float = 0.0
    search: SearchResult | None = None


def has_dot_product(module: nn.Module) -> bool:
    return any(isinstance(m, DotProductMHA) for m in module.modules())


def estimate(module: nn.Module, input_shape: tuple[int, int], norm: str = "2",
             restarts: int = 4, steps: int = 50, seed: int = 0,
             time_budget_s: float | None = None,
             progress: Progress | None = None, *,
             radius: float | None = None) -> EmpiricalResult:
    """Best empirical lower bound on `Lip_norm(module)` over inputs of shape (N, D).

    `module` maps (B, N, D) -> (B, N, D). With a `DotProductMHA` inside, also scans the
    Theorem 3.1 construction and returns its growth pairs. Deterministic for a seed (at a
    fixed torch thread count) as long as the time budget does not cut the run short
    (`stopped_early`). `progress(fraction,
    stage)` is called from this thread, at most about four times a second.

    `radius`: search only inputs whose tokens have 2-norm <= radius, so the result is a lower
    bound for that bounded domain (a report with a radius needs this); the Theorem 3.1 scan
    is skipped there (DP attention is Lipschitz on a bounded domain).
    """
    norm = check_norm(norm)
    if len(input_shape) != 2:
        raise ValueError(f"input_shape must be (N, D), got {tuple(input_shape)}")
    n, d = (int(s) for s in input_shape)
    if n < 1 or d < 1:
        raise ValueError(f"input_shape must be positive, got {(n, d)}")
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    start = time.monotonic()
    if radius is not None and not radius >= 0:
        raise ValueError(f"radius must be >= 0, got {radius!r}")
    dp = has_dot_product(module)
    scan = dp and n >= 2 and radius is None
    share = _SEARCH_SHARE if scan else 1.0
    search_budget = None if time_budget_s is None else time_budget_s * share

    def search_progress(frac: float, stage: str) -> None:
        if progress is not None:
            progress(share * frac, f"search: {stage}")

    with _frozen(module):
        dtype = _dtype_of(module)
        cfg = SearchConfig(norm=norm, restarts=restarts, steps=steps, seed=seed,
                           time_budget_s=search_budget, dtype=dtype, radius=radius)
        res = search(_per_sequence(module), (n, d), cfg, search_progress)
        result = EmpiricalResult(
            lower=res.value, witness=res.witness.detach().clone(), seed=seed,
            history=list(res.history), growth=None, norm=norm, input_shape=(n, d),
            restarts=restarts, steps=steps, dot_product=dp, stopped_early=res.stopped_early,
            radius=radius, search=res)
        if scan:
            _add_growth(module, result, time_budget_s, start, progress)
    result.elapsed_s = time.monotonic() - start
    if progress is not None:
        progress(1.0, "done")
    return result


def _add_growth(module: nn.Module, result: EmpiricalResult, budget: float | None,
                start: float, progress: Progress | None) -> None:
    """Theorem 3.1 scan on the whole model, in float64 where the model allows it (large s
    saturates float32 softmax rows and overflows its Jacobian products sooner)."""
    model64 = _float64_copy(module)
    target = model64 if model64 is not None else module
    dtype = torch.float64 if model64 is not None else _dtype_of(module)
    cfg = GrowthConfig(dtype=dtype)
    f = _per_sequence(target)
    scanned = 0

    def on_point(s: float, value: float) -> None:
        nonlocal scanned
        scanned += 1
        if progress is not None:
            frac = _SEARCH_SHARE + (1 - _SEARCH_SHARE) * min(1.0, scanned / (cfg.points + 4))
            progress(frac, f"growth: s={s:g}")
        if budget is not None and time.monotonic() - start > budget:
            raise _OutOfTime

    try:
        growth: Growth | None = dp_growth(f, result.input_shape, result.norm, result.seed,
                                          cfg, on_point)
    except _OutOfTime:
        growth = None
        result.stopped_early = True
    if growth is None or not growth.pairs:
        return
    result.growth = [(float(s), float(v)) for s, v in growth.pairs]
    result.growth_exponent = growth.exponent
    s_top, v_top = result.growth[-1]
    if v_top > result.lower:
        # A growth input is a concrete input too: the best lower bound found is its norm.
        result.lower = v_top
        result.witness = witness_input(result.input_shape, s_top, result.seed, dtype)
        result.witness_source, result.witness_scale = "growth", s_top
        result.history.append(v_top)


class _OutOfTime(Exception):
    pass


def _per_sequence(module: nn.Module) -> Callable[[Tensor], Tensor]:
    def f(x: Tensor) -> Tensor:  # (N, D) -> (N, D)
        return module(x.unsqueeze(0)).squeeze(0)

    return f


def _dtype_of(module: nn.Module) -> torch.dtype:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _float64_copy(module: nn.Module) -> nn.Module | None:
    try:
        copy64 = copy.deepcopy(module).double()
    except Exception:  # a wrapped graph (ONNX) may not convert: scan in its own dtype
        return None
    copy64.eval()
    return copy64


@contextmanager
def _frozen(module: nn.Module) -> Iterator[None]:
    """Eval mode and no weight gradients for the run (the search differentiates inputs only);
    both restored afterwards, since the caller owns the module."""
    was_training = module.training
    flags = [(p, p.requires_grad) for p in module.parameters()]
    module.eval()
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        module.train(was_training)


def ratio(upper: float | None, lower: float | None) -> float | None:
    """upper / lower, or None when either is missing or lower is not positive."""
    if upper is None or lower is None or not lower > 0 or not math.isfinite(upper):
        return None
    return upper / lower


__all__ = [
    "EmpiricalResult",
    "GrowthConfig",
    "dp_growth",
    "estimate",
    "growth_direction",
    "jacobian_norm",
    "lower_bound",
    "ratio",
    "witness_input",
]
