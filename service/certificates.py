"""Ed25519 signing of certificates; key files; offline verification.

The private key is a PEM file created (mode 0600) on first use if none exists. Verification
needs only the public key, so anyone can re-check a certificate without the server.
"""

from __future__ import annotations

import base64
import binascii
import os
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import ValidationError

from api_schemas.certificates import Certificate, CertificateBody, VerifyResult, canonical_bytes


class SigningKeyError(ValueError):
    """A key file cannot be read or is not an Ed25519 key."""


def load_or_create_signing_key(path: Path) -> Ed25519PrivateKey:
    path = Path(path)
    if path.exists():
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as exc:
            raise SigningKeyError(f"{path}: not a PEM private key ({exc})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise SigningKeyError(f"{path}: not an Ed25519 private key")
        return key
    path.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    # O_EXCL: two processes starting at once must not overwrite each other's key.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return load_or_create_signing_key(path)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    return key


def public_key_pem(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.PEM,
                            serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def load_public_key(pem: str | bytes) -> Ed25519PublicKey:
    data = pem.encode() if isinstance(pem, str) else pem
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(f"not a PEM public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise SigningKeyError("not an Ed25519 public key")
    return key


def new_certificate_body(**fields: Any) -> CertificateBody:
    fields.setdefault("id", str(uuid.uuid4()))
    fields.setdefault("issued_at", datetime.now(UTC).replace(microsecond=0))
    return CertificateBody(**fields)


def sign_certificate(body: CertificateBody, key: Ed25519PrivateKey) -> Certificate:
    signature = base64.b64encode(key.sign(canonical_bytes(body))).decode()
    return Certificate(**body.model_dump(), signature=signature)


def verify_certificate(cert: Certificate | dict[str, Any],
                       public_key: Ed25519PublicKey | str | bytes) -> VerifyResult:
    """Check the signature over every field. Never raises on bad input: says why instead."""
    try:
        pub = public_key if isinstance(public_key, Ed25519PublicKey) else load_public_key(
            public_key)
    except SigningKeyError as exc:
        return VerifyResult(valid=False, reason=str(exc))
    try:
        parsed = cert if isinstance(cert, Certificate) else Certificate.model_validate(cert)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "certificate"
        return VerifyResult(valid=False, reason=f"malformed certificate: {where}: {first['msg']}")
    try:
        sig = base64.b64decode(parsed.signature, validate=True)
    except (binascii.Error, ValueError):
        return VerifyResult(valid=False, reason="signature is not valid base64")
    try:
        pub.verify(sig, canonical_bytes(parsed))
    except InvalidSignature:
        return VerifyResult(valid=False, reason="signature does not match the certificate's "
                            "fields (altered certificate or wrong key)")
    return VerifyResult(valid=True, reason="signature valid")
