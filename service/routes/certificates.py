"""POST /certify and the certificates it issues: fetch, public key, verification."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from api_schemas.certificates import CERTIFICATE_EXAMPLE, Certificate, VerifyResult
from api_schemas.jobs import JobAccepted
from api_schemas.requests import CertifyRequest

from ..bounding import (
    analytic_report,
    best_lower,
    check_sync_size,
    find_result,
    get_model,
    request_key,
    resolve_seq_len,
    store_result,
)
from ..certificates import (
    new_certificate_body,
    public_key_pem,
    sign_certificate,
    verify_certificate,
)
from ..deps import ReadAccess, RuntimeDep, SessionDep, WriteAccess
from ..errors import NotFound, responses
from ..models import CertificateRow

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
    summary="Issue a signed certificate: is the certified bound <= max_lipschitz? "
            "(with `training`: train a model and certify it, as a job)",
    responses={202: {"model": JobAccepted, "description": "A training request was queued on "
                     "the training queue: poll GET /jobs/{job_id}"}, **responses(404)},
)
def certify(req: CertifyRequest, runtime: RuntimeDep,
            session: SessionDep) -> Certificate | JSONResponse:
    if req.training is not None:
        from ..jobs.training import submit_training

        job = submit_training(session, runtime, req.training)
        accepted = JobAccepted(job_id=job.id, status="queued")
        return JSONResponse(accepted.model_dump(mode="json"), status_code=202)
    assert req.model_id is not None and req.max_lipschitz is not None  # the validator's rule
    model = get_model(session, req.model_id)
    seq_len = resolve_seq_len(model, req.seq_len)
    key = request_key(model.sha256, req.norm, seq_len, req.radius, None)
    stored = find_result(session, key)
    if stored is not None:
        upper, verdict, method = stored.upper, stored.verdict, str(stored.report["method"])
    else:
        check_sync_size(runtime, model)
        report = analytic_report(runtime, model, req.norm, seq_len, req.radius)
        store_result(session, model, key, report, None)
        upper, verdict, method = report.upper, report.verdict, report.method
    from lsa_models import __version__

    certified = verdict == "certified" and upper is not None
    body = new_certificate_body(
        model_sha256=model.sha256, norm=req.norm, seq_len=seq_len, radius=req.radius,
        threshold=req.max_lipschitz, upper=upper if certified else None,
        lower=best_lower(session, model, req.norm, seq_len, req.radius),
        passed=bool(certified and upper is not None and upper <= req.max_lipschitz),
        method=method, lsa_version=__version__)
    cert = sign_certificate(body, runtime.signing_key)
    session.add(CertificateRow(id=cert.id, model_id=model.id, model_sha256=model.sha256,
                               threshold=cert.threshold, upper=cert.upper, passed=cert.passed,
                               body=cert.model_dump(mode="json"), issued_at=cert.issued_at))
    if runtime.metrics is not None:
        runtime.metrics.certificates.inc()
    return cert


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
def read_certificate(certificate_id: str, session: SessionDep) -> Certificate:
    row = session.get(CertificateRow, certificate_id)
    if row is None:
        raise NotFound(f"no certificate with id {certificate_id}")
    return Certificate.model_validate(row.body)
