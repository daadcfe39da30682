"""Robustness radii and set verdicts of a loaded model, shared by the CLI (`lsa robustness`,
`lsa verify --recompute`) and the robustness jobs, so both print the same object. Imports of
lsa_models (hence torch) are deferred to the calls.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from ..bounds.local import model_image, patch_grid


def robustness_of(loaded: Any, sha256: str, x0: np.ndarray, label: int, norm: str, *,
                  progress: Callable[[str, float], None] | None = None,
                  time_budget: float | None = None) -> dict[str, Any]:
    """Certified radius (every margin f_label - f_j provably positive on that ball) and the
    smallest label flip PGD finds, as the JSON object `lsa robustness --json` prints; the
    computation is deterministic (seeded), so `lsa verify --recompute` reaches the same
    radius, unless `time_budget` (seconds; None: none) stopped it (`stopped_by_budget`: the
    radius is then the largest certified in time, at most the unbudgeted one).
    `progress(stage, fraction)` hears each step of the search. Raises ValueError for a bad
    input, label or budget."""
    from lsa_models.engine.routes.certify import robustness  # deferred: torch
    from lsa_models.engine.values import LocalNotCertified

    if norm not in ("2", "inf"):
        raise ValueError(f"norm must be 2 or inf, got {norm!r}")
    try:
        r = robustness(loaded, x0, label, norm, progress=progress,  # type: ignore[arg-type]
                       time_budget=time_budget)
    except LocalNotCertified as exc:
        # The radius needs a local rule for every op of the graph (the global fallback of
        # `lsa bound --at` has no margins to keep positive).
        raise ValueError(f"no certified radius for this model: {exc} (the robustness "
                         "radius needs a local rule for every op of the graph)") from None
    return {
        "model_sha256": sha256, "norm": r.norm, "label": r.label,
        "predicted": r.predicted, "certified_radius": r.certified_radius,
        "attack_radius": r.attack_radius,
        "ratio": (r.certified_radius / r.attack_radius) if r.attack_radius else None,
        "margins": {str(j): m for j, m in r.margins.items()},
        "pair_constants": {str(j): c for j, c in r.pair_constants.items()},
        "center_sha256": r.center_sha256, "sweep_runs": r.sweep_runs,
        "certified_by": r.certified_by, "affine_radius": r.affine_radius,
        "affine_walks": r.affine_walks,
        "time_budget_s": r.time_budget, "stopped_by_budget": r.stopped_by_budget,
        "stopped_before": r.stopped_before,
        "seconds": {"certify": r.certify_seconds, "attack": r.attack_seconds},
    }


def verdict_json(v: Any) -> dict[str, Any]:
    """One input's verdict at a radius (lsa_models.engine.routes.at_radius.Verdict) as JSON."""
    return {"label": v.label, "predicted": v.predicted, "status": v.status,
            "certified_by": v.certified_by, "margin_lower": v.margin_lower,
            "flip_distance": v.flip_distance, "flip_class": v.flip_class,
            "center_sha256": v.center_sha256, "affine_walks": v.walks,
            "sweep_runs": v.sweep_runs, "seconds": v.seconds,
            "stopped_by_budget": v.stopped_by_budget, "stopped_before": v.stopped_before,
            "proven_radius": v.proven_radius, "reason": v.reason}


def inputs_sha256(xs: np.ndarray, labels: Any) -> str:
    """What a set certificate is about: the inputs as the graph takes them (float64,
    little-endian, C order, with their shape: each as sent, a pixel upload's images cut into
    patches) and the labels."""
    h = hashlib.sha256(json.dumps([list(xs.shape), [int(v) for v in labels]]).encode())
    h.update(np.ascontiguousarray(xs, dtype="<f8").tobytes())
    return h.hexdigest()


