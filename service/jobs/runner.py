"""Running one job: claim the row, heartbeat, call the handler, write the outcome.

The row is the source of truth. A claim increments `attempts`; every later write is fenced on
(id, attempts, status='running'), so a job cancelled meanwhile, or re-claimed after its worker
was presumed dead, is never overwritten by the old run.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from ..db import after_commit, transaction
from ..models import Job, utcnow
from .registry import get_job_kind

if TYPE_CHECKING:
    from ..runtime import Runtime

log = logging.getLogger("lsa.jobs")

STAGE_MAX = 200


class JobAborted(Exception):
    """The job was cancelled (or re-claimed) while running: stop without writing."""


class JobContext:
    def __init__(self, runtime: Runtime, job_id: str, attempt: int,
                 params: dict[str, Any]) -> None:
        self.runtime = runtime
        self.job_id = job_id
        self.attempt = attempt
        self.params = params
        self._last_write = 0.0
        self._last_stage: str | None = None

    @contextmanager
    def session(self) -> Iterator[Session]:
        with transaction(self.runtime.sessions) as s:
            yield s

    def _fenced(self, **values: Any) -> None:
        with self.session() as s:
            res = s.execute(
                update(Job)
                .where(Job.id == self.job_id, Job.attempts == self.attempt,
                       Job.status == "running")
                .values(heartbeat_at=utcnow(), **values))
            if res.rowcount != 1:  # type: ignore[attr-defined]
                raise JobAborted(self.job_id)

    def progress(self, fraction: float, stage: str | None = None, *,
                 force: bool = False) -> None:
        """Record progress; raises JobAborted if the job was cancelled. Writes at most a few
        times a second unless the stage changes."""
        now = time.monotonic()
        if not force and stage == self._last_stage and now - self._last_write < 0.5:
            return
        values: dict[str, Any] = {"progress": min(max(float(fraction), 0.0), 1.0)}
        if stage is not None:
            values["stage"] = stage[:STAGE_MAX]
        self._fenced(**values)
        self._last_write, self._last_stage = now, stage

    def check_cancelled(self) -> None:
        self._fenced()


def _claim(runtime: Runtime, job_id: str) -> tuple[int, str, dict[str, Any]] | None:
    with transaction(runtime.sessions) as s:
        now = utcnow()
        res = s.execute(
            update(Job).where(Job.id == job_id, Job.status == "queued")
            .values(status="running", attempts=Job.attempts + 1, started_at=now,
                    heartbeat_at=now, stage="starting"))
        if res.rowcount != 1:  # type: ignore[attr-defined]
            return None  # duplicate delivery, cancelled, or already done
        job = s.execute(select(Job).where(Job.id == job_id)).scalar_one()
        return job.attempts, job.kind, dict(job.params)


def _finish(runtime: Runtime, job_id: str, attempt: int, **values: Any) -> bool:
    with transaction(runtime.sessions) as s:
        res = s.execute(
            update(Job).where(Job.id == job_id, Job.attempts == attempt,
                              Job.status == "running")
            .values(finished_at=utcnow(), heartbeat_at=utcnow(), **values))
        return bool(res.rowcount == 1)  # type: ignore[attr-defined]


def _queue_of(kind_name: str) -> str:
    try:
        return get_job_kind(kind_name).queue
    except ValueError:
        return "bound"


def _finish_retrying(runtime: Runtime, job_id: str, attempt: int, **values: Any) -> bool:
    """`_finish`, retried on fresh connections: an interrupt (time limit) that hit the job
    mid-query can leave a pooled connection unusable."""
    for i in range(3):
        try:
            return _finish(runtime, job_id, attempt, **values)
        except SQLAlchemyError:
            log.warning("job %s: recording the outcome failed; retrying", job_id,
                        exc_info=True)
            runtime.engine.dispose()
            time.sleep(0.2 * (i + 1))
    return _finish(runtime, job_id, attempt, **values)


class _Heartbeat(threading.Thread):
    """Keeps `heartbeat_at` fresh while a handler computes without reporting progress."""

    def __init__(self, ctx: JobContext, interval_s: float) -> None:
        super().__init__(name=f"lsa-heartbeat-{ctx.job_id[:8]}", daemon=True)
        self.ctx = ctx
        self.interval_s = interval_s
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                self.ctx._fenced()
            except JobAborted:
                return
            except Exception:  # a transient database error must not kill the job
                log.warning("heartbeat of job %s failed", self.ctx.job_id, exc_info=True)


def run_job(runtime: Runtime, job_id: str) -> None:
    claimed = _claim(runtime, job_id)
    if claimed is None:
        log.info("job %s: not queued any more; skipping", job_id)
        return
    attempt, kind_name, params = claimed
    started = time.monotonic()
    ctx = JobContext(runtime, job_id, attempt, params)
    beat = _Heartbeat(ctx, max(0.2, min(10.0, runtime.settings.job_stale_after_s / 4)))
    beat.start()
    try:
        kind = get_job_kind(kind_name)
        result = kind.handler(ctx)
    except JobAborted:
        log.info("job %s: cancelled while running", job_id)
        return
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        # BaseException: Dramatiq's time limit arrives as an asynchronous Interrupt, which
        # can land inside library code and come out as another error; the clock decides.
        queue = _queue_of(kind_name)
        limit = runtime.settings.time_limit_s(queue)
        if type(exc).__name__ == "TimeLimitExceeded" or time.monotonic() - started >= limit:
            message = (f"time limit exceeded: {limit:g} s on queue {queue!r} "
                       f"(LSA_{queue.upper()}_TIME_LIMIT_S)")
        else:
            log.warning("job %s failed", job_id, exc_info=True)
            message = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) \
                else str(exc)
        _finish_retrying(runtime, job_id, attempt, status="failed", error=message[:4000],
                         stage="failed")
        return
    finally:
        beat.stopped.set()
    if not _finish_retrying(runtime, job_id, attempt, status="succeeded", result=result,
                            progress=1.0, stage="done"):
        log.info("job %s: finished but was cancelled meanwhile; result dropped", job_id)


def submit_job(session: Session, runtime: Runtime, kind_name: str, params: dict[str, Any],
               *, model_id: str | None = None, request_key: str | None = None) -> Job:
    """Insert a queued job; it is sent to its queue only after the transaction commits."""
    kind = get_job_kind(kind_name)
    checked = kind.params_schema.model_validate(params).model_dump(mode="json")
    job = Job(kind=kind.name, queue=kind.queue, status="queued", progress=0.0, stage="queued",
              params=checked, model_id=model_id, request_key=request_key, attempts=0)
    session.add(job)
    session.flush()
    job_id, queue = job.id, job.queue
    after_commit(session, lambda: runtime.queue.enqueue(job_id, queue))
    return job


def recover_jobs(runtime: Runtime, *, all_running: bool, resend_queued: bool = True) -> list[str]:
    """Requeue jobs whose worker died: running jobs with a stale heartbeat (or every running
    job, when this process is the only worker and has just started). Then send them, and with
    `resend_queued` every queued job, to their queues again: the in-memory queue died with the
    old process, and a duplicate message finds the job claimed and does nothing."""
    stale_before = utcnow() - timedelta(seconds=runtime.settings.job_stale_after_s)
    requeued: list[tuple[str, str]] = []
    with transaction(runtime.sessions) as s:
        running = s.execute(select(Job.id, Job.queue, Job.attempts, Job.heartbeat_at)
                            .where(Job.status == "running")).all()
        for job_id, queue, attempts, beat in running:
            if all_running or beat is None or beat < stale_before:
                res = s.execute(update(Job).where(Job.id == job_id, Job.attempts == attempts,
                                                  Job.status == "running")
                                .values(status="queued", stage="requeued: its worker stopped"))
                if res.rowcount == 1:  # type: ignore[attr-defined]
                    requeued.append((job_id, queue))
                    log.warning("job %s: worker stopped mid-run; requeued", job_id)
        if resend_queued:
            requeued = [tuple(r) for r in s.execute(  # type: ignore[misc]
                select(Job.id, Job.queue).where(Job.status == "queued")
                .order_by(Job.created_at)).all()]
    for job_id, queue in requeued:
        runtime.queue.enqueue(job_id, queue)
    return [job_id for job_id, _ in requeued]


def cancel_job(session: Session, job_id: str) -> Job:
    """Cancel a queued or running job in one atomic UPDATE (a worker finishing at the same
    moment either wins, and the job stays succeeded, or loses its fenced write)."""
    from ..errors import Conflict, NotFound

    res = session.execute(
        update(Job).where(Job.id == job_id, Job.status.in_(("queued", "running")))
        .values(status="cancelled", stage="cancelled", finished_at=utcnow()))
    job = session.get(Job, job_id, populate_existing=True)
    if job is None:
        raise NotFound(f"no job with id {job_id}")
    if res.rowcount != 1:  # type: ignore[attr-defined]
        raise Conflict(f"job {job_id} is already {job.status}; only queued or running jobs "
                       "can be cancelled")
    return job
