"""Background jobs: the registry of job kinds, the job context, the runner and `GET /jobs`
(routes). Each domain's handler module (`bounds.jobs`, `robustness.jobs`, `training.jobs`)
registers its kinds on import; `service.tasks` imports them all. The broker plumbing is
`service.broker`."""

from ..broker import QUEUES
from .context import JobAborted, JobContext
from .registry import JOB_KINDS, JobKind, get_job_kind, register_job_kind
from .runner import cancel_job, recover_jobs, run_job, submit_job

__all__ = ["JOB_KINDS", "QUEUES", "JobAborted", "JobContext", "JobKind", "cancel_job",
           "get_job_kind", "recover_jobs", "register_job_kind", "run_job", "submit_job"]
