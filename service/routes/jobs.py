"""GET /jobs/{id} (status, progress, result) and DELETE /jobs/{id} (cancel)."""

from __future__ import annotations

from fastapi import APIRouter

from api_schemas.jobs import JobOut

from ..deps import ReadAccess, ReadSessionDep, SessionDep, WriteAccess
from ..errors import NotFound, responses
from ..jobs.runner import cancel_job
from ..tables import Job

router = APIRouter(tags=["jobs"])


def job_out(job: Job) -> JobOut:
    return JobOut(id=job.id, kind=job.kind, queue=job.queue, status=job.status,  # type: ignore[arg-type]
                  progress=job.progress, stage=job.stage, result=job.result, error=job.error,
                  attempts=job.attempts, created_at=job.created_at, started_at=job.started_at,
                  finished_at=job.finished_at)


@router.get("/jobs/{job_id}", response_model=JobOut, dependencies=[ReadAccess],
            summary="A job's status, progress and result", responses=responses(404))
def read_job(job_id: str, session: ReadSessionDep) -> JobOut:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"no job with id {job_id}")
    return job_out(job)


@router.delete("/jobs/{job_id}", response_model=JobOut, dependencies=[WriteAccess],
               summary="Cancel a queued or running job", responses=responses(404, 409))
def delete_job(job_id: str, session: SessionDep) -> JobOut:
    return job_out(cancel_job(session, job_id))
