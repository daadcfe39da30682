"""No job stranded by a dead worker: PostgreSQL + Redis, two `lsa worker --queues bound`
processes, a burst of jobs, one worker SIGKILLed while it runs one job and holds others it
prefetched. Every job succeeds exactly once within twice LSA_JOB_STALE_AFTER_S."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.app import create_app
from service.db import upgrade
from service.settings import Settings
from service.tables import BoundResultRow, Job

from .conftest import PgSchemas, tiny_model_bytes, upload
from .procs import kill, start, stop

pytestmark = [pytest.mark.redis, pytest.mark.postgres]

STALE_S = 10.0
JOBS = 4


@pytest.fixture
def cluster_env(redis_url: str, pg_schemas: PgSchemas, tmp_path: Path) -> Iterator[dict[str, str]]:
    import redis

    namespace = f"lsa-test-{uuid.uuid4().hex[:10]}"
    url = pg_schemas.new()
    upgrade(url)
    env = {"LSA_DATABASE_URL": url, "LSA_REDIS_URL": redis_url,
           "LSA_REDIS_NAMESPACE": namespace, "LSA_ARTIFACT_DIR": str(tmp_path / "artifacts"),
           "LSA_SIGNING_KEY_PATH": str(tmp_path / "key.pem"),
           "LSA_JOB_STALE_AFTER_S": str(STALE_S), "LSA_WORKER_THREADS": "1"}
    yield env
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(f"{namespace}*"))
    if keys:
        client.delete(*keys)
    client.close()


def held_messages(redis_url: str, namespace: str) -> list[int]:
    """Per worker: messages it took from the queue and has not acknowledged yet."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        return sorted(int(client.scard(k)) for k in client.scan_iter(f"{namespace}:__acks__*"))
    finally:
        client.close()


def test_stranded_jobs_dead_worker_prefetched_jobs_run_once(cluster_env: dict[str, str],
                                                            tmp_path: Path) -> None:
    env = cluster_env
    settings = Settings(database_url=env["LSA_DATABASE_URL"], redis_url=env["LSA_REDIS_URL"],
                        redis_namespace=env["LSA_REDIS_NAMESPACE"],
                        artifact_dir=Path(env["LSA_ARTIFACT_DIR"]),
                        signing_key_path=Path(env["LSA_SIGNING_KEY_PATH"]),
                        migrate_on_start=False, job_stale_after_s=STALE_S)
    app = create_app(settings)
    rt = app.state.runtime
    logs = [tmp_path / "worker0.log", tmp_path / "worker1.log"]
    workers = []
    with TestClient(app) as c:
        m = upload(c, tiny_model_bytes(seed=41, d_model=16, n_layers=2))
        try:
            workers = [start(["worker", "--queues", "bound"], env, tmp_path, log) for log in logs]
            deadline = time.monotonic() + 90
            while not all("consuming bound" in log.read_text() for log in logs):
                assert time.monotonic() < deadline, [log.read_text()[-500:] for log in logs]
                time.sleep(0.2)
            ids = [c.post("/bound", json={
                "model_id": m["id"], "norm": "2", "seq_len": 8,
                "empirical": {"restarts": 1, "steps": 100000, "seed": i, "time_budget_s": 0.5},
            }).json()["job_id"] for i in range(JOBS)]
            # Both workers busy, each holding a prefetched message besides the one it runs.
            deadline = time.monotonic() + 60
            while True:
                with rt.read_sessions() as s:
                    running = s.scalar(select(func.count()).select_from(Job)
                                       .where(Job.status == "running"))
                held = held_messages(env["LSA_REDIS_URL"], env["LSA_REDIS_NAMESPACE"])
                if running == 2 and held == [2, 2]:
                    break
                assert time.monotonic() < deadline, (running, held)
                time.sleep(0.05)
            kill(workers[0])
            killed_at = time.monotonic()
            while True:
                with rt.read_sessions() as s:
                    rows = s.execute(select(Job.status, Job.attempts)
                                     .where(Job.id.in_(ids))).all()
                if all(status == "succeeded" for status, _ in rows):
                    break
                assert time.monotonic() - killed_at < 2 * STALE_S, (
                    rows, logs[1].read_text()[-1500:])
                time.sleep(0.1)
        finally:
            for w in workers:
                stop(w)
    with rt.read_sessions() as s:
        attempts = sorted(a for (a,) in s.execute(select(Job.attempts).where(Job.id.in_(ids))))
        results = s.scalar(select(func.count()).select_from(BoundResultRow)
                           .where(BoundResultRow.empirical.is_not(None)))
    # Exactly once: one stored result each; only the job the dead worker ran was claimed
    # twice (its prefetched ones were never claimed by it).
    assert results == JOBS
    assert attempts == [1] * (JOBS - 1) + [2], attempts
