"""Every job handler module, imported here for its registration (one place, as Polar's
tasks module), and the start of a consuming worker: `lsa serve`'s in-process one and
`lsa worker`'s."""

from __future__ import annotations

import functools
import multiprocessing as mp
from multiprocessing import forkserver

import dramatiq

from .bounds import jobs as bound_jobs
from .jobs.registry import JOB_KINDS
from .jobs.runner import recover_jobs, run_job
from .robustness import jobs as robustness_jobs
from .runtime import Runtime
from .training import jobs as training_jobs

HANDLER_MODULES = (bound_jobs, robustness_jobs, training_jobs)
# service.robustness.set_pool.FORKSERVER_PRELOAD, named here so that starting the forkserver
# imports no torch into this process (a test pins the two equal)
SET_WORKERS_PRELOAD = ["service.robustness.set_pool"]


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
    if runtime.settings.set_processes > 1 and (queues is None or "bound" in queues):
        prepare_set_workers()
    return worker


def prepare_set_workers() -> bool:
    """Start the forkserver that set jobs fork their worker processes from (set_pool
    ._in_processes) now rather than in the first set job: its start is a fresh interpreter
    importing torch (seconds). Only spawns it (it preloads on its own): this process imports
    nothing, since importing torch on a second thread while a request imports it can fail
    ("partially initialized module"). False where there is no forkserver."""
    if "forkserver" not in mp.get_all_start_methods():
        return False
    mp.get_context("forkserver").set_forkserver_preload(SET_WORKERS_PRELOAD)
    forkserver.ensure_running()
    return True
