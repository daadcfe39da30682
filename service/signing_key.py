"""The server's Ed25519 signing key: a PEM file created (mode 0600) on first use if none
exists. Loaded by the runtime (`Runtime.signing_key`) and by the CLI's local signing; the
certificates themselves are built, signed and judged in service.certificates.service."""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


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
