"""Job kinds: a new kind is a handler function, a queue name and a params schema.

    register_job_kind(JobKind("train_invertible", queue="training",
                              handler=run_training, params_schema=TrainingParams))

The handler gets a `JobContext` (the params, progress reporting, the runtime) and returns the
job's JSON result. It must be safe to run again after a crash: look for its own earlier output
(e.g. by a request key) before redoing work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from ..broker import QUEUES
from .context import JobContext


@dataclass(frozen=True)
class JobKind:
    name: str
    queue: str
    handler: Callable[[JobContext], dict[str, Any]]
    params_schema: type[BaseModel]

    def __post_init__(self) -> None:
        if self.queue not in QUEUES:
            raise ValueError(f"job kind {self.name!r}: unknown queue {self.queue!r}; "
                             f"use one of {', '.join(QUEUES)}")


JOB_KINDS: dict[str, JobKind] = {}


def register_job_kind(kind: JobKind) -> JobKind:
    JOB_KINDS[kind.name] = kind
    return kind


def get_job_kind(name: str) -> JobKind:
    try:
        return JOB_KINDS[name]
    except KeyError:
        raise ValueError(f"unknown job kind {name!r}; known: {', '.join(sorted(JOB_KINDS))}") \
            from None
