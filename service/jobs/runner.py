"""Running one job: claim the row, heartbeat, call the handler, write the outcome.

The row is the source of truth. A claim increments `attempts`; every later write is fenced on
(id, attempts, status='running'), so a job cancelled meanwhile, or re-claimed after its worker
was presumed dead, is never overwritten by the old run.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from ..db import after_commit, transaction
from ..errors import Conflict, NotFound
from ..runtime import Runtime
from ..tables import ACTIVE_JOB_STATUSES, Job, utcnow
from .context import JobAborted, JobContext, rowcount
from .registry import get_job_kind

log = logging.getLogger("lsa.jobs")

__all__ = ["JobAborted", "JobContext", "cancel", "cancel_job", "job_status", "recover_jobs",
           "run_job", "submit_job"]


def _claim(runtime: Runtime, job_id: str) -> tuple[int, str, dict[str, Any]] | None:
    with transaction(runtime.sessions) as s:
        now = utcnow()
        res = s.execute(
            update(Job).where(Job.id == job_id, Job.status == "queued")
            .values(status="running", attempts=Job.attempts + 1, started_at=now,
                    heartbeat_at=now, stage="starting"))
        if rowcount(res) != 1:
            return None  # duplicate delivery, cancelled, or already done
        job = s.execute(select(Job).where(Job.id == job_id)).scalar_one()
        return job.attempts, job.kind, dict(job.params)


def _finish(runtime: Runtime, job_id: str, attempt: int, **values: Any) -> bool:
    with transaction(runtime.sessions) as s:
        res = s.execute(
            update(Job).where(Job.id == job_id, Job.attempts == attempt,
                              Job.status == "running")
            .values(finished_at=utcnow(), heartbeat_at=utcnow(), **values))
        return rowcount(res) == 1


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
                self.ctx.fenced_write()
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
              params=checked, model_id=model_id, request_key=request_key, attempts=0,
              enqueued_at=utcnow())
    session.add(job)
    session.flush()
    job_id, queue = job.id, job.queue
    after_commit(session, lambda: runtime.queue.enqueue(job_id, queue))
    return job


def submit_keyed_job(runtime: Runtime, kind_name: str, params: dict[str, Any], *,
                     model_id: str) -> tuple[str, str]:
    """(id, status) of the active job of this exact request (`params["request_key"]`), or of a
    new one: identical requests share one job (one short write transaction)."""
    key = str(params["request_key"])
    with transaction(runtime.sessions) as session:
        job = session.scalar(select(Job).where(Job.request_key == key,
                                               Job.status.in_(ACTIVE_JOB_STATUSES)))
        if job is None:
            job = submit_job(session, runtime, kind_name, params, model_id=model_id,
                             request_key=key)
        return job.id, job.status


def recover_jobs(runtime: Runtime, *, all_running: bool, resend_queued: bool = True) -> list[str]:
    """Send again the jobs a dead process left behind, and return their ids:

    - running jobs with a stale heartbeat (or every running job, when this process is the
      only worker and has just started) go back to queued;
    - queued jobs whose message was sent more than LSA_JOB_STALE_AFTER_S ago (a dead worker
      may hold it prefetched: Redis gives it back only in its occasional maintenance), or
      every queued job with `resend_queued` (the in-memory queue died with the old process).

    A duplicate message finds the job claimed (or done) and does nothing, so each job still
    runs once per claim and yields one result."""
    now = utcnow()
    stale_before = now - timedelta(seconds=runtime.settings.job_stale_after_s)
    with transaction(runtime.sessions) as s:
        running = s.execute(select(Job.id, Job.attempts, Job.heartbeat_at)
                            .where(Job.status == "running")).all()
        for job_id, attempts, beat in running:
            if all_running or beat is None or beat < stale_before:
                res = s.execute(update(Job).where(Job.id == job_id, Job.attempts == attempts,
                                                  Job.status == "running")
                                .values(status="queued", stage="requeued: its worker stopped",
                                        enqueued_at=None))
                if rowcount(res) == 1:
                    log.warning("job %s: worker stopped mid-run; requeued", job_id)
        due = select(Job.id, Job.queue).where(Job.status == "queued")
        if not resend_queued:
            due = due.where(or_(Job.enqueued_at.is_(None), Job.enqueued_at < stale_before))
        resend = [(str(i), str(q)) for i, q in s.execute(due.order_by(Job.created_at)).all()]
        if resend:
            s.execute(update(Job).where(Job.id.in_([i for i, _ in resend]),
                                        Job.status == "queued").values(enqueued_at=now))
    for job_id, queue in resend:
        runtime.queue.enqueue(job_id, queue)
    return [job_id for job_id, _ in resend]


def job_status(runtime: Runtime, job_id: str) -> Job:
    """The job row as it is now (a read-only transaction); NotFound when there is none."""
    with transaction(runtime.read_sessions) as s:
        job = s.get(Job, job_id)
        if job is None:
            raise NotFound(f"no job with id {job_id}")
        return job


def cancel(runtime: Runtime, job_id: str) -> Job:
    """`cancel_job` in its own write transaction (DELETE /jobs/{id})."""
    with transaction(runtime.sessions) as s:
        return cancel_job(s, job_id)


def cancel_job(session: Session, job_id: str) -> Job:
    """Cancel a queued or running job in one atomic UPDATE (a worker finishing at the same
    moment either wins, and the job stays succeeded, or loses its fenced write)."""
    res = session.execute(
        update(Job).where(Job.id == job_id, Job.status.in_(("queued", "running")))
        .values(status="cancelled", stage="cancelled", finished_at=utcnow()))
    job = session.get(Job, job_id, populate_existing=True)
    if job is None:
        raise NotFound(f"no job with id {job_id}")
    if rowcount(res) != 1:
        raise Conflict(f"job {job_id} is already {job.status}; only queued or running jobs "
                       "can be cancelled")
    return job
