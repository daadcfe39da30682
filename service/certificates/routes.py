"""POST /certify and the certificates it issues: fetch, public key, verification."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from api_schemas import BoundReport
from api_schemas.certificates import (
    CERTIFICATE_EXAMPLE,
    Certificate,
    Counterexamples,
    VerifyResult,
)
from api_schemas.jobs import JobAccepted
from api_schemas.requests import (
    CertifiedAccuracyRequest,
    CertifyKind,
    CertifyRequest,
    RobustnessRequest,
    TrainingRequest,
)

from ..bounds.service import issue_certificate, report_json, resolve_seq_len
from ..deps import ReadAccess, RuntimeDep, WriteAccess, in_thread
from ..errors import responses
from ..jobs.routes import accepted_response
from ..models.service import find_model
from ..robustness.service import (
    counterexamples,
    robustness_certificate,
    robustness_set_certificate,
)
from ..routes.kinds import mark_inferred
from ..runtime import Runtime
from ..training.jobs import queue_training
from .service import find_certificate, public_key_pem, verify_certificate

router = APIRouter(tags=["certificates"])


class PublicKey(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "algorithm": "Ed25519",
        "public_key_pem": "-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEA...\n"
                          "-----END PUBLIC KEY-----\n"}]})

    algorithm: str = "Ed25519"
    public_key_pem: str


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


@router.get("/certificates/public-key", response_model=PublicKey,
            summary="The server's Ed25519 public key (PEM), to verify certificates offline")
def public_key(runtime: RuntimeDep) -> PublicKey:
    return PublicKey(public_key_pem=public_key_pem(runtime.signing_key))


@router.post(
    "/certificates/verify", response_model=VerifyResult,
    summary="Check a certificate's signature against this server's key",
    responses={200: {"content": {"application/json": {"example": {
        "valid": False, "reason": "signature does not match the certificate's fields "
        "(altered certificate or wrong key)"}}}}, **responses()},
)
def verify(
    runtime: RuntimeDep,
    certificate: Annotated[dict[str, Any], Body(
        description="A certificate as issued by POST /certify (any altered field: invalid)",
        examples=[{**CERTIFICATE_EXAMPLE, "signature": "base64..."}])],
) -> VerifyResult:
    return verify_certificate(certificate, runtime.signing_key.public_key())


@router.get("/certificates/{certificate_id}", response_model=Certificate,
            dependencies=[ReadAccess], summary="A certificate as issued",
            responses=responses(404))
@in_thread
def read_certificate(certificate_id: str, runtime: RuntimeDep) -> Certificate:
    return find_certificate(runtime, certificate_id)


@router.get("/certificates/{certificate_id}/counterexamples", response_model=Counterexamples,
            dependencies=[ReadAccess], responses=responses(404),
            summary="The label flips behind a certified-accuracy certificate (one per "
                    "attacked input: the point, its distance and class)")
@in_thread
def read_counterexamples(certificate_id: str, runtime: RuntimeDep) -> Counterexamples:
    return counterexamples(runtime, certificate_id)
