"""The app factory. `create_app(settings)` wires settings, database, job queue and routes.

Start-up: the embedded default (SQLite) migrates itself; any other database must already be
at the latest migration, else start-up fails naming `lsa db upgrade`. Then the signing key is
loaded (created on first start), and without Redis a worker thread starts in this process
and picks up jobs an earlier process left queued or running.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

import anyio.to_thread
from fastapi import FastAPI

from . import tasks
from .bounds import routes as bounds_routes
from .certificates import routes as certificates_routes
from .certify import routes as certify_routes
from .db import ensure_migrated, upgrade
from .docs import install_docs
from .errors import BodyLimitMiddleware, install_error_handlers
from .jobs import routes as jobs_routes
from .metrics import Metrics, MetricsMiddleware
from .models import routes as models_routes
from .robustness import routes as robustness_routes
from .routes import health
from .runtime import Runtime
from .settings import Settings
from .training import routes as training_routes

log = logging.getLogger("lsa.service")

# Multipart framing around the file part.
UPLOAD_OVERHEAD = 1024 * 1024

DESCRIPTION = """Certified Lipschitz bounds for self-attention models.

Upload a model (`POST /models`), get its certified bound (`POST /bound`), ask for a signed
certificate (`POST /certify`) and verify it (`POST /certificates/verify`). Long work runs as
jobs (`GET /jobs/{id}`). Errors are `{"error": code, "detail": message}`.
"""


def _version() -> str:
    # importlib.metadata, not lsa_models.__version__: importing lsa_models loads torch,
    # which app start-up does not need.
    try:
        return version("lsa")
    except PackageNotFoundError:
        return "0+unknown"


def prepare_database(runtime: Runtime) -> None:
    if runtime.settings.should_migrate_on_start:
        upgrade(runtime.settings.database_url)
    else:
        ensure_migrated(runtime.engine)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()
    runtime = Runtime(settings, metrics=metrics)

    active = 0  # lifespans entered; test clients may nest them on one app

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal active
        if active == 0:
            prepare_database(runtime)
            runtime.signing_key  # noqa: B018  (created on first start)
            # Blocking request work (sync routes, database reads) runs on this many threads;
            # the connection pool has a connection for each.
            anyio.to_thread.current_default_thread_limiter().total_tokens = \
                settings.request_threads
            if runtime.queue.embedded:
                tasks.start_worker(runtime)
        active += 1
        try:
            yield
        finally:
            active -= 1
            if active == 0:
                runtime.close()

    app = FastAPI(
        title="lsa",
        version=_version(),
        description=DESCRIPTION,
        lifespan=lifespan,
        # Served from the app itself (service.docs), never from a CDN.
        docs_url=None, redoc_url=None,
    )
    app.state.runtime = runtime
    app.state.metrics = metrics
    install_error_handlers(app)
    install_docs(app)
    # Every domain's router, assembled here at the top (no domain imports the app). The order
    # is the OpenAPI document's.
    for module in (models_routes, bounds_routes, certify_routes, certificates_routes,
                   robustness_routes, jobs_routes, training_routes, health):
        app.include_router(module.router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_upload_bytes + UPLOAD_OVERHEAD,
                       max_json_bytes=settings.max_json_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
