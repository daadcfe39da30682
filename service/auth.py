"""API keys: `lsa_<prefix>_<secret>`, stored as a sha256 hash (the keys are 256-bit random,
so a fast hash is enough; the plain key is shown once, at creation)."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from .tables import KEY_SCOPES, ApiKey, utcnow


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(session: Session, scope: str, name: str | None = None) -> tuple[ApiKey, str]:
    if scope not in KEY_SCOPES:
        raise ValueError(f"scope must be one of {', '.join(KEY_SCOPES)}, got {scope!r}")
    prefix = secrets.token_hex(4)
    key = f"lsa_{prefix}_{secrets.token_urlsafe(32)}"
    row = ApiKey(prefix=prefix, key_hash=hash_key(key), scope=scope, name=name)
    session.add(row)
    session.flush()
    return row, key


def lookup_key(session: Session, key: str) -> ApiKey | None:
    parts = key.split("_")
    if len(parts) < 3 or parts[0] != "lsa":
        return None
    row = session.scalar(select(ApiKey).where(ApiKey.prefix == parts[1]))
    if row is None or row.revoked_at is not None:
        return None
    if not hmac.compare_digest(row.key_hash, hash_key(key)):
        return None
    return row


def allows(granted: str, needed: str) -> bool:
    return granted == "write" or granted == needed


def revoke_key(session: Session, prefix: str) -> bool:
    row = session.scalar(select(ApiKey).where(ApiKey.prefix == prefix))
    if row is None or row.revoked_at is not None:
        return False
    row.revoked_at = utcnow()
    return True
