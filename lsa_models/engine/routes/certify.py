"""The public local functions: `certify_local` (the Lipschitz constant on a ball around one
input) and `robustness` (certified and attack radii for one label), each the best of its
routes (routes/table.py).

Both take a loaded model: an ONNX graph (`OnnxModel`, or a `LoadedModel` from
`lsa_models.analysis.load_model_bytes`); a native model is exported to ONNX first (the same
lowering the service uses for downloads), so one engine bounds both.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lsa_models.bounds.report import BoundResult, LayerBound, NormName
from lsa_models.empirical.local import attack_radius
from lsa_models.engine.drivers.centre import center_sha256, check_center
from lsa_models.engine.drivers.jacobian import LocalJacobian
from lsa_models.engine.routes import table as routes
from lsa_models.engine.routes.budget import Budget
from lsa_models.engine.routes.constant import use_quad
from lsa_models.engine.routes.errors import NOT_APPLICABLE
from lsa_models.engine.routes.radius_search import (
    AFFINE_SHARE,
    AFFINE_START,
    _first_order_radius,
    _scaled_progress,
    affine_route,
)
from lsa_models.engine.routes.sweep import SWEEP_CAP_TOL
from lsa_models.onnx.export import export_onnx
from lsa_models.onnx.loading import OnnxModel, load_onnx


def as_onnx(model: Any, seq_len: int | None = None) -> OnnxModel:
    """The ONNX graph of a loaded model (native models are exported at `seq_len`)."""
    if isinstance(model, OnnxModel):
        return model
    onnx_model = getattr(model, "onnx", None)
    if isinstance(onnx_model, OnnxModel):
        return onnx_model
    module = getattr(model, "module", model)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"cannot bound a {type(model).__name__} locally")

    n = seq_len or getattr(model, "seq_len", None) or getattr(module, "default_seq_len", None)
    if n is None:
        raise ValueError("the sequence length of the input is unknown")
    with tempfile.TemporaryDirectory() as tmp:
        path = export_onnx(module, Path(tmp) / "model.onnx", int(n), dynamo=False)
        return load_onnx(path.read_bytes(), "model.onnx")


def _domain(x0: np.ndarray, eps: float, norm: str) -> dict[str, Any]:
    return {"kind": "ball", "norm": norm, "eps": eps, "center_sha256": center_sha256(x0)}


def certify_local(model: Any, at: np.ndarray, eps: float, norm: NormName) -> BoundResult:
    """Certified upper bound on sup ||J_F(X)||_norm over {X : ||X - at||_norm <= eps}
    (2: Frobenius of the whole input; inf: largest entry). `at` is one input (N, D) or
    (1, N, D). Returns a `BoundResult` whose `domain` describes the ball, `upper` the local
    constant (the best of the Jacobian enclosure and the global per-layer bound on the
    tokens the ball reaches), and per-layer factors with the rule that produced them.
    Raises ValueError for a bad input shape or eps."""
    if norm not in ("2", "inf"):
        raise ValueError(f"unknown norm {norm!r}; use '2' or 'inf'")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    om = as_onnx(model, np.asarray(at).shape[-2] if np.asarray(at).ndim >= 2 else None)
    x = check_center(om, at)
    glob_route, enclosure = routes.LOCAL_ROUTES[:2]
    glob = glob_route(om, norm, x, eps)
    layers = list(glob.layers)
    for lb in layers:
        lb.rule = lb.rule or f"global {lb.kind} rule on the tokens the ball reaches"
    engine: LocalJacobian | None = None
    reason = None
    try:
        # the value forms with second-order symbols where the graph has attention (2.5x the
        # time of a run, 10-25% tighter on larger balls)
        engine = enclosure(om, x, eps, norm, quad=use_quad(om, x))
    except NOT_APPLICABLE as exc:
        reason = f"local engine: {exc}"
    candidates = [] if glob.upper is None else [glob.upper]
    if engine is not None:
        candidates.append(engine.upper())
        by_name = {lb.name: lb for lb in layers}
        for name, kind, factor, rule in engine.layers:
            g = by_name.get(name)
            if g is not None:
                g.global_upper, g.upper, g.rule = g.upper, factor, rule
            else:
                layers.append(LayerBound(name, kind, factor, nodes=[name], rule=rule))
    method = routes.graph_candidates(om, x, eps, norm, engine, candidates)
    n = om.spec.seq_len or x.shape[-2]
    domain = _domain(x, eps, norm)
    if not candidates:
        return BoundResult(norm=norm, seq_len=n, radius=None, verdict="not_certified",
                           upper=None, layers=layers, method=method,
                           reason="; ".join(r for r in (reason, glob.reason) if r),
                           domain=domain)
    return BoundResult(norm=norm, seq_len=n, radius=None, verdict="certified",
                       upper=min(candidates), layers=layers, method=method, domain=domain)


# ---- robustness -----------------------------------------------------------------------------


@dataclass
class RobustnessResult:
    """certified_radius <= the true robustness radius <= attack_radius (when one is found)."""

    norm: str
    label: int
    predicted: int
    certified_radius: float
    attack_radius: float | None
    margins: dict[int, float]  # f_label - f_j at the centre
    center_sha256: str
    certify_seconds: float
    attack_seconds: float
    sweep_runs: int  # engine runs of the radius sweep
    pair_constants: dict[int, float] = field(default_factory=dict)  # at certified_radius
    # which route certified the radius: "sweep" (margin constants integrated along the
    # segment) or "affine" (margin lower bounds from the affine forms, affine/form.py)
    certified_by: str = "sweep"
    affine_radius: float = 0.0  # the affine route's radius (walks: affine_walks)
    affine_walks: int = 0
    # the search's time budget (seconds; None: none) and whether it stopped the search (the
    # radius is then the largest certified before it ran out: sound, maybe not the
    # largest); `stopped_before` names the stage it kept from running
    time_budget: float | None = None
    stopped_by_budget: bool = False
    stopped_before: str | None = None


class GraphAt(torch.nn.Module):
    """The graph in float64 on one input shaped as the graph's input (the module's forward
    reads the first axis of a graph without a batch axis, (N, D), as a batch: row by row)."""

    def __init__(self, om: OnnxModel) -> None:
        super().__init__()
        self.graph = om.module.with_dtype(torch.float64)
        self.out = om.spec.output_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: the graph input's shape
        return self.graph.run_env(x.to(torch.float64), stop=self.out)[self.out]


def centre_margins(model: Any, at: np.ndarray, label: int, norm: str
                   ) -> tuple[OnnxModel, np.ndarray, torch.nn.Module, dict[int, float], int]:
    """(the graph, the checked centre X0, the graph in float64 on one input (`GraphAt`: what
    the attack and the first-order radius differentiate), the margins f_label - f_j at X0
    less an allowance for the forward pass's rounding, the predicted class). ValueError for a
    bad norm, input or label."""
    if norm not in ("2", "inf"):
        raise ValueError(f"unknown norm {norm!r}; use '2' or 'inf'")
    om = as_onnx(model, np.asarray(at).shape[-2] if np.asarray(at).ndim >= 2 else None)
    x = check_center(om, at)
    f64 = GraphAt(om)
    with torch.no_grad():
        logits = f64(torch.from_numpy(x)).reshape(-1).numpy()
    k = logits.size
    if not (0 <= label < k):
        raise ValueError(f"label must be in 0..{k - 1} (the model has {k} outputs), got "
                         f"{label}")
    scale = float(np.abs(logits).max())
    margins = {j: float(logits[label] - logits[j]) - 1e-9 * (1 + scale)
               for j in range(k) if j != label}
    return om, x, f64, margins, int(np.argmax(logits))


def robustness(model: Any, at: np.ndarray, label: int, norm: NormName,
               steps: int = 30, attack_restarts: int = 3, seed: int = 0,
               progress: Callable[[str, float], None] | None = None,
               time_budget: float | None = None) -> RobustnessResult:
    """Certified robustness radius of `label` at `at` (a sweep of radii with per-pair margin
    constants on each ball, integrated along the segment) and the smallest label-flipping
    perturbation PGD finds. `steps` caps the engine runs; `progress(stage, fraction)` is
    called once per engine run with the radius certified so far (it may raise to stop).
    `time_budget`: seconds from the call (monotonic clock; None: none), looked at between
    the stages, the affine walks and the sweep's runs (routes/budget.py): once spent, the largest
    radius certified so far, with `stopped_by_budget`. ValueError for a bad input, label,
    norm or budget."""
    budget = Budget.start(time_budget)
    om, x, f64, margins, predicted = centre_margins(model, at, label, norm)
    # the attack first: the true radius is at most its radius, where the sweeps stop
    if progress is not None:
        progress("attack: searching for the smallest label flip (PGD)", 0.0)
    ta = time.monotonic()
    attack = attack_radius(f64, x, label, norm, restarts=attack_restarts, seed=seed)
    attack_s = time.monotonic() - ta
    cap = math.inf if attack is None else attack
    t0 = time.monotonic()
    lo, n_steps, consts = 0.0, 0, dict[int, float]()
    aff, walks = 0.0, 0
    if min(margins.values()) > 0:
        # the affine route first (cheap: no Jacobians), from a quarter of the first-order
        # radius min_j m_j / ||grad m_j(X0)||_dual (a guess: any start is sound)
        start = _first_order_radius(f64, x, label, margins, norm) * AFFINE_START
        aff, walks = affine_route(om, x, norm, label, start,
                                  routes.second_order(om, x, norm), progress, budget)
        # then the sweep's passes (routes.sweep_passes): the second, with the adjoint graph's
        # constants, where the first stopped short of the attack's radius
        if not budget.out("the radius sweep"):
            lo, n_steps, consts = routes.sweep_passes(
                om, x, norm, label, margins, steps, aff, cap, budget,
                lambda lo: max(aff, lo) if 0 < lo < cap * (1 - SWEEP_CAP_TOL) else None,
                _scaled_progress(progress, AFFINE_SHARE, 1.0))
    t1 = time.monotonic()
    by = "affine" if aff > lo else "sweep"
    return RobustnessResult(norm, label, predicted, max(lo, aff), attack, margins,
                            center_sha256(x), t1 - t0, attack_s, n_steps,
                            {} if by == "affine" else consts, by, aff, walks,
                            budget.seconds, budget.stopped, budget.stopped_before)
