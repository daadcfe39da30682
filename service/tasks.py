"""Every job handler module, imported here for its registration (one place, as Polar's
tasks module), and the start of a consuming worker: `lsa serve`'s in-process one and
`lsa worker`'s."""

from __future__ import annotations

import functools

import dramatiq

from .jobs import bound as bound_jobs
from .jobs import robustness as robustness_jobs
from .jobs import training as training_jobs
from .jobs.registry import JOB_KINDS
from .jobs.runner import recover_jobs, run_job
from .runtime import Runtime

HANDLER_MODULES = (bound_jobs, robustness_jobs, training_jobs)


def start_worker(runtime: Runtime, queues: set[str] | None = None) -> dramatiq.Worker:
    """Consume `queues` (default all) on threads of this process. First send again what an
    earlier process left behind; then keep doing so periodically (stale running jobs, and
    queued jobs whose message a dead worker held)."""
    assert {"bound", "robustness", "train_certified"} <= set(JOB_KINDS)
    worker = runtime.queue.start_worker(
        functools.partial(run_job, runtime),
        functools.partial(recover_jobs, runtime, all_running=False, resend_queued=False),
        queues)
    # Embedded: this process is the only worker, so any job left running is orphaned.
    recover_jobs(runtime, all_running=runtime.queue.embedded)
    return worker
