"""Dramatiq plumbing. One actor per queue takes a job id only; everything else is in the row.

Without LSA_REDIS_URL the broker is Dramatiq's in-memory broker consumed by a worker thread in
the server (no Redis needed). With it, `lsa worker [--queues ...]` processes on any machine
consume from Redis; GPU machines run `--queues training`.

This module knows nothing of what a job does: the process that consumes (service.tasks) hands
`start_worker` the function that runs a job by id and the periodic recovery pass.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import (
    AgeLimit,
    Callbacks,
    Pipelines,
    Retries,
    ShutdownNotifications,
    TimeLimit,
)

from .settings import Settings

log = logging.getLogger("lsa.jobs")

QUEUES = ("bound", "training")


class JobQueue:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # No Retries: a failure is recorded in the job row; a crash is recovered from the row.
        middleware = [AgeLimit(), TimeLimit(), ShutdownNotifications(), Callbacks(),
                      Pipelines(), Retries(max_retries=0)]
        self.broker: dramatiq.Broker
        if settings.redis_url:
            # dramatiq's RedisBroker.__init__ has no annotations.
            self.broker = RedisBroker(  # type: ignore[no-untyped-call]
                url=settings.redis_url, namespace=settings.redis_namespace,
                middleware=middleware)
        else:
            self.broker = StubBroker(middleware=middleware)
        self._run: Callable[[str], None] | None = None
        self.actors: dict[str, dramatiq.Actor[Any, Any]] = {}
        for queue in QUEUES:
            self.actors[queue] = dramatiq.actor(
                broker=self.broker, actor_name=f"lsa_run_job_{queue}",
                queue_name=queue, max_retries=0,
                # Explicit per queue: Dramatiq's default of 10 minutes would kill training.
                time_limit=int(settings.time_limit_s(queue) * 1000))(self._dispatch)
        self.worker: dramatiq.Worker | None = None
        self._reaper: _Reaper | None = None

    def _dispatch(self, job_id: str) -> None:
        if self._run is None:
            raise RuntimeError("a job message arrived before start_worker")
        self._run(job_id)

    @property
    def embedded(self) -> bool:
        return self.settings.redis_url is None

    def enqueue(self, job_id: str, queue: str) -> None:
        self.actors[queue].send(job_id)

    def start_worker(self, run: Callable[[str], None], recover: Callable[[], object],
                     queues: set[str] | None = None) -> dramatiq.Worker:
        """Consume `queues` (default all) on threads of this process with `run(job_id)`;
        call `recover()` every LSA_JOB_STALE_AFTER_S / 4 seconds."""
        unknown = set(queues or ()) - set(QUEUES)
        if unknown:
            raise ValueError(f"unknown queue(s) {', '.join(sorted(unknown))}; use "
                             f"{', '.join(QUEUES)}")
        self._run = run
        self.broker.emit_after("process_boot")
        worker = dramatiq.Worker(self.broker, queues=queues,
                                 worker_threads=self.settings.worker_threads,
                                 worker_timeout=100 if self.embedded else 1000)
        worker.start()
        self.worker = worker
        # A quarter: a dead worker's jobs run again within 1.25x the setting, plus their work.
        self._reaper = _Reaper(recover, self.settings.job_stale_after_s / 4)
        self._reaper.start()
        return worker

    def ping(self) -> str:
        if self.embedded:
            if self.worker is None:
                raise RuntimeError("the in-process worker is not running")
            return "in-process"
        assert isinstance(self.broker, RedisBroker)
        self.broker.client.ping()
        return "redis"

    def close(self) -> None:
        if self._reaper is not None:
            self._reaper.stopped.set()
        if self.worker is not None:
            self.worker.stop(timeout=2000)
            self.worker = None
        self.broker.close()


class _Reaper(threading.Thread):
    """Runs the recovery pass periodically: jobs whose worker went silent, and queued jobs
    whose message a dead worker held, are sent again while this worker keeps going."""

    def __init__(self, recover: Callable[[], object], interval_s: float) -> None:
        super().__init__(name="lsa-job-reaper", daemon=True)
        self.recover = recover
        self.interval_s = interval_s
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                self.recover()
            except Exception:
                log.warning("job recovery pass failed", exc_info=True)
