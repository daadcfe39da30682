"""The `bound` job: the analytic bound plus an empirical lower bound (gradient ascent)."""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from api_schemas.requests import EmpiricalParams

from ..jobs.context import JobContext
from ..jobs.registry import JobKind, register_job_kind
from ..models.service import ModelRef
from ..tables import UploadedModel
from .local import local_report_of
from .service import analytic_report, find_result, load_model, store_result


class BoundJobParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_id: str
    norm: str
    seq_len: int
    radius: float | None
    empirical: EmpiricalParams
    request_key: str
    # Local requests (POST /bound with at/eps): the ball's centre and radius.
    at: list[Any] | None = None
    eps: float | None = None


def run_bound(ctx: JobContext) -> dict[str, Any]:
    p = BoundJobParams.model_validate(ctx.params)
    with ctx.session() as s:
        # A re-run after a crash finds the result its first run stored.
        done = find_result(s, p.request_key)
        if done is not None:
            return dict(done.report)
        row = s.get(UploadedModel, p.model_id)
        if row is None:
            raise ValueError(f"model {p.model_id} no longer exists")
        model = ModelRef.of(row)
    ctx.progress(0.02, "loading model", force=True)
    loaded = load_model(ctx.runtime, model)
    if p.at is not None:
        return run_local_bound(ctx, p, model, loaded)
    ctx.progress(0.05, "analytic bound", force=True)
    report = analytic_report(ctx.runtime, model, p.norm, p.seq_len, p.radius, loaded)
    ctx.progress(0.1, "empirical lower bound", force=True)

    # Deferred: both import torch, which app start-up (importing this handler) does not need.
    from lsa_models.empirical import estimate

    from ..reports import with_empirical

    d_model = loaded.d_model or model.d_model
    if d_model is None:
        raise ValueError("the model does not state its token width d_model; an empirical "
                         "bound needs it")

    def progress(fraction: float, stage: str = "", *_: Any) -> None:
        # The estimator reports its own 0..1; map it onto 0.1..0.95 of the job. Raises
        # JobAborted inside the search when the job is cancelled, which stops it.
        ctx.progress(0.1 + 0.85 * float(fraction),
                     f"empirical lower bound: {stage}" if stage else "empirical lower bound")

    est = estimate(loaded.module, input_shape=(p.seq_len, d_model), norm=p.norm,
                   restarts=p.empirical.restarts, steps=p.empirical.steps, seed=p.empirical.seed,
                   time_budget_s=p.empirical.time_budget_s, progress=progress,
                   # On a bounded domain the search stays inside it, or its witness would be
                   # no lower bound there.
                   radius=p.radius)
    report = with_empirical(report, est)
    ctx.progress(0.97, "storing result", force=True)
    with ctx.session() as s:
        stored = store_result(s, model, p.request_key, report,
                              p.empirical.model_dump(mode="json"))
        return dict(stored.report)


def run_local_bound(ctx: JobContext, p: BoundJobParams, model: ModelRef,
                    loaded: Any) -> dict[str, Any]:
    """The local bound on the ball around `at` plus the in-ball lower bound (projected ascent;
    its time budget bounds the job)."""
    assert p.eps is not None  # the request validator's rule
    ctx.progress(0.05, "local bound and in-ball lower bound", force=True)
    report = local_report_of(loaded, model.sha256, np.asarray(p.at, dtype=np.float64), p.eps,
                             p.norm, empirical=p.empirical)
    ctx.progress(0.97, "storing result", force=True)
    with ctx.session() as s:
        stored = store_result(s, model, p.request_key, report,
                              p.empirical.model_dump(mode="json"))
        return dict(stored.report)


register_job_kind(JobKind("bound", queue="bound", handler=run_bound,
                          params_schema=BoundJobParams))
