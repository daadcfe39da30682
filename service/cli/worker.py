"""`lsa worker [--queues ...]`: consume jobs from Redis (LSA_REDIS_URL)."""

from __future__ import annotations

import signal
import threading
from typing import Annotated

import typer
from pydantic import ValidationError

from service import tasks
from service.broker import QUEUES
from service.db import NotMigratedError, ensure_migrated
from service.runtime import Runtime
from service.settings import Settings

from ..kit.console import fail, set_threads, settings_error
from .common import app


@app.command()
def worker(
    queues: Annotated[list[str] | None, typer.Option(
        "--queues", "-Q", help="Queues to consume: bound, training (default: both). "
        "GPU machines: --queues training")] = None,
) -> None:
    """Process jobs from Redis on this machine (needs LSA_REDIS_URL)."""
    try:
        settings = Settings()
    except ValidationError as exc:
        fail(settings_error(exc))
    if settings.redis_url is None:
        fail("LSA_REDIS_URL is not set: without Redis, jobs run inside `lsa serve` and no "
             "separate worker is needed")
    names = {q.strip() for item in (queues or []) for q in item.split(",") if q.strip()}
    unknown = names - set(QUEUES)
    if unknown:
        fail(f"unknown queue(s) {', '.join(sorted(unknown))}; use {', '.join(QUEUES)}")
    set_threads()
    runtime = Runtime(settings)
    try:
        ensure_migrated(runtime.engine)
    except NotMigratedError as exc:
        fail(str(exc))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    tasks.start_worker(runtime, names or None)
    typer.echo(f"lsa: worker consuming {', '.join(sorted(names or QUEUES))} from "
               f"{settings.redis_url}", err=True)
    try:
        stop.wait()
    finally:
        runtime.close()
