"""`lsa serve`: the REST API with its OpenAPI UI."""

from __future__ import annotations

from typing import Annotated

import typer
import uvicorn
from pydantic import ValidationError

from service.app import create_app, prepare_database
from service.db import NotMigratedError
from service.runtime import Runtime
from service.settings import Settings

from ..kit.console import fail, settings_error
from .common import app


@app.command()
def serve(
    host: Annotated[str, typer.Option("--host", help="Interface to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port", min=1, max=65535)] = 8000,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level")] = "info",
) -> None:
    """Run the API server (embedded default: SQLite under ./var, jobs in-process)."""
    try:
        settings = Settings()
    except ValidationError as exc:
        fail(settings_error(exc))


    runtime = Runtime(settings)
    try:
        prepare_database(runtime)
    except NotMigratedError as exc:
        fail(str(exc))
    finally:
        runtime.engine.dispose()
    shown = "localhost" if host in ("0.0.0.0", "::") else host
    typer.echo(f"lsa: serving on http://{shown}:{port}  (OpenAPI UI: http://{shown}:{port}/docs)")
    typer.echo(f"lsa: database {settings.database_url}; jobs "
               + ("in-process" if settings.redis_url is None else f"via {settings.redis_url}"))
    # Keep-alive longer than clients' idle pools (httpx: 5 s, load balancers: 60 s): a server
    # closing an idle connection as the client reuses it reads to the client as a dropped
    # connection. The backlog holds bursts of new connections while the loop is busy.
    uvicorn.run(create_app(settings), host=host, port=port, log_level=log_level,
                timeout_keep_alive=75, backlog=4096)
