"""POST /bound: the certified bound now, or a job when empirical work is asked for."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import select

from api_schemas import BoundReport
from api_schemas.jobs import JobAccepted
from api_schemas.requests import BoundRequest

from ..bounding import (
    analytic_report,
    check_empirical_size,
    check_sync_size,
    find_result,
    get_model,
    request_key,
    resolve_seq_len,
    store_result,
)
from ..deps import RuntimeDep, SessionDep, WriteAccess
from ..errors import responses
from ..jobs import submit_job
from ..models import ACTIVE_JOB_STATUSES, Job

router = APIRouter(tags=["bounds"])


@router.post(
    "/bound", response_model=BoundReport, dependencies=[WriteAccess],
    summary="Certified Lipschitz upper bound (and, as a job, an empirical lower bound)",
    responses={202: {"model": JobAccepted, "description": "Empirical work was asked for: "
                     "poll GET /jobs/{job_id}; its result is this report"}, **responses(404)},
)
def bound(req: BoundRequest, runtime: RuntimeDep, session: SessionDep) -> BoundReport:
    model = get_model(session, req.model_id)
    seq_len = resolve_seq_len(model, req.seq_len)
    empirical = req.empirical.model_dump(mode="json") if req.empirical else None
    key = request_key(model.sha256, req.norm, seq_len, req.radius, empirical)
    stored = find_result(session, key)
    if stored is not None:
        return BoundReport.model_validate(stored.report)
    if empirical is None:
        check_sync_size(runtime, model)
        report = analytic_report(runtime, model, req.norm, seq_len, req.radius)
        store_result(session, model, key, report, None)
        if runtime.metrics is not None:
            runtime.metrics.bounds.inc()
        return report
    check_empirical_size(runtime, model, seq_len)
    job = session.scalar(select(Job).where(Job.request_key == key,
                                           Job.status.in_(ACTIVE_JOB_STATUSES)))
    if job is None:
        job = submit_job(session, runtime, "bound",
                         {"model_id": model.id, "norm": req.norm, "seq_len": seq_len,
                          "radius": req.radius, "empirical": empirical, "request_key": key},
                         model_id=model.id, request_key=key)
    body = JobAccepted(job_id=job.id, status=job.status)  # type: ignore[arg-type]
    return JSONResponse(body.model_dump(), status_code=202)  # type: ignore[return-value]
