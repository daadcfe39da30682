"""FastAPI dependencies. The session dependencies are the transaction boundary: the write one
commits when the route returns (before the response is sent) and rolls back on any error; the
read one never takes SQLite's write lock."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from typing import Annotated, ParamSpec, TypeVar

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from .auth import allows, lookup_key
from .db import transaction
from .errors import Forbidden, Unauthorized
from .runtime import Runtime
from .tables import ApiKey, utcnow

# `last_used_at` is refreshed at most this often: a write per request would serialise every
# authenticated read behind SQLite's write lock.
LAST_USED_RESOLUTION = timedelta(minutes=1)


async def get_runtime(request: Request) -> Runtime:
    # async: a plain attribute read needs no worker thread.
    runtime = request.app.state.runtime
    assert isinstance(runtime, Runtime)
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def get_session(runtime: RuntimeDep) -> Iterator[Session]:
    with transaction(runtime.sessions) as session:
        yield session


def get_read_session(runtime: RuntimeDep) -> Iterator[Session]:
    with transaction(runtime.read_sessions) as session:
        yield session


# scope="function": commit before the response goes out, so a 201 means it is stored.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
ReadSessionDep = Annotated[Session, Depends(get_read_session, scope="function")]

P = ParamSpec("P")
R = TypeVar("R")


def in_thread(route: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    """A route that uses a session, run on a request thread but declared async. FastAPI
    validates a sync route's response on a second request thread while the route's session
    still holds its connection; under load every request thread can then wait for a
    connection that only such a validation would give back, and the server hangs (measured:
    200 concurrent GET /jobs/{id} on SQLite, every one timed out and the server answered
    nothing for minutes). An async route's response is validated on the event loop, and the
    session's exit needs no request thread (FastAPI runs it outside the limit), so a thread
    waiting for a connection always gets one."""
    @functools.wraps(route)
    async def threaded(*args: P.args, **kwargs: P.kwargs) -> R:
        return await run_in_threadpool(route, *args, **kwargs)
    return threaded

_bearer = HTTPBearer(auto_error=False, description="API key: `Authorization: Bearer lsa_...`")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="API key (alternative)")


def check_key(runtime: Runtime, key: str | None, scope: str) -> None:
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


def require_scope(scope: str) -> Callable[..., Awaitable[None]]:
    async def check(runtime: RuntimeDep,
                    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
                    header: Annotated[str | None, Depends(_header)]) -> None:
        # async, so that with auth off no request spends a thread on it.
        if not runtime.settings.auth_required:
            return
        key = bearer.credentials if bearer is not None else header
        await run_in_threadpool(check_key, runtime, key, scope)

    return check


ReadAccess = Depends(require_scope("read"))
WriteAccess = Depends(require_scope("write"))