def decide_set(loaded: Any, inputs: np.ndarray, labels: np.ndarray, norm: str,
               radius: float, *, progress: Callable[[int, int, Any], None] | None = None,
               workers: int = 1, sweep: bool = True,
               decided: Callable[[int, int], None] | None = None,
               time_budget: float | None = None) -> Any:
    """Every (inputs[i], labels[i]) decided at `radius` (certified / attacked / unknown /
    misclassified): lsa_models.engine.routes.at_radius's SetReport, its attacked verdicts carrying
    their flips in the graph's layout (`flips_of` puts them back into the inputs'). The
    inputs are as the graph takes them (a pixel upload's images cut: the CLI's `load_set`,
    the service's `set_inputs`). `workers` > 1: that many processes (the CLI's --workers,
    the server's LSA_SET_WORKERS; the verdicts are the same); `sweep=False` skips the
    radius sweep (lsa robustness --no-sweep); `time_budget`: each input's (seconds; None:
    none). Raises ValueError for bad inputs, labels, norm, radius, workers or budget."""
    from lsa_models.engine.values import LocalNotCertified

    from .set_pool import decide_all  # deferred: torch

    if norm not in ("2", "inf"):
        raise ValueError(f"norm must be 2 or inf, got {norm!r}")
    if inputs.ndim < 2 or inputs.shape[0] == 0:
        raise ValueError(f"inputs: shape {tuple(inputs.shape)}; give at least one input, the "
                         "inputs stacked along a first axis, (S, N, D) (on a pixel upload "
                         "(S, C, H, W))")
    try:
        return decide_all(loaded, inputs, labels, norm, radius, progress, workers=workers,
                          sweep=sweep, decided=decided, time_budget=time_budget)
    except LocalNotCertified as exc:
        raise ValueError(f"no certified verdict for this model: {exc} (the robustness "
                         "verdicts need a local rule for every op of the graph)") from None


def set_json(sha256: str, rep: Any) -> dict[str, Any]:
    """A SetReport (`decide_set`) as the JSON object `lsa robustness --inputs --labels
    --radius --json` prints."""
    from lsa_models.engine.routes.at_radius import STATUSES  # deferred: torch

    return {
        "model_sha256": sha256, "norm": rep.norm, "radius": rep.radius,
        "n": len(rep.verdicts), "counts": {s: rep.count(s) for s in STATUSES},
        "clean_accuracy": rep.clean_accuracy, "certified_accuracy": rep.certified_accuracy,
        "attack_accuracy": rep.attack_accuracy, "seconds": rep.seconds, "sweep": rep.sweep,
        "time_budget_s": rep.time_budget,
        "stopped_by_budget": sum(v.stopped_by_budget for v in rep.verdicts),
        "samples": [{"index": i, **verdict_json(v)} for i, v in enumerate(rep.verdicts)],
    }


def flips_of(loaded: Any, rep: Any, shape: tuple[int, ...] | None) -> list[dict[str, Any]]:
    """The attacked verdicts' counterexamples (index, label, flip_class, distance, input):
    each point back in the inputs' layout (`model_image`: an image (1, C, H, W) on a pixel
    upload), reshaped to `shape` (one input as given) where that is known."""
    out = []
    for i, v in enumerate(rep.verdicts):
        if v.flip is not None:
            point = model_image(loaded, v.flip)
            out.append({"index": i, "label": v.label, "flip_class": v.flip_class,
                        "distance": v.flip_distance,
                        "input": point if shape is None else point.reshape(shape)})
    return out


def verdicts_of(loaded: Any, sha256: str, inputs: np.ndarray, labels: np.ndarray, norm: str,
                radius: float, *, progress: Callable[[int, int, Any], None] | None = None,
                sweep: bool = True, counterexamples: bool = False, workers: int = 1,
                decided: Callable[[int, int], None] | None = None,
                time_budget: float | None = None) -> dict[str, Any]:
    """`decide_set` as JSON (`set_json`); with `counterexamples`, `flips_of` under that key
    (each point in the input's layout: its shape in `inputs`, or on a pixel upload the image
    (1, C, H, W): the image a user sent is cut before it gets here). `workers`: processes
    deciding the inputs (the verdicts are the same); `decided(k, n)`: as decide_all's;
    `time_budget`: each input's."""
    rep = decide_set(loaded, inputs, labels, norm, radius, progress=progress, sweep=sweep,
                     workers=workers, decided=decided, time_budget=time_budget)
    out = set_json(sha256, rep)
    if counterexamples:
        shape = None if patch_grid(loaded) is not None else tuple(inputs.shape[1:])
        out["counterexamples"] = [{**c, "input": c["input"].tolist()}
                                  for c in flips_of(loaded, rep, shape)]
    return out


# ---- the service: POST /bound with at/eps, POST /certify with at/label/min_radius ------------
