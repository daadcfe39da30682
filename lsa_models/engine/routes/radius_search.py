"""The affine route's radius search (docs/local-robustness.md): the largest radius whose
affine margin lower bounds (driver.margin_lower_bounds) are all positive, by growth and
regula falsi, in the stages routes.AFFINE_STAGES lists; and the first-order radius the
searches start from.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from lsa_models.engine.drivers.centre import Centre
from lsa_models.engine.drivers.margins import margin_lower_bounds
from lsa_models.engine.routes.budget import Budget
from lsa_models.engine.routes.errors import NOT_APPLICABLE
from lsa_models.engine.routes.table import AFFINE_STAGES, plain_walk_seconds, timed_plain_walk
from lsa_models.onnx.loading import OnnxModel

# the affine route: the radius grows by AFFINE_GROWTH while certified, then bisection to a
# relative width of AFFINE_TOL; at most AFFINE_WALKS walks
AFFINE_GROWTH, AFFINE_TOL, AFFINE_WALKS = 2.0, 1e-3, 48


AFFINE_SHARE = 0.2  # of a radius job's progress: the affine walks are cheap


def _scaled_progress(progress: Callable[[str, float], None] | None, lo: float, hi: float
                     ) -> Callable[[str, float], None] | None:
    if progress is None:
        return None
    p = progress
    return lambda stage, f: p(stage, lo + (hi - lo) * f)


def affine_radius(om: OnnxModel, x: np.ndarray, norm: str, label: int, start: float,
                  progress: Callable[[str, float], None] | None = None, quad: bool = False,
                  floor: float = 0.0, growth: float = AFFINE_GROWTH,
                  tol: float = AFFINE_TOL, eig: bool = False, budget: Budget | None = None
                  ) -> tuple[float, int]:
    """The largest radius (to a relative `tol`) whose margin lower bounds from the affine forms
    are all positive, searched from `start` > 0; (radius, walks). A radius r certifies the
    whole ball of radius r, so no integration is needed: this route and the sweep are
    independent, the larger one stands. The search brackets the radius (growing or shrinking
    `start` by AFFINE_GROWTH), then narrows the bracket by regula falsi on the smallest lower
    bound (Illinois' variant, each step kept inside the bracket's middle 90%; bisection where
    a walk failed): the bound is smooth in the radius, so this takes fewer walks than
    bisection. Only radii whose walk certified are reported. `quad`: the walks with
    second-order symbols (affine.QUAD); `eig`: those walks with the symbols' 2-ball sizes by
    eigenvalues (affine.QUAD_EIG); `floor`: a radius certified already (another walk's),
    the bracket's low end when `start` does not certify (no search below it); `budget`:
    looked at before each walk but the first, the largest radius certified so far returned
    once it is spent."""
    ctr = Centre(om, x)
    walks = 0
    b = budget or Budget()
    more_walks = "more affine walks"

    def value(r: float) -> float:
        """min_j of the margins' lower bounds on the ball of radius r (-inf: no bound)."""
        nonlocal walks
        walks += 1
        began = b.clock()
        try:
            low = margin_lower_bounds(om, x, r, norm, label, ctr, quad=quad, eig=eig)
        except NOT_APPLICABLE:
            low = None
        b.lap(began)
        if not quad:
            timed_plain_walk(om, b.last)
        v = -math.inf if not low else min(low.values())
        if not math.isfinite(v):
            v = -math.inf
        if progress is not None:
            kind = ("second-order affine (eigenvalues)" if eig else "second-order affine") \
                if quad else "affine"
            progress(f"{kind} radius: tried {r:.3g}, {'certified' if v > 0 else 'not'}",
                     min(1.0, walks / AFFINE_WALKS))
        return v

    lo, flo, hi = 0.0, math.inf, start
    fhi = value(hi)
    while walks < AFFINE_WALKS and fhi > 0 and not b.out(more_walks, b.last):  # grow
        lo, flo, hi = hi, fhi, hi * growth
        fhi = value(hi)
    if fhi > 0:  # stopped while growing (the budget or the walks' cap): hi certified
        return hi, walks
    if lo == 0.0 and 0 < floor < hi:
        lo = floor  # certified by the caller's other walk: its bound is not known here
    if lo == 0.0:  # shrink until something certifies
        while walks < AFFINE_WALKS // 2 and not b.out(more_walks, b.last):
            r = hi / growth**2
            fr = value(r)
            if fr > 0:
                lo, flo = r, fr
                break
            hi, fhi = r, fr
        if lo == 0.0:
            return 0.0, walks
    return _regula_falsi(value, lo, flo, hi, fhi,
                         lambda: walks < AFFINE_WALKS and not b.out(more_walks, b.last), tol), \
        walks


def _regula_falsi(value: Callable[[float], float], lo: float, flo: float, hi: float,
                  fhi: float, more: Callable[[], bool], tol: float = AFFINE_TOL) -> float:
    """Narrows the bracket [lo, hi] (value(lo) = flo > 0 >= value(hi) = fhi) to a relative
    width `tol` by regula falsi (Illinois' variant: the end kept twice has its value
    halved; each step inside the bracket's middle 90%; bisection where a value is not
    finite) while `more()`; returns the certified end."""
    side = 0  # Illinois: which end was kept last (-1 lo, +1 hi)
    # (a bracket of exactly tol, as one growth step of the eigenvalue stage leaves it, EIG_GROWTH
    # = 1 + EIG_TOL, is narrow enough: without the slack its rounding decided whether one
    # more walk ran, and the same radius search ended 1.5% apart on two machines)
    while hi - lo > tol * lo * (1 + 1e-9) and more():
        width = hi - lo
        if math.isfinite(fhi) and math.isfinite(flo) and flo > fhi:
            r = hi - fhi * width / (fhi - flo)
            if side == -1 and r < lo + 0.05 * width:
                # the secant at the low clamp again after lo moved: the bound falls far
                # faster near hi than the line says (on a Transformer's 2-ball: -1e2 at 4x
                # the radius), and Illinois' halvings of fhi would take one walk each: the middle
                r = math.sqrt(lo * hi) if lo > 0 else lo + 0.5 * width
            r = min(max(r, lo + 0.05 * width), hi - 0.05 * width)
        else:
            r = lo + 0.5 * width
        fr = value(r)
        if fr > 0:
            lo, flo = r, fr
            if side == -1 and math.isfinite(fhi):
                fhi *= 0.5  # the far end kept twice: halve its value (Illinois)
            side = -1
        else:
            hi, fhi = r, fr
            if side == 1:
                flo *= 0.5
            side = 1
    return lo


AFFINE_START = 0.25  # of the first-order radius: where the affine search starts

# the affine route's second search (routes.AFFINE_STAGES' affine-quad) starts QUAD_GROWTH
# past the plain radius and steps by that factor
QUAD_GROWTH = 1.15
# its growth steps past that start per norm: on the inf-ball the second-order radius is
# about 1.2x the plain one on Transformer classifiers, so steps of 1.08 leave a bracket half
# as wide as 1.15's (one or two second-order walks fewer); on the 2-ball it is about 1.28x and
# 1.08 takes more steps
QUAD_STEP: dict[str, float] = {"inf": 1.08, "2": QUAD_GROWTH}
# the searches' relative tolerances where the second-order one follows: the plain one only
# gives it a start, and each of its walks costs 4 plain ones (4 walks fewer, the radius 0.3%
# lower at most)
QUAD_PLAIN_TOL, QUAD_TOL = 1e-2, 1e-2
# the third search (affine-eig: ~4x a second-order walk's time) from EIG_GROWTH past the
# second-order radius (5% more radius in two or three walks)
EIG_GROWTH = 1.05
EIG_TOL = 5e-2


def affine_route(om: OnnxModel, x: np.ndarray, norm: str, label: int, start: float,
                 quad: bool, progress: Callable[[str, float], None] | None = None,
                 budget: Budget | None = None) -> tuple[float, int]:
    """The affine route's radius and walks: the plain search from `start`, then with `quad`
    the second-order one from just past it and, on affine-eig's balls, the eigenvalue one (each
    stage's walks only, through `margin_lower_bounds`; bench/radius_search_replay.py runs
    this on recorded margins). Its progress fills the first AFFINE_SHARE of a radius job.
    `budget`: looked at before each stage and between walks, the first walk's time predicted
    (routes.plain_walk_seconds), each next one's from the last (the radius so far once it is
    spent or the next walk would overrun it)."""
    plain, second, third = AFFINE_STAGES
    b = budget or Budget()
    if b.out("the affine walks", plain_walk_seconds(om, x) if b.timed else 0.0):
        return 0.0, 0
    aff, walks = affine_radius(om, x, norm, label, max(start, 1e-12),
                               _scaled_progress(progress, 0.0, AFFINE_SHARE),
                               tol=QUAD_PLAIN_TOL if quad else AFFINE_TOL, budget=b,
                               **plain.options)
    if aff > 0 and quad and not b.out("the second-order affine walks",
                                      second.time_factor * b.last):
        # then the walks with second-order symbols, from just past it (4x a plain walk's
        # time; about 15% more radius on attention models)
        eig = norm in third.norms
        mid = AFFINE_SHARE * (0.75 if eig else 1.0)
        aq, wq = affine_radius(om, x, norm, label, aff * QUAD_GROWTH,
                               _scaled_progress(progress, AFFINE_SHARE / 2, mid),
                               floor=aff, growth=QUAD_STEP[norm], tol=QUAD_TOL, budget=b,
                               **second.options)
        aff, walks = max(aff, aq), walks + wq
        if aff > 0 and eig and not b.out("the eigenvalue affine walks",
                                         third.time_factor * b.last):
            # and those with the 2-ball's sizes by eigenvalues (~3.5x a second-order walk;
            # about 5% more radius)
            ae, we = affine_radius(om, x, norm, label, aff * EIG_GROWTH,
                                   _scaled_progress(progress, mid, AFFINE_SHARE),
                                   floor=aff, growth=EIG_GROWTH, tol=EIG_TOL, budget=b,
                                   **third.options)
            aff, walks = max(aff, ae), walks + we
    return aff, walks


def first_order_radius(f64: torch.nn.Module, x: np.ndarray, label: int,
                       margins: dict[int, float], norm: str) -> float:
    """min_j m_j / ||grad m_j(X0)||_dual, the gradients by autograd (inf where every
    gradient is 0)."""
    t = torch.from_numpy(x).requires_grad_(True)
    out = f64(t).reshape(-1)
    best = math.inf
    for j, m in margins.items():
        (g,) = torch.autograd.grad(out[label] - out[j], t, retain_graph=True)
        dual = float(g.abs().sum()) if norm == "inf" else float(g.norm())
        if dual > 0 and math.isfinite(dual):
            best = min(best, m / dual)
    return best


def _first_order_radius(f64: torch.nn.Module, x: np.ndarray, label: int,
                        margins: dict[int, float], norm: str) -> float:
    """`first_order_radius`, 1e-3 where it is not finite and positive (a starting guess
    only)."""
    best = first_order_radius(f64, x, label, margins, norm)
    return best if math.isfinite(best) and best > 0 else 1e-3
