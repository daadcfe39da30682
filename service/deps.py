"""FastAPI dependencies: the runtime and the API-key check. Routes never hold a database
session: the service functions they call open their own transactions (docs/service.md,
"Transactions")."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Annotated, ParamSpec, TypeVar

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from .auth import authorize
from .runtime import Runtime


async def get_runtime(request: Request) -> Runtime:
    # async: a plain attribute read needs no worker thread.
    runtime = request.app.state.runtime
    assert isinstance(runtime, Runtime)
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


P = ParamSpec("P")
R = TypeVar("R")


def in_thread(route: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    """A route that reads or writes the database, run on a request thread but declared
    async, so its response is validated on the event loop. Sync routes once held a session
    dependency's connection while FastAPI validated their response on a second request
    thread; under load every request thread waited for a connection (measured: 200
    concurrent GET /jobs/{id} on SQLite all timed out). Routes now hold no session (their
    service functions open and close their transactions on the route's thread), and a
    response is still validated without taking a second request thread."""
    @functools.wraps(route)
    async def threaded(*args: P.args, **kwargs: P.kwargs) -> R:
        return await run_in_threadpool(route, *args, **kwargs)
    return threaded

_bearer = HTTPBearer(auto_error=False, description="API key: `Authorization: Bearer lsa_...`")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="API key (alternative)")


def require_scope(scope: str) -> Callable[..., Awaitable[None]]:
    async def check(runtime: RuntimeDep,
                    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
                    header: Annotated[str | None, Depends(_header)]) -> None:
        # async, so that with auth off no request spends a thread on it.
        if not runtime.settings.auth_required:
            return
        key = bearer.credentials if bearer is not None else header
        await run_in_threadpool(authorize, runtime, key, scope)

    return check


ReadAccess = Depends(require_scope("read"))
WriteAccess = Depends(require_scope("write"))
