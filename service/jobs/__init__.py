"""Background jobs: the registry of job kinds, the runner, the Dramatiq queue."""

from . import bound as _bound  # noqa: F401  (registers the `bound` job kind)
from . import training as _training  # noqa: F401  (registers `train_certified`)
from .registry import JOB_KINDS, QUEUES, JobKind, get_job_kind, register_job_kind
from .runner import JobAborted, JobContext, cancel_job, recover_jobs, run_job, submit_job

__all__ = ["JOB_KINDS", "QUEUES", "JobAborted", "JobContext", "JobKind", "cancel_job",
           "get_job_kind", "recover_jobs", "register_job_kind", "run_job", "submit_job"]
