"""Dramatiq plumbing. One actor per queue takes a job id only; everything else is in the row.

Without LSA_REDIS_URL the broker is Dramatiq's in-memory broker consumed by a worker thread in
the server (no Redis needed). With it, `lsa worker [--queues ...]` processes on any machine
consume from Redis; GPU machines run `--queues training`.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import dramatiq
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import (
    AgeLimit,
    Callbacks,
    Pipelines,
    Retries,
    ShutdownNotifications,
    TimeLimit,
)

from .registry import QUEUES

if TYPE_CHECKING:
    from ..runtime import Runtime

log = logging.getLogger("lsa.jobs")


class JobQueue:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        settings = runtime.settings
        # No Retries: a failure is recorded in the job row; a crash is recovered from the row.
        middleware = [AgeLimit(), TimeLimit(), ShutdownNotifications(), Callbacks(),
                      Pipelines(), Retries(max_retries=0)]
        self.broker: dramatiq.Broker
        if settings.redis_url:
            from dramatiq.brokers.redis import RedisBroker

            self.broker = RedisBroker(url=settings.redis_url, namespace=settings.redis_namespace,
                                      middleware=middleware)
        else:
            self.broker = StubBroker(middleware=middleware)
        self.actors: dict[str, dramatiq.Actor[Any, Any]] = {}
        for queue in QUEUES:
            self.actors[queue] = dramatiq.actor(
                broker=self.broker, actor_name=f"lsa_run_job_{queue}",
                queue_name=queue, max_retries=0,
                # Explicit per queue: Dramatiq's default of 10 minutes would kill training.
                time_limit=int(settings.time_limit_s(queue) * 1000))(self._handler())
        self.worker: dramatiq.Worker | None = None
        self._reaper: _Reaper | None = None

    def _handler(self) -> Any:
        runtime = self.runtime

        def run_job_by_id(job_id: str) -> None:
            from .runner import run_job

            run_job(runtime, job_id)

        return run_job_by_id

    @property
    def embedded(self) -> bool:
        return self.runtime.settings.redis_url is None

    def enqueue(self, job_id: str, queue: str) -> None:
        self.actors[queue].send(job_id)

    def start_worker(self, queues: set[str] | None = None) -> dramatiq.Worker:
        """Consume `queues` (default all) on threads of this process; recover orphans first."""
        from .runner import recover_jobs

        unknown = set(queues or ()) - set(QUEUES)
        if unknown:
            raise ValueError(f"unknown queue(s) {', '.join(sorted(unknown))}; use "
                             f"{', '.join(QUEUES)}")
        self.broker.emit_after("process_boot")
        worker = dramatiq.Worker(self.broker, queues=queues,
                                 worker_threads=self.runtime.settings.worker_threads,
                                 worker_timeout=100 if self.embedded else 1000)
        worker.start()
        self.worker = worker
        # Embedded: this process is the only worker, so any job left running is orphaned.
        recover_jobs(self.runtime, all_running=self.embedded)
        self._reaper = _Reaper(self.runtime)
        self._reaper.start()
        return worker

    def ping(self) -> str:
        if self.embedded:
            if self.worker is None:
                raise RuntimeError("the in-process worker is not running")
            return "in-process"
        self.broker.client.ping()  # type: ignore[attr-defined]
        return "redis"

    def close(self) -> None:
        if self._reaper is not None:
            self._reaper.stopped.set()
        if self.worker is not None:
            self.worker.stop(timeout=2000)
            self.worker = None
        self.broker.close()


class _Reaper(threading.Thread):
    """Requeues jobs whose worker went silent (a machine died) while this one keeps going."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__(name="lsa-job-reaper", daemon=True)
        self.runtime = runtime
        self.stopped = threading.Event()

    def run(self) -> None:
        from .runner import recover_jobs

        interval = self.runtime.settings.job_stale_after_s / 2
        while not self.stopped.wait(interval):
            try:
                recover_jobs(self.runtime, all_running=False, resend_queued=False)
            except Exception:
                log.warning("job recovery pass failed", exc_info=True)

