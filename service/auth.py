"""API keys: `lsa_<prefix>_<secret>`, stored as a sha256 hash (the keys are 256-bit random,
so a fast hash is enough; the plain key is shown once, at creation)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from .db import transaction
from .errors import Forbidden, Unauthorized
from .tables import KEY_SCOPES, ApiKey, utcnow

if TYPE_CHECKING:
    from .runtime import Runtime

# `last_used_at` is refreshed at most this often: a write per request would serialise every
# authenticated read behind SQLite's write lock.
LAST_USED_RESOLUTION = timedelta(minutes=1)


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


def authorize(runtime: Runtime, key: str | None, scope: str) -> None:
    """Unauthorized unless `key` is an active API key, Forbidden unless its scope allows
    `scope`; refreshes its last use (at most every LAST_USED_RESOLUTION)."""
    if not key:
        raise Unauthorized(f"this endpoint needs an API key with scope {scope!r}: send "
                           "`Authorization: Bearer <key>` (create one with `lsa keys "
                           f"create --scope {scope}`)")
    with transaction(runtime.read_sessions) as session:
        row = lookup_key(session, key)
        if row is None:
            raise Unauthorized("unknown or revoked API key")
        if not allows(row.scope, scope):
            raise Forbidden(f"this API key has scope {row.scope!r}; this endpoint needs "
                            f"{scope!r}")
        key_id, last = row.id, row.last_used_at
    now = utcnow()
    if last is None or now - last > LAST_USED_RESOLUTION:
        with transaction(runtime.sessions) as session:
            found = session.get(ApiKey, key_id)
            if found is not None:
                found.last_used_at = now


# ---- `lsa keys`: each in its own transaction ------------------------------------------------


def new_api_key(sessions: sessionmaker[Session], scope: str,
                name: str | None = None) -> tuple[str, str]:
    """(the key's prefix, the key), stored as its hash; the key is not kept."""
    with transaction(sessions) as session:
        row, key = create_key(session, scope, name)
        return row.prefix, key


def api_keys(sessions: sessionmaker[Session]) -> list[tuple[str, str, bool, str | None]]:
    """(prefix, scope, revoked, name) of every key, oldest first."""
    with transaction(sessions) as session:
        return [(r.prefix, r.scope, r.revoked_at is not None, r.name)
                for r in session.scalars(select(ApiKey).order_by(ApiKey.created_at))]


def revoke_api_key(sessions: sessionmaker[Session], prefix: str) -> bool:
    """Revoke the active key with this prefix; False when there is none."""
    with transaction(sessions) as session:
        return revoke_key(session, prefix)
