"""POST /bound: the certified bound now, or a job when empirical work is asked for.

The handler is async: a cached answer comes from memory with no thread involved; database
reads run on the request threads; a computation runs on the compute pool (service.compute).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from api_schemas import BoundReport
from api_schemas.jobs import JobAccepted
from api_schemas.requests import (
    BoundKind,
    BoundRequest,
    GlobalBoundRequest,
    LocalBoundRequest,
)

from ..deps import RuntimeDep, WriteAccess
from ..errors import InvalidRequest, responses
from ..jobs.routes import accepted_response
from ..jobs.runner import submit_keyed_job
from ..models.service import ModelRef, find_model
from ..routes.kinds import mark_inferred
from ..runtime import Runtime
from .local import ball_key, local_report_json, model_center
from .service import (
    check_empirical_size,
    report_json,
    request_key,
    resolve_seq_len,
    stored_report_json,
)

router = APIRouter(tags=["bounds"])


@router.post(
    "/bound", response_model=BoundReport, dependencies=[WriteAccess],
    summary="A bound of one `kind`: global (the certified Lipschitz upper bound), empirical "
            "(and, as a job, an empirical lower bound) or local (the bound on the ball "
            "around one input `at` of radius `eps`)",
    responses={202: {"model": JobAccepted, "description": "Empirical work was asked for: "
                     "poll GET /jobs/{job_id} (Location), waiting Retry-After seconds; its "
                     "result is this report"},
               **responses(404, 413, 503)},
)
async def bound(req: BoundRequest, runtime: RuntimeDep) -> Response:
    return mark_inferred(await bound_kind(req.root, runtime), "POST /bound", req.inferred)


async def bound_kind(req: BoundKind, runtime: Runtime) -> Response:
    model = await run_in_threadpool(find_model, runtime, req.model_id)
    if isinstance(req, LocalBoundRequest):
        return await local_bound(req, runtime, model)
    seq_len = resolve_seq_len(model, req.seq_len)
    if isinstance(req, GlobalBoundRequest):
        body = await report_json(runtime, model, req.norm, seq_len, req.radius)
        return Response(body, media_type="application/json")
    empirical = req.empirical.model_dump(mode="json")
    key = request_key(model.sha256, req.norm, seq_len, req.radius, empirical)
    stored = await run_in_threadpool(stored_report_json, runtime, key)
    if stored is not None:
        return Response(stored, media_type="application/json")
    check_empirical_size(runtime, model, seq_len)
    accepted = await run_in_threadpool(
        submit_bound_job, runtime, model,
        {"model_id": model.id, "norm": req.norm, "seq_len": seq_len, "radius": req.radius,
         "empirical": empirical, "request_key": key})
    return accepted_response(accepted, "bound")


async def local_bound(req: LocalBoundRequest, runtime: Runtime, model: ModelRef) -> Response:
    """The bound on the ball around `at` (computed on the compute pool, stored, cached); on
    a pixel upload `at` is the image, cut into the patches the graph takes."""
    x0 = await model_center(runtime, model, req.at)
    n = int(x0.shape[-2])
    if req.seq_len is not None and req.seq_len != n:
        raise InvalidRequest(f"seq_len={req.seq_len} differs from the N={n} of at; omit "
                             "seq_len (at gives it)")
    if req.empirical is None:
        body = await local_report_json(runtime, model, req.norm, x0, req.eps)
        return Response(body, media_type="application/json")
    # The in-ball lower bound runs as a job, like the global one.
    empirical = req.empirical.model_dump(mode="json")
    key, _ = ball_key(model, req.norm, x0, req.eps, empirical)
    stored = await run_in_threadpool(stored_report_json, runtime, key)
    if stored is not None:
        return Response(stored, media_type="application/json")
    check_empirical_size(runtime, model, n)
    accepted = await run_in_threadpool(
        submit_bound_job, runtime, model,
        {"model_id": model.id, "norm": req.norm, "seq_len": n, "radius": None,
         "empirical": empirical, "request_key": key, "at": x0.tolist(), "eps": req.eps})
    return accepted_response(accepted, "bound")


def submit_bound_job(runtime: Runtime, model: ModelRef, params: dict[str, Any]) -> JobAccepted:
    """The active job of this request, or a new one (one short write transaction)."""
    job_id, status = submit_keyed_job(runtime, "bound", params, model_id=model.id)
    return JobAccepted.model_validate({"job_id": job_id, "status": status})
