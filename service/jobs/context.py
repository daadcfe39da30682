"""What a job handler gets: its params, progress reporting (the cancel check), sessions."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import update
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

from ..db import transaction
from ..runtime import Runtime
from ..tables import Job, utcnow

STAGE_MAX = 200


class JobAborted(Exception):
    """The job was cancelled (or re-claimed) while running: stop without writing."""


def rowcount(result: Any) -> int:
    """Rows an UPDATE touched (Session.execute is typed as returning a plain Result)."""
    assert isinstance(result, CursorResult)
    return int(result.rowcount)


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

    def fenced_write(self, **values: Any) -> None:
        """Write to the job row while this attempt still owns it; else JobAborted."""
        with self.session() as s:
            res = s.execute(
                update(Job)
                .where(Job.id == self.job_id, Job.attempts == self.attempt,
                       Job.status == "running")
                .values(heartbeat_at=utcnow(), **values))
            if rowcount(res) != 1:
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
        self.fenced_write(**values)
        self._last_write, self._last_stage = now, stage

    def check_cancelled(self) -> None:
        self.fenced_write()
