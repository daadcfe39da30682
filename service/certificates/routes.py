"""The certificates POST /certify issues (service.certify.routes): fetch, public key,
verification."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body
from pydantic import BaseModel, ConfigDict

from api_schemas.certificates import (
    CERTIFICATE_EXAMPLE,
    Certificate,
    VerifyResult,
)

from ..deps import ReadAccess, RuntimeDep, in_thread
from ..errors import responses
from .service import find_certificate, public_key_pem, verify_certificate

router = APIRouter(tags=["certificates"])


class PublicKey(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "algorithm": "Ed25519",
        "public_key_pem": "-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEA...\n"
                          "-----END PUBLIC KEY-----\n"}]})

    algorithm: str = "Ed25519"
    public_key_pem: str


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
