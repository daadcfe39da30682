"""FastAPI dependencies. The session dependency is the one transaction boundary: it commits
when the route returns (before the response is sent) and rolls back on any error."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from .auth import allows, lookup_key
from .db import transaction
from .errors import Forbidden, Unauthorized
from .models import utcnow
from .runtime import Runtime


def get_runtime(request: Request) -> Runtime:
    runtime = request.app.state.runtime
    assert isinstance(runtime, Runtime)
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def get_session(runtime: RuntimeDep) -> Iterator[Session]:
    with transaction(runtime.sessions) as session:
        yield session


# scope="function": commit before the response goes out, so a 201 means it is stored.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]

_bearer = HTTPBearer(auto_error=False, description="API key: `Authorization: Bearer lsa_...`")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="API key (alternative)")


def require_scope(scope: str) -> Callable[..., None]:
    def check(runtime: RuntimeDep,
              bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
              header: Annotated[str | None, Depends(_header)]) -> None:
        if not runtime.settings.auth_required:
            return
        key = bearer.credentials if bearer is not None else header
        if not key:
            raise Unauthorized(f"this endpoint needs an API key with scope {scope!r}: send "
                               "`Authorization: Bearer <key>` (create one with `lsa keys "
                               f"create --scope {scope}`)")
        with transaction(runtime.sessions) as session:
            row = lookup_key(session, key)
            if row is None:
                raise Unauthorized("unknown or revoked API key")
            if not allows(row.scope, scope):
                raise Forbidden(f"this API key has scope {row.scope!r}; this endpoint needs "
                                f"{scope!r}")
            row.last_used_at = utcnow()

    return check


ReadAccess = Depends(require_scope("read"))
WriteAccess = Depends(require_scope("write"))
