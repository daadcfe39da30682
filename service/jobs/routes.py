"""GET /jobs/{id} (status, progress, result) and DELETE /jobs/{id} (cancel)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from api_schemas.jobs import JobAccepted, JobOut

from ..deps import ReadAccess, RuntimeDep, WriteAccess, in_thread
from ..errors import responses
from ..tables import ACTIVE_JOB_STATUSES, Job
from .runner import cancel, job_status

router = APIRouter(tags=["jobs"])

# Seconds a client should wait between polls of an active job, by queue (Retry-After).
POLL_AFTER_S = {"bound": 1, "training": 5}


def poll_after(queue: str) -> str:
    return str(POLL_AFTER_S.get(queue, 1))


def accepted_response(accepted: JobAccepted, queue: str) -> JSONResponse:
    """The one 202 of every endpoint that queues work: the job's id, status and URL, with
    Location and Retry-After headers."""
    url = f"/jobs/{accepted.job_id}"
    body = accepted.model_copy(update={"url": url}).model_dump(mode="json")
    return JSONResponse(body, status_code=202,
                        headers={"Location": url, "Retry-After": poll_after(queue)})


def job_out(job: Job) -> JobOut:
    return JobOut(id=job.id, kind=job.kind, queue=job.queue, status=job.status,  # type: ignore[arg-type]
                  progress=job.progress, stage=job.stage, result=job.result, error=job.error,
                  attempts=job.attempts, created_at=job.created_at, started_at=job.started_at,
                  finished_at=job.finished_at)


@router.get("/jobs/{job_id}", response_model=JobOut, dependencies=[ReadAccess],
            summary="A job's status, progress and result", responses=responses(404))
@in_thread
def read_job(job_id: str, runtime: RuntimeDep, response: Response) -> JobOut:
    job = job_status(runtime, job_id)
    if job.status in ACTIVE_JOB_STATUSES:
        response.headers["Retry-After"] = poll_after(job.queue)
    return job_out(job)


@router.delete("/jobs/{job_id}", response_model=JobOut, dependencies=[WriteAccess],
               summary="Cancel a queued or running job", responses=responses(404, 409))
@in_thread
def delete_job(job_id: str, runtime: RuntimeDep) -> JobOut:
    return job_out(cancel(runtime, job_id))
