"""Robustness at a given radius: for each (input, label), is every point of the ball of radius
r around the input classified as the label? The decision a CI gate or a certified-accuracy
table needs (docs/local-robustness.md, "Certified accuracy at a radius"): cheaper than the
radius search of `local.robustness`, which brackets the largest radius.

Per input, each step only where the ones before decided nothing (the order, cheapest
first, is in `decide`):
  misclassified: some margin f_label - f_j is not positive at the centre itself;
  certified:     the affine forms' margin lower bounds are positive on the whole ball
                 (plain walk, then with second-order symbols, then with the 2-ball's
                 eigenvalue sizes: routes.AFFINE_STAGES, the stages `robustness` searches
                 with), or else the radius sweep's passes (routes.sweep_passes: margin
                 constants integrated along the segment) reach r;
  attacked:      PGD found a point of the ball whose largest output is not the label (the
                 point is returned: a counterexample, checked in float64);
  unknown:       neither (`reason` says why: the time budget, if one was given and ran out
                 first, or no route reached a verdict).
With a time budget (routes/budget.py) the attack runs first (a flip is answered at once), a step
predicted to overrun what is left is not started, and the steps stop once it is spent; a
verdict reached is the one reached without it (a flip is a point of the ball, a certificate
holds on all of it: never both), and an unknown one names the step it skipped and why. Both
certified routes are the ones `robustness` reports radii with, so a certified verdict at r is
exactly as sound as a certified radius >= r.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from lsa_models.empirical.local import attack_at
from lsa_models.engine.drivers.centre import Centre, center_sha256, check_center
from lsa_models.engine.routes import table as routes
from lsa_models.engine.routes.budget import Budget, check_time_budget
from lsa_models.engine.routes.certify import GraphAt, as_onnx, centre_margins
from lsa_models.engine.routes.errors import NOT_APPLICABLE
from lsa_models.engine.routes.radius_search import first_order_radius
from lsa_models.engine.routes.sweep import SWEEP_CAP_TOL
from lsa_models.engine.routes.table import Route
from lsa_models.onnx.loading import OnnxModel

Status = Literal["certified", "attacked", "unknown", "misclassified"]
STATUSES: tuple[Status, ...] = ("certified", "attacked", "unknown", "misclassified")

# engine runs the sweep may take per input (local.robustness's default)
SWEEP_STEPS = 30


@dataclass(frozen=True)
class Verdict:
    """What is known about one input at the radius."""

    label: int
    predicted: int
    status: Status
    # the route that certified: "affine", "affine (second order)", "affine (eigenvalues)",
    # "sweep"; None unless certified
    certified_by: str | None
    # the smallest margin lower bound of the last affine walk (> 0: certified by it)
    margin_lower: float | None
    # attacked: the counterexample's distance from the centre (<= radius) and its class
    flip_distance: float | None
    flip_class: int | None
    center_sha256: str
    walks: int  # affine walks
    sweep_runs: int  # engine runs of the sweep
    seconds: float
    flip: np.ndarray | None = field(default=None, repr=False, compare=False)
    # unknown: why (the budget that ran out, or what no route reached); None otherwise
    reason: str | None = None
    stopped_by_budget: bool = False  # unknown because the time budget ran out
    # the step the budget kept from running (its reason: spent, or predicted not to fit)
    stopped_before: str | None = None
    # unknown: the largest radius proven robust on the way (the sweep's; 0: none)
    proven_radius: float | None = None


def _affine(om: OnnxModel, x: np.ndarray, norm: str, label: int, radius: float, ctr: Centre,
            stages: list[Route], budget: Budget) -> tuple[str | None, float | None, int]:
    """(the stage that certified or None, the last smallest margin lower bound, walks); the
    budget looked at before each walk, with the walk's predicted time (routes/table.py)."""
    low_min: float | None = None
    walks = 0
    if stages and not stages[0].options and budget.timed:
        # the plain walk's time on this graph before (a set's earlier input), else its
        # size-based estimate
        budget.last = routes.plain_walk_seconds(om, x)
    for stage in stages:
        # its time predicted from the last walk's
        if budget.out(f"the {stage.label} walk", budget.last * stage.time_factor):
            break
        walks += 1
        began = budget.clock()
        try:
            low = stage(om, x, radius, norm, label, ctr)
        except NOT_APPLICABLE:
            low = None
        budget.lap(began)
        if not stage.options:
            routes.timed_plain_walk(om, budget.last)
        if not low:
            continue
        v = min(low.values())
        low_min = v if math.isfinite(v) else None
        if low_min is not None and low_min > 0:
            return stage.label, low_min, walks
    return None, low_min, walks


