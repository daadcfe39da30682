"""The certification routes in one place: each one's name, the balls and cases it applies
to, what it costs, what it returns and its callable, in the order the tasks try them.
`certify_local` (routes/certify.py), the radius search of `robustness` (routes/certify.py,
routes/radius_search.py) and `decide` (routes/at_radius.py) read these tables; every route's number
is sound on its own, the best one stands (the order is one of time only).

  local constant (the smallest stands): global, enclosure, adjoint, tangent;
  certified radius (the largest stands): affine, affine-quad, affine-eig (walks of the affine
  forms: `robustness` searches over radii with them, `decide` walks once at its radius),
  then sweep and sweep-adjoint (the radius sweep without and with the adjoint graph's
  constants, routes/sweep.py).

A route that does not apply raises (or passes on) one of routes/errors.py's NOT_APPLICABLE: its
callers then keep the other routes' numbers; any other exception propagates.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lsa_models.engine.drivers.jacobian import LocalJacobian, local_jacobian
from lsa_models.engine.drivers.margins import margin_lower_bounds
from lsa_models.engine.routes.budget import Budget
from lsa_models.engine.routes.constant import (
    ADJOINT_MAX_ROWS,
    ADJOINT_METHOD,
    METHOD,
    TANGENT_GAIN,
    TANGENT_MAX_INPUT,
    TANGENT_METHOD,
    adjoint_bound,
    global_bound,
    has_attention,
    tangent_bound,
    use_quad,
)
from lsa_models.engine.routes.sweep import ADJOINT_NORMS, _sweep
from lsa_models.onnx.loading import OnnxModel

BOTH: tuple[str, ...] = ("2", "inf")


@dataclass(frozen=True)
class Route:
    """One certification route."""

    name: str  # as the golden bench names it (bench/golden/routes.py)
    label: str  # as the reports name it (a method line, a verdict's `certified_by`)
    norms: tuple[str, ...]  # the balls it applies on
    when: str  # where else it applies, in words
    cost: str  # its time, in words
    returns: str  # what `run` returns, in words
    run: Callable[..., Any]
    options: Mapping[str, Any] = field(default_factory=dict)  # keyword arguments of `run`
    # its time over the route before it in its table: a time budget's prediction of it
    # from the last one's (the affine stages)
    time_factor: float = 1.0

    def __call__(self, *args: Any, **kw: Any) -> Any:
        return self.run(*args, **self.options, **kw)


LOCAL_ROUTES: tuple[Route, ...] = (
    Route("global", "global per-layer rules on the tokens the ball reaches", BOTH,
          "always (a graph the global analysis refuses: no number, a reason)",
          "one pass over the layer graph", "a BoundResult (upper or None, per-layer factors)",
          global_bound),
    Route("enclosure", METHOD, BOTH,
          "inputs whose Jacobian enclosure fits the engine's size limits (LocalNotCertified "
          "otherwise, or where the ball is too wide)",
          "one engine run (the most of the four)", "a LocalJacobian: upper() and per-layer "
          "factors", local_jacobian),
    Route("adjoint", ADJOINT_METHOD, ("inf",),
          f"eps > 0, at most {TANGENT_MAX_INPUT} input and {ADJOINT_MAX_ROWS} output "
          f"entries, while the best number so far exceeds {TANGENT_GAIN} x the centre's "
          "Jacobian norm", "about one engine run", "a float or None", adjoint_bound),
    Route("tangent", TANGENT_METHOD, ("inf",),
          f"eps > 0, at most {TANGENT_MAX_INPUT} input entries, while the best number so "
          f"far exceeds {TANGENT_GAIN} x the centre's Jacobian norm",
          "about one engine run", "a float or None", tangent_bound),
)

# the affine stages' walk times: a second-order walk over a plain one, an eigenvalue walk
# over a second-order one (a time budget's predictions of the next stage only)
QUAD_WALK_COST, EIG_WALK_COST = 4.0, 3.5
# the second stage, with second-order symbols (affine.QUAD), on these balls for graphs with
# attention (products of two input-dependent tensors): on the 2-ball their coefficients' l1
# sum is far above the quadratic forms' eigenvalue bound the plain walk uses (a margin bound
# of -10 against +0.001 near the radius), and an MLP (no such products) gains nothing
QUAD_NORMS: tuple[str, ...] = ("inf", "2")
# the third on these balls: the second-order walks with the symbols' sizes by the quadratic
# forms' eigenvalues (affine.QUAD_EIG)
EIG_NORMS: tuple[str, ...] = ("2",)
_LOWER = "margin lower bounds {j: m_j} on the ball, or None (positive: certified)"

AFFINE_STAGES: tuple[Route, ...] = (
    Route("affine", "affine", BOTH, "always", "one plain affine walk", _LOWER,
          margin_lower_bounds),
    Route("affine-quad", "affine (second order)", QUAD_NORMS,
          "graphs with attention whose widest form with second-order symbols fits "
          "(constant.use_quad)", f"{QUAD_WALK_COST} plain walks", _LOWER,
          margin_lower_bounds, {"quad": True}, QUAD_WALK_COST),
    Route("affine-eig", "affine (eigenvalues)", EIG_NORMS, "where affine-quad applies",
          f"{EIG_WALK_COST} second-order walks", _LOWER, margin_lower_bounds,
          {"quad": True, "eig": True}, EIG_WALK_COST),
)

# a plain walk's seconds per entry of the graph's tensors per input entry (the walk carries
# one symbol per input entry through every tensor): the prediction of a walk on a graph no
# walk was timed on (a time budget's only; 1.4-2.8e-6 s wall, 0.7-1.8e-6 s CPU on the
# digits ViTs on a loaded 2-core machine; the forward pass's time predicts it worse: the
# walk's cost per node differs far more than the forward's between operators)
WALK_ENTRY_S = 2e-6

# a sweep run on a ball of positive radius over a plain walk (16-20 on the digits ViTs): a
# time budget's prediction of the sweep's runs before one is timed
SWEEP_RUN_COST = 16.0

# the last plain walk's seconds on a graph (held with it, so its id is not reused): a set's
# next input predicts its walks from it under a time budget
_PLAIN_WALK_S: dict[int, tuple[OnnxModel, float]] = {}
_PLAIN_WALK_LOCK = threading.Lock()


def plain_walk_seconds(om: OnnxModel, x: np.ndarray) -> float:
    """The predicted seconds of a plain affine walk at x: the last one timed on this graph,
    else `walk_estimate`."""
    hit = _PLAIN_WALK_S.get(id(om))
    if hit is not None and hit[0] is om:
        return hit[1]
    return walk_estimate(om, x)


def walk_estimate(om: OnnxModel, x: np.ndarray) -> float:
    """A plain walk's seconds before any was timed: WALK_ENTRY_S times the entries of the
    graph's computed tensors at x (one forward pass) times the entries of x."""
    out = om.module.with_dtype(torch.float64)
    consts = out.consts
    with torch.no_grad():
        env = out.run_env(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64)))
    entries = sum(v.numel() for k, v in env.items()
                  if k not in consts and isinstance(v, torch.Tensor) and v.is_floating_point())
    return WALK_ENTRY_S * entries * x.size


