"""POST /certify: one signed certificate of any kind, each issued by its domain (lipschitz:
service.bounds, robustness and certified_accuracy: service.robustness, training:
service.training). The certificates' own reads and verification are service.certificates'."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from api_schemas import BoundReport
from api_schemas.certificates import Certificate
from api_schemas.jobs import JobAccepted
from api_schemas.requests import (
    CertifiedAccuracyRequest,
    CertifyKind,
    CertifyRequest,
    RobustnessRequest,
    TrainingRequest,
)

from ..bounds.service import issue_certificate, report_json, resolve_seq_len
from ..deps import RuntimeDep, WriteAccess
from ..errors import responses
from ..jobs.routes import accepted_response
from ..models.service import find_model
from ..robustness.service import robustness_certificate, robustness_set_certificate
from ..routes.kinds import mark_inferred
from ..runtime import Runtime
from ..training.jobs import queue_training

router = APIRouter(tags=["certificates"])


@router.post(
    "/certify", status_code=201, response_model=Certificate, dependencies=[WriteAccess],
    summary="Issue a signed certificate of one `kind`: lipschitz (is the certified bound <= "
            "max_lipschitz?), robustness (is the label certified robust on the ball of "
            "min_radius around `at`? a job unless its radii are stored), certified_accuracy "
            "(is that fraction of the inputs certified robust? a job unless its verdicts are "
            "stored) or training (train a model and certify it, as a job)",
    responses={202: {"model": JobAccepted, "description": "Queued as a job: a training "
                     "request (queue training), or a robustness request whose radii are not "
                     "stored yet, or a certified-accuracy request whose verdicts are not "
                     "(queue bound). Poll GET /jobs/{job_id} (Location), waiting Retry-After "
                     "seconds; a robustness job's result is the certificate"},
               **responses(404, 413, 503)},
)
async def certify(req: CertifyRequest, runtime: RuntimeDep) -> Response:
    return mark_inferred(await certify_kind(req.root, runtime), "POST /certify", req.inferred)


async def certify_kind(req: CertifyKind, runtime: Runtime) -> Response:
    if isinstance(req, TrainingRequest):
        job = await run_in_threadpool(queue_training, runtime, req.training)
        return accepted_response(JobAccepted(job_id=job, status="queued"), "training")
    model = await run_in_threadpool(find_model, runtime, req.model_id)
    if isinstance(req, CertifiedAccuracyRequest):
        return certificate_or_job(await robustness_set_certificate(
            runtime, model, req.inputs, req.labels, req.norm, req.min_radius,
            req.min_certified_accuracy, sweep=req.sweep, time_budget=req.time_budget_s))
    if isinstance(req, RobustnessRequest):
        return certificate_or_job(await robustness_certificate(
            runtime, model, req.at, req.label, req.norm, req.min_radius, req.time_budget_s))
    seq_len = resolve_seq_len(model, req.seq_len)
    report = BoundReport.model_validate_json(
        await report_json(runtime, model, req.norm, seq_len, req.radius))
    cert = await run_in_threadpool(issue_certificate, runtime, model, report,
                                   req.max_lipschitz)
    return Response(cert.model_dump_json(), status_code=201, media_type="application/json")


def certificate_or_job(robust: Certificate | JobAccepted) -> Response:
    """201 with a certificate signed from stored results, or 202 with the job computing
    them."""
    if isinstance(robust, JobAccepted):
        return accepted_response(robust, "bound")
    return Response(robust.model_dump_json(), status_code=201, media_type="application/json")