def _attack(f64: torch.nn.Module, x: np.ndarray, label: int, norm: str, radius: float,
            first: int, restarts: int, seed: int, budget: Budget
            ) -> tuple[np.ndarray, float, int] | None:
    """A flip the attack found in the ball (`_within`): its runs from the centre (first 0)
    or its random restarts (first 1); None where none was, or the budget kept it from
    running."""
    if budget.out("the attack" if first == 0 else "the attack's restarts"):
        return None
    flip = attack_at(f64, x, label, norm, radius, restarts=1 if first == 0 else restarts,
                     seed=seed, first=first)
    return None if flip is None else _within(flip, x, radius, norm, f64, label)


def _within(flip: np.ndarray, x: np.ndarray, radius: float, norm: str,
            f64: torch.nn.Module, label: int) -> tuple[np.ndarray, float, int] | None:
    """(the point, its distance, the class) when `flip` lies in the ball and some class's
    output (float64) exceeds the label's there; a point the projection's rounding left just
    outside is pulled in once."""
    d = flip - x
    for _ in range(2):
        dist = float(np.abs(d).max()) if norm == "inf" else float(np.linalg.norm(d))
        if dist <= radius:
            point = x + d
            with torch.no_grad():
                y = f64(torch.from_numpy(point)).reshape(-1).numpy()
            others = y.copy()
            others[label] = -np.inf
            j = int(np.argmax(others))
            return (point, dist, j) if y[j] > y[label] else None
        d = d * (radius / dist) * (1 - 1e-12)
    return None


def _sweep_reach(f64: torch.nn.Module, x: np.ndarray, label: int, margins: dict[int, float],
                 norm: str) -> float:
    """A radius the sweep cannot pass: its constants L_j(rho) bound the margins' gradients on
    balls that contain X0, so L_j(rho) >= ||grad m_j(X0)||_dual and its sum up to rho is at
    least rho ||grad m_j(X0)||_dual: it stops below min_j m_j / ||grad m_j(X0)||_dual (the
    gradients by autograd, the quotient taken 1e-6 wider for their rounding; a choice of
    time only: a sweep not run certifies nothing)."""
    return first_order_radius(f64, x, label, margins, norm) * (1 + 1e-6)