def timed_plain_walk(om: OnnxModel, seconds: float) -> None:
    """A plain walk on `om` took `seconds`: the prediction of the next one (one graph at a
    time: a set's)."""
    with _PLAIN_WALK_LOCK:
        _PLAIN_WALK_S.clear()
        _PLAIN_WALK_S[id(om)] = (om, seconds)


_RADIUS = "(the certified radius, engine runs, the margin constants at its last piece)"
SWEEP_PASSES: tuple[Route, ...] = (
    Route("sweep", "sweep", BOTH,
          "a correctly classified centre, below the first-order radius; with the adjoint "
          "graph's constants on its balls (ADJOINT_NORMS) where the graph has no attention",
          "up to `steps` engine runs", _RADIUS, _sweep),
    Route("sweep-adjoint", "sweep", ADJOINT_NORMS,
          "graphs with attention, where the first pass stopped short and was not cut off "
          "by a radius certified otherwise", "up to `steps` engine runs", _RADIUS, _sweep),
)


def second_order(om: OnnxModel, x: np.ndarray, norm: str) -> bool:
    """Whether the affine-quad stage applies: on its balls, for graphs where second-order
    symbols pay and fit (`use_quad`)."""
    return norm in AFFINE_STAGES[1].norms and use_quad(om, x)


def affine_stages(om: OnnxModel, x: np.ndarray, norm: str) -> list[Route]:
    """The affine stages that apply here, cheapest first."""
    plain, quad, eig = AFFINE_STAGES
    if not second_order(om, x, norm):
        return [plain]
    return [plain, quad, eig] if norm in eig.norms else [plain, quad]


def graph_candidates(om: OnnxModel, x: np.ndarray, eps: float, norm: str,
                     engine: LocalJacobian | None, candidates: list[float]) -> str:
    """Adds the adjoint graph's bound, then the tangent graph's, to `candidates`, each only
    where the best bound so far leaves more than TANGENT_GAIN over the centre's own norm
    (neither is ever below it; each costs about one engine run); the method string names the
    one that gave the smallest. Neither dominates: the adjoint graph's products compound with
    depth, the tangent graph's pair symbols are looser on one block."""
    def loose() -> bool:
        return engine is None or bool(candidates) and \
            min(candidates) > TANGENT_GAIN * engine.center_norm()
    method = METHOD
    for route in LOCAL_ROUTES[2:]:
        if not loose():
            break
        v = route(om, x, eps, norm)
        if v is not None:
            if not candidates or v < min(candidates):
                method = METHOD + "; " + route.label
            candidates.append(v)
    return method


def sweep_passes(om: OnnxModel, x: np.ndarray, norm: str, label: int,
                 margins: dict[int, float], steps: int, floor: float, cap: float,
                 budget: Budget, again: Callable[[float], float | None],
                 progress: Callable[[str, float], None] | None = None
                 ) -> tuple[float, int, dict[int, float]]:
    """The radius sweep's passes (SWEEP_PASSES): the first from `floor` (with the adjoint
    graph's constants from the start on attention-free graphs: cheap there), then, on
    ADJOINT_NORMS for graphs with attention, the sweep again with the adjoint graph's
    constants where `again(first radius)` gives its floor (None: not needed) and the first
    was not cut off by `floor` (a choice of time: where another route wins, the adjoint's
    sweep would walk 10 runs to stay below it; on an MLP it adds about 1% of radius).
    (the larger radius with its constants, the runs of both)."""
    first, second = SWEEP_PASSES
    if budget.timed:
        budget.sweep_run = SWEEP_RUN_COST * plain_walk_seconds(om, x)
    one = norm in second.norms and not has_attention(om)
    cut: list[bool] = []
    best, runs, consts = first(om, x, norm, label, margins, steps, progress, floor,
                               adjoint=one, cap=cap, cut=cut, budget=budget)
    if norm in second.norms and not one and not cut:
        floor2 = again(best)
        if floor2 is not None and not budget.out("the adjoint graph's sweep"):
            best2, runs2, consts2 = second(om, x, norm, label, margins, steps, None, floor2,
                                           cap=cap, budget=budget)
            runs += runs2
            if best2 > best:
                best, consts = best2, consts2
    return best, runs, consts
