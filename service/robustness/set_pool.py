"""Deciding a set of inputs in worker processes: the execution policy of the service's set
jobs (LSA_SET_WORKERS) and the CLI's `--workers`. The library (lsa_models.engine.routes.at_radius)
decides serially and purely (`decide`, `decide_all`); this module chooses processes and how
they start, and gives the same SetReport: each input's verdict is the one `decide` gives
alone (the attack is seeded per input), so the verdicts do not depend on the workers.

Importing this module imports torch: the service imports it inside the functions that decide
a set, and the forkserver preloads it (service.tasks.SET_WORKERS_PRELOAD).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any

import numpy as np
import torch

from lsa_models.engine.routes import at_radius
from lsa_models.engine.routes.at_radius import SetReport, Verdict, gather_set, prepare_set
from lsa_models.engine.routes.budget import check_time_budget
from lsa_models.onnx.loading import OnnxModel

# The modules a forkserver imports once, before it forks the workers: a worker starts in
# milliseconds instead of importing torch (seconds).
FORKSERVER_PRELOAD = ["service.robustness.set_pool"]


def decide_all(model: Any, inputs: np.ndarray, labels: np.ndarray, norm: str, radius: float,
               progress: Callable[[int, int, Verdict], None] | None = None, *,
               seed: int = 0, sweep: bool = True, workers: int = 1,
               decided: Callable[[int, int], None] | None = None,
               time_budget: float | None = None) -> SetReport:
    """lsa_models.engine.routes.at_radius.decide_all, with `workers` > 1 deciding the inputs in that
    many processes (`start_method`: forked from a single-threaded caller, else from a
    forkserver); for one input, one worker, or where no process can be started, the
    library's serial loop. `progress(i, n, verdict)` in the inputs' order; `decided(k, n)`
    as the count of inputs decided grows, in any order (a slow input holds `progress` back,
    not `decided`), both on the caller's thread. `time_budget`: each input's, counted in
    the process deciding it from the moment it starts on it. ValueError for workers < 1 and
    for what the library refuses."""
    if not (isinstance(workers, int) and workers >= 1):
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    check_time_budget(time_budget)
    method = None if workers == 1 or np.asarray(labels).shape[:1] == (1,) else start_method()
    if method is None:
        return at_radius.decide_all(model, inputs, labels, norm, radius, progress, seed=seed,
                                    sweep=sweep, decided=decided, time_budget=time_budget)
    t0 = time.monotonic()
    om, jobs = prepare_set(model, inputs, labels)
    verdicts = _in_processes(om, jobs, norm, radius, seed, sweep, min(workers, len(jobs)),
                             method, decided, time_budget)
    return gather_set(norm, radius, verdicts, len(jobs), t0, sweep, progress,
                      time_budget=time_budget)


def start_method() -> str | None:
    """How `decide_all` starts its workers: forked where this process runs one thread (the
    CLI: the workers inherit the graph), else from a forkserver (a server's or a job
    worker's threads may hold locks at the moment of a fork, which the child would inherit
    held: the forkserver is a fresh single-threaded process, started once, that forks them),
    spawned where neither exists; None: no processes on this platform."""
    methods = mp.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return "fork"
    for method in ("forkserver", "spawn"):
        if method in methods:
            return method
    return None


_WORKER_MODEL: list[OnnxModel] = []  # the graph a worker decides with


def _worker_start(om: OnnxModel | None = None) -> None:
    # as torch's DataLoader workers: one thread per process (a forked child's OpenMP pool is
    # not carried over the fork; the parent's setting anyway)
    torch.set_num_threads(1)
    if om is not None:  # a forkserver's or spawned worker: the graph came in pickled
        _WORKER_MODEL[:] = [om]


def _decide_in_worker(x: np.ndarray, label: int, norm: str, radius: float, seed: int,
                      sweep: bool, time_budget: float | None = None) -> Verdict:
    return at_radius.decide(_WORKER_MODEL[0], x, label, norm, radius, seed=seed, sweep=sweep,
                            time_budget=time_budget)


def _in_processes(om: OnnxModel, jobs: list[tuple[np.ndarray, int]], norm: str,
                  radius: float, seed: int, sweep: bool, workers: int, method: str,
                  decided: Callable[[int, int], None] | None = None,
                  time_budget: float | None = None) -> Iterator[Verdict]:
    """The verdicts of `jobs` from `workers` processes, yielded in the jobs' order as soon as
    each and those before it are done; `decided(k, n)` (on the consumer's thread) each time
    k of them are done, in any order. Forked workers inherit the loaded graph (nothing is
    pickled into them but the inputs); the others get it pickled once each, from this
    process (never from a file). A consumer that stops early (a cancelled job, an error)
    ends the workers at once rather than after the inputs they are deciding."""
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    if method == "fork":
        _WORKER_MODEL[:] = [om]
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_start,
                               initargs=(None if method == "fork" else om,))
    done = False
    try:
        futures = [pool.submit(_decide_in_worker, x, y, norm, radius, seed, sweep,
                               time_budget) for x, y in jobs]
        # while some input is left to yield, the next in order is not done, so one is pending
        pending, i = set(futures), 0
        while i < len(futures):
            _, pending = wait(pending, return_when=FIRST_COMPLETED)
            if decided is not None:
                decided(len(futures) - len(pending), len(futures))
            while i < len(futures) and futures[i].done():
                yield futures[i].result()
                i += 1
        done = True
    finally:
        if not done:
            # Python 3.14's terminate_workers(); before it the pool's own process table
            procs = list((getattr(pool, "_processes", None) or {}).values())
            pool.shutdown(wait=False, cancel_futures=True)
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.join(timeout=5)
        pool.shutdown(wait=True)
        if method == "fork":
            _WORKER_MODEL.clear()
