"""Background jobs: the job row as the API shows it."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]

JOB_EXAMPLE: dict[str, Any] = {
    "id": "5d1f0a52-8d0c-4b53-9d5e-2f6b1f1c2a10",
    "kind": "bound",
    "queue": "bound",
    "status": "running",
    "progress": 0.4,
    "stage": "empirical: restart 2/5",
    "result": None,
    "error": None,
    "attempts": 1,
    "created_at": "2026-12-02T12:00:00Z",
    "started_at": "2026-12-02T12:00:01Z",
    "finished_at": None,
}


class JobAccepted(BaseModel):
    """202: the work was queued; poll GET /jobs/{job_id} (the `url`; the response's Location
    header too), waiting the Retry-After seconds between polls."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"job_id": JOB_EXAMPLE["id"], "status": "queued",
                                         "url": f"/jobs/{JOB_EXAMPLE['id']}"}]},
    )

    job_id: str
    status: JobStatus
    url: str | None = Field(default=None, description="The job: GET it for status, progress "
                            "and, once succeeded, the result")


class JobOut(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [JOB_EXAMPLE]})

    id: str
    kind: str = Field(description="What the job does, e.g. bound")
    queue: str = Field(description="Worker queue: bound or training")
    status: JobStatus
    progress: float = Field(ge=0, le=1, description="Fraction done, 0..1")
    stage: str | None = Field(default=None, description="What the job is doing now")
    result: dict[str, Any] | None = Field(
        default=None, description="On success: the job's output (a bound job: the "
        "BoundReport; a robustness job: the Certificate; train_certified: the training result)")
    error: str | None = Field(default=None, description="On failure: what went wrong")
    attempts: int = Field(description="Times a worker picked the job up (>1 after a crash)")
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