def decide(model: Any, at: np.ndarray, label: int, norm: str, radius: float, *,
           attack_restarts: int = 3, seed: int = 0, sweep: bool = True,
           time_budget: float | None = None) -> Verdict:
    """The verdict for one input (module docstring). `time_budget`: seconds from the call
    (monotonic clock; None: none), looked at before each step, each affine walk (with its
    predicted time) and each of the sweep's runs (routes/budget.py): once spent, or where the next
    walk would overrun it, `unknown` with `stopped_by_budget`, `stopped_before`, the
    smallest margin lower bound of the last walk and the radius proven so far. ValueError
    for a bad input, label, norm, radius or budget."""
    if not (isinstance(radius, float | int) and math.isfinite(radius) and radius > 0):
        raise ValueError(f"radius must be finite and > 0, got {radius}")
    radius = float(radius)
    t0 = time.monotonic()
    budget = Budget.start(time_budget)
    om, x, f64, margins, predicted = centre_margins(model, at, label, norm)
    sha = center_sha256(x)

    def verdict(status: Status, **kw: Any) -> Verdict:
        base: dict[str, Any] = dict(certified_by=None, margin_lower=None, flip_distance=None,
                                    flip_class=None, walks=0, sweep_runs=0, flip=None)
        base.update(kw)
        return Verdict(label, predicted, status, center_sha256=sha,
                       seconds=time.monotonic() - t0, **base)

    if min(margins.values()) <= 0:
        return verdict("misclassified")
    # cheapest first: the plain walk, the attack's runs from the centre (where most flips
    # are found), the costlier walks, the attack's random restarts, then the sweep; under a
    # time budget the attack first (a flip answers at once, where a walk may not fit)
    ctr = Centre(om, x)
    stages = routes.affine_stages(om, x, norm)
    plan: tuple[int | list[Route], ...] = (0, 1, stages[:1], stages[1:]) if budget.timed \
        else (stages[:1], 0, stages[1:], 1)
    low: float | None = None
    walks = 0
    for step in plan:
        if isinstance(step, int):
            hit = _attack(f64, x, label, norm, radius, step, attack_restarts, seed, budget)
            if hit is not None:
                return verdict("attacked", margin_lower=low, walks=walks, flip=hit[0],
                               flip_distance=hit[1], flip_class=hit[2])
            continue
        by, low_part, w = _affine(om, x, norm, label, radius, ctr, step, budget)
        walks += w
        low = low if low_part is None else low_part
        if by is not None:
            return verdict("certified", certified_by=by, margin_lower=low, walks=walks)
    runs, best = 0, None
    beyond = not sweep or budget.stopped or radius >= _sweep_reach(f64, x, label, margins,
                                                                   norm)
    if not beyond and not budget.out("the radius sweep"):
        best, runs = _sweep_to(om, x, norm, label, margins, radius, budget)
        if best >= radius:
            return verdict("certified", certified_by="sweep", margin_lower=low, walks=walks,
                           sweep_runs=runs)
    return verdict("unknown", margin_lower=low, walks=walks, sweep_runs=runs,
                   reason=_unknown_reason(budget, sweep, best), stopped_by_budget=budget.stopped,
                   stopped_before=budget.stopped_before, proven_radius=best or 0.0)


def _sweep_to(om: OnnxModel, x: np.ndarray, norm: str, label: int, margins: dict[int, float],
              radius: float, budget: Budget) -> tuple[float, int]:
    """(the radius the sweep certified, its engine runs): the sweep's passes as in
    `robustness` (routes.sweep_passes), with the radius as their floor (the probe gives up
    where it cannot pass it) and, divided by 1 - SWEEP_CAP_TOL, as their cap (they stop once
    they reach the radius)."""
    best, runs, _ = routes.sweep_passes(om, x, norm, label, margins, SWEEP_STEPS, radius,
                                        radius / (1 - SWEEP_CAP_TOL), budget,
                                        lambda best: radius if best < radius else None)
    return best, runs


def _unknown_reason(budget: Budget, sweep: bool, best: float | None) -> str:
    """Why no verdict was reached, in words."""
    spent = budget.reason()
    if spent is not None:
        return spent
    if not sweep:
        return "neither the affine walks nor the attack decided it; the radius sweep was off"
    if best is None:
        return ("neither the affine walks nor the attack decided it; the radius is past the "
                "first-order radius, which the sweep cannot pass")
    return (f"no route decided it: the affine walks, the attack and the radius sweep "
            f"(certified to {best:.3g})")


@dataclass(frozen=True)
class SetReport:
    """Verdicts for a set of inputs at one radius. certified <= robust <= not attacked:
    `certified_accuracy` is a lower bound on the fraction of inputs robust at the radius,
    `attack_accuracy` (correct at the centre and no counterexample found) an upper bound."""

    norm: str
    radius: float
    verdicts: list[Verdict]
    seconds: float
    sweep: bool = True  # whether the radius sweep was tried (decide's step 4)
    time_budget: float | None = None  # each input's (seconds; None: none)

    def count(self, status: Status) -> int:
        return sum(v.status == status for v in self.verdicts)

    @property
    def clean_accuracy(self) -> float:
        return 1.0 - self.count("misclassified") / max(1, len(self.verdicts))

    @property
    def certified_accuracy(self) -> float:
        return self.count("certified") / max(1, len(self.verdicts))

    @property
    def attack_accuracy(self) -> float:
        n = len(self.verdicts)
        return (n - self.count("misclassified") - self.count("attacked")) / max(1, n)


