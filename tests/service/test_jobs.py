"""The job machinery: row as source of truth, enqueue after commit, progress, cancellation,
per-queue time limits, recovery of jobs a dead worker left behind (run once, one result)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel
from sqlalchemy import update

from service.app import create_app
from service.db import transaction
from service.jobs import JobContext, JobKind, register_job_kind, run_job, submit_job
from service.jobs.runner import _finish
from service.runtime import Runtime
from service.settings import Settings
from service.tables import Job, utcnow

from .conftest import upload

RUNS: Counter[str] = Counter()
RUNS_LOCK = threading.Lock()


class WaitParams(BaseModel):
    steps: int
    sleep_s: float = 0.01
    fail: str | None = None


def run_wait(ctx: JobContext) -> dict[str, Any]:
    p = WaitParams.model_validate(ctx.params)
    with RUNS_LOCK:
        RUNS[ctx.job_id] += 1
    for i in range(p.steps):
        ctx.progress(i / p.steps, f"step {i}")
        time.sleep(p.sleep_s)
    if p.fail:
        raise ValueError(p.fail)
    return {"steps": p.steps}


register_job_kind(JobKind("test_wait", queue="bound", handler=run_wait,
                          params_schema=WaitParams))


def submit(rt: Runtime, **params: Any) -> str:
    with transaction(rt.sessions) as s:
        return submit_job(s, rt, "test_wait", params).id


def job_row(rt: Runtime, job_id: str) -> Job:
    with rt.sessions() as s:
        job = s.get(Job, job_id)
        assert job is not None
        return job


def wait_for(rt: Runtime, job_id: str, pred: Callable[[Job], bool],
             timeout: float = 20.0) -> Job:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = job_row(rt, job_id)
        if pred(job):
            return job
        time.sleep(0.02)
    raise AssertionError(f"job {job_id} stuck: {job_row(rt, job_id).status}")


@pytest.fixture
def app_client(client: TestClient) -> Iterator[tuple[TestClient, Runtime]]:
    yield client, client.app.state.runtime  # type: ignore[attr-defined]


@pytest.fixture
def idle_runtime(db_url: str, make_settings: Callable[..., Settings]) -> Iterator[Runtime]:
    """A runtime with no worker: jobs stay queued."""
    rt = Runtime(make_settings(db_url))
    yield rt
    rt.close()


def test_jobs_run_in_process_with_progress(app_client: tuple[TestClient, Runtime]) -> None:
    c, rt = app_client
    job_id = submit(rt, steps=20, sleep_s=0.02)
    seen = wait_for(rt, job_id, lambda j: j.status == "running" and j.progress > 0)
    assert seen.stage is not None and seen.stage.startswith("step")
    done = wait_for(rt, job_id, lambda j: j.status == "succeeded")
    body = c.get(f"/jobs/{job_id}").json()
    assert body["status"] == "succeeded" and body["progress"] == 1.0
    assert body["result"] == {"steps": 20} and body["attempts"] == 1
    assert done.finished_at is not None and RUNS[job_id] == 1


def test_jobs_enqueued_only_after_commit(idle_runtime: Runtime) -> None:
    rt = idle_runtime
    sent: list[str] = []
    rt.queue.enqueue = lambda job_id, queue: sent.append(job_id)  # type: ignore[method-assign]
    with pytest.raises(RuntimeError), transaction(rt.sessions) as s:
        submit_job(s, rt, "test_wait", {"steps": 1})
        assert sent == []
        raise RuntimeError("rolled back")
    assert sent == []
    job_id = submit(rt, steps=1)
    assert sent == [job_id]


def test_jobs_cancel_running_stops_it(app_client: tuple[TestClient, Runtime]) -> None:
    c, rt = app_client
    job_id = submit(rt, steps=500, sleep_s=0.01)
    wait_for(rt, job_id, lambda j: j.status == "running" and j.progress > 0)
    r = c.delete(f"/jobs/{job_id}")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    time.sleep(0.3)
    job = job_row(rt, job_id)
    assert job.status == "cancelled" and job.result is None and job.progress < 1
    r = c.delete(f"/jobs/{job_id}")
    assert r.status_code == 409 and "already cancelled" in r.json()["detail"]


def test_jobs_cancel_queued_never_runs(idle_runtime: Runtime, db_url: str,
                                       make_settings: Callable[..., Settings]) -> None:
    rt = idle_runtime
    job_id = submit(rt, steps=1)
    app = create_app(make_settings(db_url))
    c = TestClient(app)  # no lifespan: no worker
    assert c.delete(f"/jobs/{job_id}").json()["status"] == "cancelled"
    run_job(rt, job_id)  # a late message for it
    assert job_row(rt, job_id).status == "cancelled" and RUNS[job_id] == 0


def test_jobs_failure_is_recorded(app_client: tuple[TestClient, Runtime]) -> None:
    _, rt = app_client
    job_id = submit(rt, steps=1, fail="bad parameters: steps")
    job = wait_for(rt, job_id, lambda j: j.status == "failed")
    assert job.error == "bad parameters: steps" and job.result is None


def test_jobs_time_limit_is_per_queue(db_url: str,
                                      make_settings: Callable[..., Settings]) -> None:
    app = create_app(make_settings(db_url, bound_time_limit_s=0.3))
    with TestClient(app):
        rt: Runtime = app.state.runtime
        assert rt.queue.actors["bound"].options["time_limit"] == 300
        assert rt.queue.actors["training"].options["time_limit"] == 48 * 3600 * 1000
        job_id = submit(rt, steps=400, sleep_s=0.01)
        job = wait_for(rt, job_id, lambda j: j.status == "failed")
        assert "time limit exceeded: 0.3 s on queue 'bound'" in (job.error or "")


def test_jobs_left_running_by_a_dead_worker_finish_once(
        db_url: str, make_settings: Callable[..., Settings], idle_runtime: Runtime) -> None:
    rt = idle_runtime
    job_id = submit(rt, steps=3)
    # What a worker killed mid-run leaves behind: claimed, running, heartbeat gone quiet.
    with transaction(rt.sessions) as s:
        s.execute(update(Job).where(Job.id == job_id).values(
            status="running", attempts=1, progress=0.5, stage="step 1",
            heartbeat_at=utcnow() - timedelta(hours=1)))
    app = create_app(make_settings(db_url))
    with TestClient(app) as c:
        rt2: Runtime = app.state.runtime
        wait_for(rt2, job_id, lambda j: j.status == "succeeded")
        body = c.get(f"/jobs/{job_id}").json()
    assert body["attempts"] == 2 and body["result"] == {"steps": 3}
    assert RUNS[job_id] == 1
    # The dead attempt can never overwrite the outcome.
    assert not _finish(rt, job_id, 1, status="failed", error="late")
    assert job_row(rt, job_id).status == "succeeded"


def test_jobs_stale_heartbeat_recovered_by_reaper_only_when_stale(
        db_url: str, make_settings: Callable[..., Settings]) -> None:
    from service.jobs import recover_jobs

    rt = Runtime(make_settings(db_url, job_stale_after_s=30))
    sent: list[str] = []
    rt.queue.enqueue = lambda job_id, queue: sent.append(job_id)  # type: ignore[method-assign]
    try:
        fresh, stale = submit(rt, steps=1), submit(rt, steps=1)
        sent.clear()
        with transaction(rt.sessions) as s:
            s.execute(update(Job).where(Job.id == fresh).values(
                status="running", attempts=1, heartbeat_at=utcnow()))
            s.execute(update(Job).where(Job.id == stale).values(
                status="running", attempts=1, heartbeat_at=utcnow() - timedelta(minutes=5)))
        recover_jobs(rt, all_running=False, resend_queued=False)
        assert sent == [stale]
        assert job_row(rt, fresh).status == "running"
        assert job_row(rt, stale).status == "queued"
    finally:
        rt.close()


def test_jobs_queued_message_held_too_long_is_sent_again_once(
        db_url: str, make_settings: Callable[..., Settings]) -> None:
    from service.jobs import recover_jobs

    rt = Runtime(make_settings(db_url, job_stale_after_s=30))
    sent: list[str] = []
    rt.queue.enqueue = lambda job_id, queue: sent.append(job_id)  # type: ignore[method-assign]
    try:
        fresh, held = submit(rt, steps=1), submit(rt, steps=1)
        sent.clear()
        # `held`: its message went to a worker that died before claiming it.
        with transaction(rt.sessions) as s:
            s.execute(update(Job).where(Job.id == held).values(
                enqueued_at=utcnow() - timedelta(minutes=5)))
        recover_jobs(rt, all_running=False, resend_queued=False)
        assert sent == [held]
        # Sent again now: the next pass leaves it alone until it is stale again.
        recover_jobs(rt, all_running=False, resend_queued=False)
        assert sent == [held]
        assert job_row(rt, fresh).status == job_row(rt, held).status == "queued"
    finally:
        rt.close()


def test_jobs_queued_before_a_restart_run_once_after_it(
        db_url: str, make_settings: Callable[..., Settings], idle_runtime: Runtime) -> None:
    # Queued while no worker ran (the in-memory queue of a server that then stopped).
    ids = [submit(idle_runtime, steps=2) for _ in range(3)]
    app = create_app(make_settings(db_url))
    with TestClient(app):
        rt2: Runtime = app.state.runtime
        for job_id in ids:
            job = wait_for(rt2, job_id, lambda j: j.status == "succeeded")
            assert job.attempts == 1
    assert [RUNS[job_id] for job_id in ids] == [1, 1, 1]


def test_bound_empirical_is_a_job_and_identical_requests_share_it(
        db_url: str, make_settings: Callable[..., Settings], model_bytes: bytes) -> None:
    app = create_app(make_settings(db_url))
    c = TestClient(app)  # no lifespan: the job stays queued
    m = upload(c, model_bytes)
    req = {"model_id": m["id"], "norm": "2", "seq_len": 4,
           "empirical": {"restarts": 1, "steps": 2, "seed": 3, "time_budget_s": 5}}
    r = c.post("/bound", json=req)
    assert r.status_code == 202 and r.json()["status"] == "queued"
    again = c.post("/bound", json=req)
    assert again.status_code == 202 and again.json()["job_id"] == r.json()["job_id"]
    other = c.post("/bound", json={**req, "empirical": {**req["empirical"], "seed": 4}})
    assert other.json()["job_id"] != r.json()["job_id"]
    job = c.get(f"/jobs/{r.json()['job_id']}").json()
    assert job["kind"] == "bound" and job["queue"] == "bound"
    huge = c.post("/bound", json={**req, "seq_len": 10**6})
    assert huge.status_code == 422 and "LSA_MAX_EMPIRICAL_ELEMENTS" in huge.json()["detail"]
    app.state.runtime.close()


def test_worker_refuses_without_redis() -> None:
    from typer.testing import CliRunner

    from service.cli import app as cli_app

    r = CliRunner().invoke(cli_app, ["worker"], env={"LSA_REDIS_URL": "",
                                                     "LSA_DATABASE_URL": "sqlite://"})
    assert r.exit_code == 2 and "LSA_REDIS_URL is not set" in r.output


def test_jobs_cancel_stops_a_real_bound_search(app_client: tuple[TestClient, Runtime],
                                               model_bytes: bytes) -> None:
    c, rt = app_client
    m = upload(c, model_bytes)
    slow = {"model_id": m["id"], "norm": "2", "seq_len": 8,
            "empirical": {"restarts": 50, "steps": 100000, "seed": 1, "time_budget_s": 600}}
    job_id = c.post("/bound", json=slow).json()["job_id"]
    wait_for(rt, job_id, lambda j: j.status == "running" and j.progress > 0.1)
    assert c.delete(f"/jobs/{job_id}").json()["status"] == "cancelled"
    # One worker thread: the next job can only run once the cancelled search has stopped.
    nxt = submit(rt, steps=1)
    wait_for(rt, nxt, lambda j: j.status == "succeeded", timeout=15)
    job = job_row(rt, job_id)
    assert job.status == "cancelled" and job.result is None
