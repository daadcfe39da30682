"""Bounds around one input, shared by the CLI (`lsa bound --at`, `lsa robustness`) and the
service (`POST /bound` with `at`/`eps`, `POST /certify` with `at`/`label`/`min_radius`): the
local (ball) report and the robustness radii of a loaded model, so both print the same object.

Imports of lsa_models (hence torch) are deferred to the calls: `lsa --help` and the server's
start need none of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool

from api_schemas import BoundReport
from api_schemas.bounds import BallDomain, Witness
from api_schemas.certificates import Certificate
from api_schemas.requests import center_shape

from .bounding import ModelRef, check_sync_size, load_model, request_key, store_result
from .certificates import new_certificate_body, sign_certificate
from .certifying import robust, stored_report_json
from .compute import ComputeBusy
from .db import transaction
from .errors import InvalidRequest, PayloadTooLarge
from .runtime import Runtime
from .tables import CertificateRow


def local_report_of(loaded: Any, sha256: str, x0: np.ndarray, eps: float, norm: str, *,
                    empirical: Any = None) -> BoundReport:
    """The bound on the ball {X : ||X - X0||_norm <= eps}; `upper` is the local constant.
    With `empirical` (restarts, steps, seed, time_budget_s attributes), the in-ball
    projected-ascent lower bound too. Raises ValueError for a bad input or eps."""
    from lsa_models.empirical import ratio  # deferred: torch
    from lsa_models.engine.local import certify_local

    from .reports import bound_report

    result = certify_local(loaded, x0, eps, norm)  # type: ignore[arg-type]
    report = bound_report(result, sha256)
    layers = [lo.model_copy(update={"rule": lb.rule, "global_upper": lb.global_upper})
              for lo, lb in zip(report.layers, result.layers, strict=True)]
    assert result.domain is not None
    update: dict[str, Any] = {"layers": layers, "domain": BallDomain(**result.domain)}
    if empirical is not None:
        import torch  # deferred: seconds at start-up

        from lsa_models.empirical.local import local_lower_bound
        from lsa_models.engine.driver import check_center
        from lsa_models.engine.local import as_onnx

        om = as_onnx(loaded, x0.shape[-2])
        x = check_center(om, x0)
        lb = local_lower_bound(om.module.with_dtype(torch.float64), x, eps, norm,
                               restarts=empirical.restarts, steps=empirical.steps,
                               seed=empirical.seed, time_budget_s=empirical.time_budget_s)
        update.update(lower=lb.lower, ratio=ratio(report.upper, lb.lower), witness=Witness(
            seed=lb.seed, value=lb.lower, input_shape=list(lb.witness.shape),
            input=[float(v) for v in lb.witness.reshape(-1)], restarts=lb.restarts,
            steps=lb.steps, source="search"))
    return report.model_copy(update=update)


def robustness_of(loaded: Any, sha256: str, x0: np.ndarray, label: int,
                  norm: str) -> dict[str, Any]:
    """Certified radius (every margin f_label - f_j provably positive on that ball) and the
    smallest label flip PGD finds, as the JSON object `lsa robustness --json` prints.
    Raises ValueError for a bad input or label."""
    from lsa_models.engine.local import robustness  # deferred: torch

    if norm not in ("2", "inf"):
        raise ValueError(f"norm must be 2 or inf, got {norm!r}")
    r = robustness(loaded, x0, label, norm)  # type: ignore[arg-type]
    return {
        "model_sha256": sha256, "norm": r.norm, "label": r.label,
        "predicted": r.predicted, "certified_radius": r.certified_radius,
        "attack_radius": r.attack_radius,
        "ratio": (r.certified_radius / r.attack_radius) if r.attack_radius else None,
        "margins": {str(j): m for j, m in r.margins.items()},
        "pair_constants": {str(j): c for j, c in r.pair_constants.items()},
        "center_sha256": r.center_sha256, "bisection_steps": r.bisection_steps,
        "seconds": {"certify": r.certify_seconds, "attack": r.attack_seconds},
    }


# ---- the service: POST /bound with at/eps, POST /certify with at/label/min_radius ------------


def center_array(runtime: Runtime, at: list[Any]) -> np.ndarray:
    """`at` as a float64 array, (N, D) or (1, N, D) (the request schema checked its shape and
    finiteness); 413 past LSA_MAX_AT_ELEMENTS."""
    limit = runtime.settings.max_at_elements
    shape = center_shape(at)
    size = math.prod(shape)
    if size > limit:
        raise PayloadTooLarge(f"at: {size} numbers (shape {shape}), above "
                              f"LSA_MAX_AT_ELEMENTS={limit}: send a smaller input or raise the "
                              "limit")
    return np.asarray(at, dtype=np.float64)


def ball_key(model: ModelRef, norm: str, x0: np.ndarray, eps: float,
             empirical: dict[str, Any] | None = None) -> tuple[str, int]:
    """The request key of a local bound (the centre's sha256 and eps in it) and N."""
    from lsa_models.engine.driver import center_sha256  # deferred: torch

    n = x0.shape[-2]
    ball = {"center_sha256": center_sha256(x0.reshape(1, *x0.shape[-2:])), "eps": float(eps)}
    return request_key(model.sha256, norm, n, None, empirical, ball), n


async def run_counted(runtime: Runtime, key: str, fn: Callable[[], Any]) -> Any:
    """`fn` on the compute pool; a refusal (queue full: 503) is counted like the global
    bound's."""
    try:
        return await runtime.compute.run(key, fn)
    except ComputeBusy:
        if runtime.metrics is not None:
            runtime.metrics.rejected.inc()
        raise


def _bad_at(exc: Exception) -> InvalidRequest:
    return InvalidRequest(f"at: {exc}")


def compute_local_and_store(runtime: Runtime, model: ModelRef, key: str, norm: str,
                            x0: np.ndarray, eps: float) -> BoundReport:
    """Compute the local report (no transaction open meanwhile), then store it once."""
    loaded = load_model(runtime, model)
    try:
        report = local_report_of(loaded, model.sha256, x0, eps, norm)
    except (ValueError, TypeError) as exc:
        raise _bad_at(exc) from None
    with transaction(runtime.sessions) as s:
        row = store_result(s, model, key, report, None)
        stored = BoundReport.model_validate(row.report)
    if runtime.metrics is not None:
        runtime.metrics.bounds.inc()
    return stored


async def local_report_json(runtime: Runtime, model: ModelRef, norm: str, at: list[Any],
                            eps: float) -> bytes:
    """The stored local report of this ball, or computed on the compute pool and stored."""
    x0 = center_array(runtime, at)
    key, _ = ball_key(model, norm, x0, eps)
    stored = await run_in_threadpool(stored_report_json, runtime, key)
    if stored is not None:
        return stored
    check_sync_size(runtime, model)
    report = await run_counted(
        runtime, key, lambda: compute_local_and_store(runtime, model, key, norm, x0, eps))
    assert isinstance(report, BoundReport)
    body = report.model_dump_json().encode()
    runtime.reports.put(key, body)
    return body


def compute_robustness(runtime: Runtime, model: ModelRef, x0: np.ndarray, label: int,
                       norm: str) -> dict[str, Any]:
    loaded = load_model(runtime, model)
    try:
        return robustness_of(loaded, model.sha256, x0, label, norm)
    except (ValueError, TypeError) as exc:
        text = str(exc)
        raise InvalidRequest(text if text.startswith("label") else f"at: {text}") from None


def issue_robustness_certificate(runtime: Runtime, model: ModelRef, radii: dict[str, Any],
                                 n: int, min_radius: float) -> Certificate:
    """Sign `radii` (robustness_of's object) against `min_radius` and store it."""
    from lsa_models import __version__  # deferred: imports torch
    from lsa_models.engine.local import METHOD

    section = {k: radii[k] for k in ("label", "predicted", "certified_radius",
                                     "attack_radius", "margins", "pair_constants",
                                     "center_sha256", "bisection_steps")}
    section["min_radius"] = min_radius
    ok = robust(float(radii["certified_radius"]), min_radius)
    body = new_certificate_body(
        model_sha256=model.sha256, norm=radii["norm"], seq_len=n, radius=None,
        threshold=min_radius, upper=None, lower=None, passed=ok,
        method="robustness: every margin f_label - f_j stays positive on the ball of the "
        "certified radius (bisection on r; " + METHOD + ")", lsa_version=__version__,
        robustness=section)
    cert = sign_certificate(body, runtime.signing_key)
    with transaction(runtime.sessions) as s:
        s.add(CertificateRow(id=cert.id, model_id=model.id, model_sha256=model.sha256,
                             threshold=cert.threshold, upper=cert.upper, passed=cert.passed,
                             body=cert.model_dump(mode="json"), issued_at=cert.issued_at))
    if runtime.metrics is not None:
        runtime.metrics.certificates.inc()
    return cert


async def robustness_certificate(runtime: Runtime, model: ModelRef, at: list[Any],
                                 label: int, norm: str, min_radius: float) -> Certificate:
    """Compute the radii on the compute pool (identical requests share one computation),
    then sign and store the certificate."""
    x0 = center_array(runtime, at)
    key, n = ball_key(model, norm, x0, 0.0)
    check_sync_size(runtime, model)
    radii = await run_counted(runtime, f"robustness:{key}:{label}",
                              lambda: compute_robustness(runtime, model, x0, label, norm))
    assert isinstance(radii, dict)
    return await run_in_threadpool(issue_robustness_certificate, runtime, model, radii, n,
                                   min_radius)
