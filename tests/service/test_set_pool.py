"""Deciding a set in worker processes (service.robustness.set_pool): the verdicts are the library's
serial ones (lsa_models.engine.routes.at_radius.decide_all), forked from a single-threaded caller or
from a forkserver beside other threads; a consumer that stops early ends the workers."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.local_models import build, center, export
from lsa_models.engine.routes import at_radius
from lsa_models.engine.routes.at_radius import decide_all
from lsa_models.onnx import OnnxModel, load_onnx
from service.robustness import set_pool
from service.tasks import SET_WORKERS_PRELOAD


def _label(om: OnnxModel, x0: np.ndarray) -> int:
    with torch.no_grad():
        return int(om.module.with_dtype(torch.float64)(torch.from_numpy(x0)).argmax())


def _same(a: at_radius.Verdict, b: at_radius.Verdict) -> bool:
    """Equal verdicts up to their wall-clock seconds (flips compared entry by entry)."""
    return replace(a, seconds=0.0) == replace(b, seconds=0.0) and (
        a.flip is None and b.flip is None
        or a.flip is not None and b.flip is not None and np.array_equal(a.flip, b.flip))


def test_the_forkserver_preloads_the_pool_module() -> None:
    """service.tasks names the preload without importing torch; it is the pool's."""
    assert SET_WORKERS_PRELOAD == set_pool.FORKSERVER_PRELOAD == ["service.robustness.set_pool"]


def test_the_library_decides_a_set_serially() -> None:
    """lsa_models.engine.routes.at_radius keeps no execution policy: no worker count, no pool."""
    import inspect

    assert "workers" not in inspect.signature(decide_all).parameters
    assert not hasattr(at_radius, "ProcessPoolExecutor") and not hasattr(at_radius, "mp")


def test_decide_all_in_worker_processes_gives_the_serial_verdicts(tmp_path: Path) -> None:
    """workers > 1: every verdict (status, route, margin, flip point) is the serial one,
    reported in the inputs' order; workers < 1 is refused. On tf1 at an inf radius where the
    set has certified, attacked and unknown inputs."""
    net = build("tf1", seed=0)
    om = load_onnx(export(net, tmp_path / "tf1.onnx").read_bytes())
    xs = np.stack([center(s).numpy().astype(np.float64)[0] for s in range(1, 7)])
    labels = np.array([_label(om, x[None]) for x in xs])
    serial_counts: list[tuple[int, int]] = []
    serial = decide_all(om, xs, labels, "inf", 0.03,
                        decided=lambda k, n: serial_counts.append((k, n)))
    assert serial_counts == [(k, 6) for k in range(1, 7)]
    seen: list[int] = []
    forked = set_pool.decide_all(om, xs, labels, "inf", 0.03, workers=3,
                        progress=lambda i, n, v: seen.append(i))
    assert seen == list(range(6))
    assert {v.status for v in serial.verdicts} >= {"certified", "attacked"}
    assert all(_same(a, b) for a, b in zip(serial.verdicts, forked.verdicts, strict=True))
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        set_pool.decide_all(om, xs, labels, "inf", 0.03, workers=0)
    # From a process with other threads (a server, a job worker) the workers come from a
    # forkserver, never forked from it, and the graph goes to them pickled: the same verdicts.
    methods: list[str] = []
    real = set_pool._in_processes

    def spy(*args: Any) -> Any:
        methods.append(args[7])  # the start method
        return real(*args)

    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        counts: list[int] = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(set_pool, "_in_processes", spy)
            served = set_pool.decide_all(om, xs, labels, "inf", 0.03, workers=2,
                                decided=lambda k, n: counts.append(k))
    finally:
        stop.set()
        other.join()
    assert methods == ["forkserver"]
    # `decided` counts the inputs as they finish, in any order: up to all six
    assert counts == sorted(set(counts)) and counts[-1] == 6 and counts[0] >= 1
    assert all(_same(a, b) for a, b in zip(serial.verdicts, served.verdicts, strict=True))


def test_decide_all_workers_end_when_the_consumer_stops(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer that stops after the first verdict (a cancelled job) ends every worker
    process then: a worker still deciding an input is killed, not left to finish it (forked
    workers whose `decide` sleeps a minute on every input but the first); from a forkserver,
    on tf1's real decisions, every worker has ended when close() returns."""
    pools: list[Any] = []

    class Recorded(set_pool.ProcessPoolExecutor):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            pools.append(self)

    monkeypatch.setattr(set_pool, "ProcessPoolExecutor", Recorded)
    net = build("tf1", seed=0)
    om = load_onnx(export(net, tmp_path / "tf1.onnx").read_bytes())
    xs = np.stack([center(s).numpy().astype(np.float64)[0] for s in range(1, 9)])
    jobs = [(x, _label(om, x[None])) for x in xs]
    real = at_radius.decide

    def slow(model: Any, x: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        if not np.array_equal(x, xs[0]):
            time.sleep(60)
        return real(model, x, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(at_radius, "decide", slow)  # forked workers inherit it
        start = time.monotonic()
        verdicts = set_pool._in_processes(om, jobs, "inf", 0.03, 0, True, 2, "fork")
        assert next(verdicts).status in ("certified", "attacked", "unknown")
        procs = list(pools[-1]._processes.values())
        assert len(procs) == 2 and all(p.is_alive() for p in procs)
        verdicts.close()
        assert time.monotonic() - start < 45  # not after the sleeping inputs
        # the pool's manager thread reaps the killed workers too: their exit codes may land
        # a moment after close() returns
        deadline = time.monotonic() + 10
        while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        # killed by a signal, both busy
        assert all(p.exitcode is not None and p.exitcode < 0 for p in procs), \
            [p.exitcode for p in procs]
        assert set_pool._WORKER_MODEL == []

    verdicts = set_pool._in_processes(om, jobs, "inf", 0.03, 0, True, 2, "forkserver")
    assert next(verdicts).status in ("certified", "attacked", "unknown")
    procs = list(pools[-1]._processes.values())
    verdicts.close()
    # ended (a worker between two inputs may take the shutdown and exit normally)
    deadline = time.monotonic() + 10
    while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(p.exitcode is not None for p in procs), [p.exitcode for p in procs]
