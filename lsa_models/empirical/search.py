"""Empirical lower bounds on `Lip_p(f)`: gradient ascent over inputs, random restarts.

Any input X gives `||J_f(X)||_p <= Lip_p(f)` and any pair gives
`||f(X) - f(Y)||_p / ||X - Y||_p <= Lip_p(f)` (docs/theory.md, "Empirical lower bounds"). The
search maximises one of them from several random starts at several input scales and keeps
the best value with the input that realises it. Every number it reports was evaluated at
that input, so re-evaluating the witness reproduces it; the seed reproduces the witness.

Ascent objectives (each one is itself a valid lower bound at the point it is evaluated):
- 2-norm: `||J(X) v||` for a unit v kept near the top right singular vector by one power
  step per ascent step (warm-started). Its gradient in X is the envelope gradient of
  `||J(X)||_2` when v is the top singular vector.
- inf-norm: the absolute sum of one row r of J (`||J(X)^T e_r||_1`), r chosen at each restart
  as the largest among candidate rows; `sup_X max_r = max_r sup_X`, so a fixed row loses
  nothing but the choice of r.
- pairs: the ratio itself, over X and Y = X + delta, for maps not differentiable everywhere.

Structured starts (on by default, Jacobian form): random starts rarely land near the inputs
where attention's Jacobian peaks, one token sitting between clusters of others (the shape of
Theorem 3.1's construction and of the extremal inputs of Theorem 3.2's proof). So the first
restart starts from the best of a few such inputs: token 0 at the origin and the others at
`+-t u` ("split") or all at `t u` ("cluster"), u a seeded random unit direction, t over a
geometric grid; each is scored by one cheap Jacobian evaluation. On the paper's setting
(unit-weight L2, D = H = 1, N = 20, inf-norm) this finds 5.93 where four random restarts
find 4.25.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from .jacobian import (
    Fn,
    JacobianNorm,
    Norm,
    check_norm,
    differentiable_attention,
    inf_norm_rows,
    jacobian_norm,
)

Form = Literal["jacobian", "pairs"]
Progress = Callable[[float, str], None]

_PROGRESS_EVERY_S = 0.25


@dataclass(frozen=True)
class SearchConfig:
    """One lower-bound search. `lr` is relative to the restart's input scale. `row_candidates`
    rows are scored to pick the inf-norm row of a restart; at the witness all rows are
    evaluated when f has at most `full_eval_limit` outputs, else those candidates plus the
    optimised row and the first rows of its token (up to `row_candidates`). `pair_floor`
    keeps `||X - Y||` above that fraction of the scale, so rounding in `f(X) - f(Y)` cannot
    inflate the ratio."""

    norm: Norm = "2"
    restarts: int = 4
    steps: int = 50
    seed: int = 0
    time_budget_s: float | None = None
    scales: tuple[float, ...] = (1.0, 0.3, 3.0, 0.1, 10.0)
    lr: float = 0.05
    form: Form = "jacobian"
    row_candidates: int = 32
    full_eval_limit: int = 512
    pair_spread: float = 0.1
    pair_floor: float = 1e-3
    tol: float = 1e-6
    max_iter: int = 200
    dtype: torch.dtype = torch.float32
    radius: float | None = None  # keep every token's 2-norm <= radius (bounded domain)
    structured: bool = True  # first restart from the best structured start (module docstring)
    structured_scales: tuple[float, ...] = tuple(10.0 ** (k / 4) for k in range(-4, 5))

    def __post_init__(self) -> None:
        check_norm(self.norm)
        if self.radius is not None and not self.radius >= 0:
            raise ValueError(f"radius must be >= 0, got {self.radius!r}")
        for name in ("restarts", "row_candidates", "full_eval_limit", "max_iter"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 0:
            raise ValueError(f"steps must be an integer >= 0, got {self.steps!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"time budget must be > 0 seconds, got {self.time_budget_s!r}")
        for name in ("scales", "structured_scales"):
            vals = getattr(self, name)
            if not vals or any(not v > 0 for v in vals):
                raise ValueError(f"{name} must be positive, got {vals!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if self.form not in ("jacobian", "pairs"):
            raise ValueError(f"form must be 'jacobian' or 'pairs', got {self.form!r}")
        if not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be floating point, got {self.dtype}")


@dataclass
class SearchResult:
    """`value` is realised by `witness` (and `pair`, for the pairs form)."""

    value: float
    witness: Tensor
    seed: int
    history: list[float]  # best value so far after each evaluation, all restarts in order
    norm: Norm
    form: Form
    pair: Tensor | None = None  # Y of the best pair (pairs form)
    scale: float = 1.0  # input scale of the restart that found the witness
    restart: int = 0
    evaluations: int = 0
    stopped_early: bool = False  # the time budget ran out
    elapsed_s: float = 0.0
    final: JacobianNorm | None = None  # the careful evaluation at the witness
    values_by_restart: list[float] = field(default_factory=list)


class _Clock:
    """Time budget and throttled progress reports."""

    def __init__(self, budget: float | None, progress: Progress | None, total: int) -> None:
        self.start = time.monotonic()
        self.budget = budget
        self.progress = progress
        self.total = max(total, 1)
        self.done = 0
        self._last = -math.inf
        self._stage = ""

    def over(self) -> bool:
        return self.budget is not None and time.monotonic() - self.start > self.budget

    def tick(self, stage: str, units: int = 1) -> None:
        self.done += units
        self.report(stage)

    def report(self, stage: str, force: bool = False) -> None:
        if self.progress is None:
            return
        now = time.monotonic()
        if force or stage != self._stage or now - self._last >= _PROGRESS_EVERY_S:
            self._last, self._stage = now, stage
            self.progress(min(1.0, self.done / self.total), stage)

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def lower_bound(f: Fn, input_shape: tuple[int, ...], norm: str = "2", restarts: int = 4,
                steps: int = 50, seed: int = 0, time_budget: float | None = None,
                progress: Progress | None = None, **options: Any) -> SearchResult:
    """Best `||J_f(X)||_norm` (or pair ratio, `form="pairs"`) found by gradient ascent.

    `f` maps a tensor of `input_shape` to a tensor. `options` are further `SearchConfig`
    fields (scales, lr, form, dtype, ...). Deterministic for a given seed unless the time
    budget cuts the search short (`stopped_early`).
    """
    cfg = SearchConfig(norm=check_norm(norm), restarts=restarts, steps=steps, seed=seed,
                       time_budget_s=time_budget, **options)
    shape = tuple(int(s) for s in input_shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"input_shape must be positive sizes, got {tuple(input_shape)}")
    return search(f, shape, cfg, progress)


def search(f: Fn, shape: tuple[int, ...], cfg: SearchConfig,
           progress: Progress | None = None) -> SearchResult:
    clock = _Clock(cfg.time_budget_s, progress, cfg.restarts * (cfg.steps + 1) + 1)
    gen = torch.Generator().manual_seed(cfg.seed)
    state = _Best()
    history: list[float] = []
    per_restart: list[float] = []
    stopped = False
    start = (_structured_start(f, shape, cfg, clock)
             if cfg.structured and cfg.form == "jacobian" else None)
    for k in range(cfg.restarts):
        if k > 0 and clock.over():
            stopped = True
            break
        if k == 0 and start is not None:
            x0, scale, row = start.x, start.scale, start.row
        else:
            scale = cfg.scales[k % len(cfg.scales)]
            x0, row = project(_randn(shape, gen, cfg.dtype) * scale, cfg.radius), None  # (shape)
        if cfg.form == "pairs":
            stopped = _ascend_pairs(f, x0, scale, k, cfg, gen, state, history, clock)
        else:
            stopped = _ascend_jacobian(f, x0, scale, k, cfg, gen, state, history, clock, row)
        per_restart.append(state.restart_best)
        if stopped:
            break
    if state.x is None:
        raise ValueError("the search evaluated no finite value: the model returned NaN/inf "
                           "at every input tried; check the model or lower the input scales")
    clock.report("final evaluation", force=True)
    final: JacobianNorm | None = None
    value = state.value
    if cfg.form == "jacobian" and not clock.over():
        # Optional for soundness (the ascent values are realised at the witness too), so a
        # spent time budget skips it.
        final = _final_eval(f, state, cfg, gen)
        if math.isfinite(final.value) and final.value > value:
            value = final.value
            history.append(value)
    clock.tick("done")
    clock.report("done", force=True)
    return SearchResult(value=value, witness=state.x, seed=cfg.seed, history=history,
                        norm=cfg.norm, form=cfg.form, pair=state.y, scale=state.scale,
                        restart=state.restart, evaluations=len(history),
                        stopped_early=stopped, elapsed_s=clock.elapsed(), final=final,
                        values_by_restart=per_restart)


@dataclass
class _Best:
    value: float = -math.inf
    x: Tensor | None = None
    y: Tensor | None = None
    v: Tensor | None = None  # 2-norm: the direction that realised value
    row: int | None = None  # inf-norm: the row that realised value
    scale: float = 1.0
    restart: int = 0
    restart_best: float = -math.inf

    def offer(self, value: float, x: Tensor, k: int, scale: float, *, y: Tensor | None = None,
              v: Tensor | None = None, row: int | None = None) -> None:
        self.restart_best = max(self.restart_best, value)
        if value > self.value:
            self.value, self.x, self.y, self.v, self.row = value, x.clone(), y, v, row
            self.scale, self.restart = scale, k


def _randn(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> Tensor:
    # Drawn in float64 so float32 and float64 runs with one seed start from the same points.
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def _unit(v: Tensor) -> Tensor:
    n = v.norm()
    return v / n if n > 0 else v


def _ascend_jacobian(f: Fn, x0: Tensor, scale: float, k: int, cfg: SearchConfig,
                     gen: torch.Generator, best: _Best, history: list[float],
                     clock: _Clock, row: int | None = None) -> bool:
    """One restart of ascent on the Jacobian norm; True when the time budget ran out. `row`
    (inf-norm): the row to ascend, else the best of random candidates at x0."""
    best.restart_best = -math.inf
    stage = f"restart {k + 1}/{cfg.restarts}"
    x = x0.clone().requires_grad_(True)
    opt = torch.optim.Adam([x], lr=cfg.lr * scale)
    v = _unit(_randn(x0.shape, gen, cfg.dtype))  # 2-norm direction, warm-started per step
    if row is None:
        row = _pick_row(f, x0, cfg, gen) if cfg.norm == "inf" else -1
    for step in range(cfg.steps + 1):
        if clock.over() and (step > 0 or best.x is not None):
            return True
        opt.zero_grad(set_to_none=True)
        with differentiable_attention():
            if cfg.norm == "2":
                # One dual forward gives y and J v; two backward passes give the ascent
                # gradient and J^T J v (the next power-iteration direction).
                dual = torch.func.jvp(f, (x,), (v,))
                y, jv = dual[0], dual[1]  # f(x), J v: f's output shape
                obj = jv.norm()
                grad = _grad(obj, x, retain_graph=True)
                gram = _grad(y, x, grad_outputs=jv.detach())  # J^T J v
                value = float(obj.detach())
                ok = math.isfinite(value) and bool(torch.isfinite(grad).all())
                if ok:
                    best.offer(value, x.detach(), k, scale, v=v)
                    if gram.norm() > 0 and torch.isfinite(gram).all():
                        v = _unit(gram.detach())
            else:
                y = f(x)
                g = _grad(y.reshape(-1)[row], x, create_graph=True)
                obj = g.abs().sum()  # |row r of J|_1
                grad = _grad(obj, x)
                value = float(obj.detach())
                ok = math.isfinite(value) and bool(torch.isfinite(grad).all())
                if ok:
                    best.offer(value, x.detach(), k, scale, row=row)
        history.append(best.value)
        clock.tick(stage)
        if not ok:
            # NaN/inf (e.g. an unbounded map at huge inputs): this restart is finished.
            clock.tick(stage, cfg.steps - step)
            return False
        if step == cfg.steps:
            break
        x.grad = -grad  # ascent
        opt.step()
        _project_(x, cfg.radius)
    return False


def _ascend_pairs(f: Fn, x0: Tensor, scale: float, k: int, cfg: SearchConfig,
                  gen: torch.Generator, best: _Best, history: list[float],
                  clock: _Clock) -> bool:
    """One restart of ascent on `||f(X) - f(X + delta)|| / ||delta||`."""
    best.restart_best = -math.inf
    stage = f"restart {k + 1}/{cfg.restarts}"
    x = x0.clone().requires_grad_(True)
    d = (_randn(x0.shape, gen, cfg.dtype) * (scale * cfg.pair_spread)).requires_grad_(True)
    floor = cfg.pair_floor * scale
    opt = torch.optim.Adam([x, d], lr=cfg.lr * scale)
    for step in range(cfg.steps + 1):
        if clock.over() and (step > 0 or best.x is not None):
            return True
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            dn = _pnorm(d, cfg.norm)
            if dn < floor:  # rounding in f(X) - f(Y) would dominate a tinier step
                d.mul_(floor / max(float(dn), 1e-300))
                if float(_pnorm(d, cfg.norm)) == 0:
                    d.copy_(_randn(x0.shape, gen, cfg.dtype) * floor)
                d.copy_(project(x + d, cfg.radius) - x)
        with differentiable_attention():
            ratio = _pnorm(f(x + d) - f(x), cfg.norm) / _pnorm(d, cfg.norm)
        gx, gd = _grad(ratio, x, retain_graph=True), _grad(ratio, d)
        value = float(ratio.detach())
        ok = math.isfinite(value) and bool(torch.isfinite(gx).all() and torch.isfinite(gd).all())
        if ok:
            best.offer(value, x.detach(), k, scale, y=(x + d).detach().clone())
        history.append(best.value)
        clock.tick(stage)
        if not ok:
            clock.tick(stage, cfg.steps - step)
            return False
        if step == cfg.steps:
            break
        x.grad, d.grad = -gx, -gd
        opt.step()
        _project_(x, cfg.radius)
        with torch.no_grad():
            d.copy_(project(x + d, cfg.radius) - x)  # Y stays in the domain too
    return False


@dataclass(frozen=True)
class _Start:
    x: Tensor
    scale: float
    row: int | None
    value: float


def structured_inputs(shape: tuple[int, ...], t: float, direction: Tensor) -> list[Tensor]:
    """The structured inputs at scale t: token 0 at the origin, the others at `t u`
    alternating in sign ("split") or all at `t u` ("cluster"); `direction` u is one token's
    shape. Inputs of one token (or no token axis) give the single input `t u`."""
    if len(shape) < 2 or shape[0] < 2:
        return [(direction * t).expand(shape).clone()]
    n = shape[0]
    signs = torch.tensor([0.0] + [1.0 if i % 2 else -1.0 for i in range(1, n)],
                         dtype=direction.dtype)  # (N,)
    ones = torch.tensor([0.0] + [1.0] * (n - 1), dtype=direction.dtype)  # (N,)
    shape_tail = (n,) + (1,) * (len(shape) - 1)
    return [signs.reshape(shape_tail) * direction * t, ones.reshape(shape_tail) * direction * t]


def _structured_start(f: Fn, shape: tuple[int, ...], cfg: SearchConfig,
                      clock: _Clock) -> _Start | None:
    """The best structured input (by one cheap Jacobian evaluation each), projected into the
    domain; None when none evaluates to a finite value. Seeded apart from the random restarts,
    so they start where they would without it."""
    gen = torch.Generator().manual_seed(cfg.seed + 7919)
    u = _unit(_randn(shape[1:] if len(shape) >= 2 else shape, gen, cfg.dtype))  # one token
    best: _Start | None = None
    for t in cfg.structured_scales:
        if clock.over() and best is not None:
            break
        for x in structured_inputs(shape, t, u):
            x = project(x.to(cfg.dtype), cfg.radius)  # (shape)
            value, row = _score(f, x, cfg, gen)
            if math.isfinite(value) and (best is None or value > best.value):
                best = _Start(x, t, row, value)
    return best


def _score(f: Fn, x: Tensor, cfg: SearchConfig, gen: torch.Generator) -> tuple[float, int | None]:
    """A cheap Jacobian norm at x: a few Lanczos steps (2-norm), or the rows of token 0 (the
    one apart from the rest) plus random candidates (inf-norm)."""
    try:
        if cfg.norm == "2":
            return jacobian_norm(f, x, "2", max_iter=4, seed=cfg.seed).value, None
        with torch.no_grad():
            m = f(x).numel()
        half = max(1, cfg.row_candidates // 2)
        rows = None if m <= cfg.row_candidates else torch.unique(torch.cat([
            torch.arange(min(half, m)), torch.randperm(m, generator=gen)[:half]]))
        res = inf_norm_rows(f, x, rows)
        return res.value, res.row
    except (RuntimeError, ValueError):  # a map that fails at this input: no start here
        return -math.inf, None


def _grad(out: Tensor, x: Tensor, grad_outputs: Tensor | None = None,
          retain_graph: bool = False, create_graph: bool = False) -> Tensor:
    """d out / d x, zero where out does not depend on x (a linear map's Jacobian is
    constant, so its norm has no gradient)."""
    if not out.requires_grad:
        return torch.zeros_like(x)
    (g,) = torch.autograd.grad(out, x, grad_outputs=grad_outputs,
                               retain_graph=retain_graph or create_graph,
                               create_graph=create_graph, allow_unused=True)
    return torch.zeros_like(x) if g is None else g


def project(x: Tensor, radius: float | None) -> Tensor:
    """Scale down every token (last-axis row) whose 2-norm exceeds radius."""
    if radius is None:
        return x
    norms = x.norm(dim=-1, keepdim=True)  # (..., N, 1)
    factor = torch.where(norms > radius, radius / norms.clamp_min(1e-300),
                         torch.ones_like(norms))
    return x * factor


def _project_(x: Tensor, radius: float | None) -> None:
    if radius is not None:
        with torch.no_grad():
            x.copy_(project(x, radius))


def _pnorm(t: Tensor, norm: Norm) -> Tensor:
    return t.norm() if norm == "2" else t.abs().max()


def _pick_row(f: Fn, x: Tensor, cfg: SearchConfig, gen: torch.Generator) -> int:
    """The largest-sum row of J(x) among candidates (all rows if there are few)."""
    with torch.no_grad():
        m = f(x).numel()
    if m <= cfg.row_candidates:
        rows = None
    else:
        rows = torch.randperm(m, generator=gen)[: cfg.row_candidates]
    r = inf_norm_rows(f, x, rows).row
    return 0 if r is None else r


def _final_eval(f: Fn, best: _Best, cfg: SearchConfig, gen: torch.Generator) -> JacobianNorm:
    """A careful evaluation at the witness: Lanczos to `tol` (2-norm), or all rows / many rows
    (inf-norm). Either is realised at the witness, so `max(ascent value, this)` is sound."""
    assert best.x is not None
    x = best.x
    if cfg.norm == "2":
        return jacobian_norm(f, x, "2", tol=cfg.tol, max_iter=cfg.max_iter, v0=best.v,
                             seed=cfg.seed)
    with torch.no_grad():
        y = f(x)
    m = y.numel()
    if m <= cfg.full_eval_limit:
        return inf_norm_rows(f, x, None)
    r = best.row if best.row is not None else 0
    width = y.shape[-1] if y.dim() >= 2 else 1
    first = r - r % width
    token_rows = torch.arange(first, first + min(width, cfg.row_candidates))  # r's token
    extra = torch.randperm(m, generator=gen)[: cfg.row_candidates]
    rows = torch.unique(torch.cat([torch.tensor([r]), token_rows, extra]))
    return inf_norm_rows(f, x, rows)


__all__ = [
    "Form",
    "Progress",
    "SearchConfig",
    "SearchResult",
    "lower_bound",
    "project",
    "search",
    "structured_inputs",
]