def decide_all(model: Any, inputs: np.ndarray, labels: np.ndarray, norm: str, radius: float,
               progress: Callable[[int, int, Verdict], None] | None = None, *,
               seed: int = 0, sweep: bool = True,
               decided: Callable[[int, int], None] | None = None,
               time_budget: float | None = None) -> SetReport:
    """`decide` for every (inputs[i], labels[i]) (inputs: a stack along the first axis), one
    after the other in this process; `progress(i, n, verdict)` and `decided(i + 1, n)` after
    each. Each verdict is the one `decide` gives alone (the attack is seeded per input), so a
    caller may decide the inputs anywhere (the service's worker processes,
    service.robustness.set_pool) and gather them with `gather_set`. `time_budget`: each
    input's (decide's). ValueError for mismatched inputs and labels or a bad budget."""
    t0 = time.monotonic()
    check_time_budget(time_budget)  # before any input is decided
    om, jobs = prepare_set(model, inputs, labels)
    verdicts = (decide(om, x, y, norm, radius, seed=seed, sweep=sweep, time_budget=time_budget)
                for x, y in jobs)
    return gather_set(norm, radius, verdicts, len(jobs), t0, sweep, progress, decided,
                      time_budget)


def prepare_set(model: Any, inputs: np.ndarray, labels: np.ndarray
                ) -> tuple[OnnxModel, list[tuple[np.ndarray, int]]]:
    """The graph the set is decided on and its (input, label) pairs, every input and label
    checked first (a bad one late in a long set fails at once); ValueError naming it."""
    inputs = np.asarray(inputs)
    labels = np.asarray(labels)
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be integers (class indices), got dtype {labels.dtype}")
    if labels.ndim != 1 or inputs.ndim < 2 or inputs.shape[0] != labels.shape[0]:
        got = labels.shape[0] if labels.ndim == 1 else tuple(labels.shape)
        raise ValueError(f"labels must be one integer per input: {got} labels for inputs of "
                         f"shape {tuple(inputs.shape)} (the inputs stacked along the first "
                         "axis)")
    if labels.shape[0] == 0:
        raise ValueError("no inputs: give at least one")
    # once for the set: a native model is exported to ONNX by each conversion
    om = as_onnx(model, inputs.shape[-2])
    _check_set(om, inputs, labels)
    return om, [(inputs[i], int(labels[i])) for i in range(labels.shape[0])]


def gather_set(norm: str, radius: float, verdicts: Iterable[Verdict], n: int, t0: float,
               sweep: bool, progress: Callable[[int, int, Verdict], None] | None = None,
               decided: Callable[[int, int], None] | None = None,
               time_budget: float | None = None) -> SetReport:
    """The SetReport of `n` verdicts arriving in the inputs' order (started at monotonic time
    `t0`; `time_budget`: each input's); `progress(i, n, verdict)` and `decided(i + 1, n)` as
    each arrives."""
    out: list[Verdict] = []
    for i, v in enumerate(verdicts):
        out.append(v)
        if decided is not None:
            decided(i + 1, n)
        if progress is not None:
            progress(i, n, v)
    return SetReport(norm, float(radius), out, time.monotonic() - t0, sweep, time_budget)


def _check_set(om: OnnxModel, inputs: np.ndarray, labels: np.ndarray) -> None:
    """Every input and label checked before any is decided (a bad one late in a long set
    fails at once, not after the ones before it), ValueError naming its index."""
    for i in range(inputs.shape[0]):
        try:
            check_center(om, inputs[i])
        except ValueError as exc:
            raise ValueError(f"inputs[{i}]: {exc}") from None
    with torch.no_grad():
        k = int(GraphAt(om)(torch.from_numpy(check_center(om, inputs[0]))).numel())
    bad = np.flatnonzero((labels < 0) | (labels >= k))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"labels[{i}]: label must be in 0..{k - 1} (the model has {k} "
                         f"outputs), got {int(labels[i])}")
