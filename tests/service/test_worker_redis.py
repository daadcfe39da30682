"""`lsa worker` processes consuming from the real Redis: queue selection, the job result,
and a worker killed mid-job whose job another worker finishes (one result)."""

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
from service.tables import BoundResultRow

from .conftest import tiny_model_bytes, upload
from .procs import kill, poll_job, start, stop

pytestmark = pytest.mark.redis


@pytest.fixture
def redis_env(redis_url: str, tmp_path: Path) -> Iterator[dict[str, str]]:
    import redis

    namespace = f"lsa-test-{uuid.uuid4().hex[:10]}"
    url = f"sqlite:///{tmp_path / 'lsa.db'}"
    upgrade(url)
    env = {"LSA_DATABASE_URL": url, "LSA_REDIS_URL": redis_url,
           "LSA_REDIS_NAMESPACE": namespace, "LSA_ARTIFACT_DIR": str(tmp_path / "artifacts"),
           "LSA_SIGNING_KEY_PATH": str(tmp_path / "key.pem"), "LSA_JOB_STALE_AFTER_S": "6"}
    yield env
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(f"{namespace}*"))
    if keys:
        client.delete(*keys)
    client.close()


def test_worker_redis_queues_results_and_crash(redis_env: dict[str, str],
                                               tmp_path: Path) -> None:
    settings = Settings(database_url=redis_env["LSA_DATABASE_URL"],
                        redis_url=redis_env["LSA_REDIS_URL"],
                        redis_namespace=redis_env["LSA_REDIS_NAMESPACE"],
                        artifact_dir=Path(redis_env["LSA_ARTIFACT_DIR"]),
                        signing_key_path=Path(redis_env["LSA_SIGNING_KEY_PATH"]),
                        migrate_on_start=False, job_stale_after_s=6)
    app = create_app(settings)
    log = tmp_path / "worker.log"
    workers = []
    with TestClient(app) as c:
        assert c.get("/readyz").json()["checks"]["broker"] == "redis"
        m = upload(c, tiny_model_bytes(seed=31, d_model=16, n_layers=2))
        quick = {"model_id": m["id"], "norm": "2", "seq_len": 8,
                 "empirical": {"restarts": 1, "steps": 5, "seed": 1, "time_budget_s": 30}}
        job_id = c.post("/bound", json=quick).json()["job_id"]
        try:
            # A training-only worker (a GPU machine) leaves bound work alone.
            workers.append(start(["worker", "--queues", "training"], redis_env, tmp_path, log))
            deadline = time.monotonic() + 60
            while "consuming training" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(1.5)
            assert c.get(f"/jobs/{job_id}").json()["status"] == "queued"
            workers.append(start(["worker", "--queues", "bound"], redis_env, tmp_path, log))
            done = poll_job(c.get, job_id, lambda j: j["status"] in ("succeeded", "failed"))
            assert done["status"] == "succeeded", (done, log.read_text()[-2000:])
            assert done["result"]["lower"] is not None

            slow = {**quick, "empirical": {"restarts": 3, "steps": 100000, "seed": 2,
                                           "time_budget_s": 3}}
            slow_id = c.post("/bound", json=slow).json()["job_id"]
            poll_job(c.get, slow_id, lambda j: j["status"] == "running" and j["progress"] > 0.1)
            kill(workers[1])
            workers.append(start(["worker", "--queues", "bound"], redis_env, tmp_path, log))
            done = poll_job(c.get, slow_id, lambda j: j["status"] in ("succeeded", "failed"))
            assert done["status"] == "succeeded", (done, log.read_text()[-2000:])
            assert done["attempts"] == 2
        finally:
            for w in workers:
                stop(w)
        rt = app.state.runtime
        with rt.sessions() as s:
            assert s.scalar(select(func.count()).select_from(BoundResultRow)
                            .where(BoundResultRow.empirical.is_not(None))) == 2



def test_worker_redis_runs_a_robustness_job_signed_with_the_server_key(
        redis_env: dict[str, str], tmp_path: Path) -> None:
    import numpy as np

    from bench.local_models import build, center, export
    from service.tables import RobustnessResultRow

    from .test_robustness_api import predicted_label

    settings = Settings(database_url=redis_env["LSA_DATABASE_URL"],
                        redis_url=redis_env["LSA_REDIS_URL"],
                        redis_namespace=redis_env["LSA_REDIS_NAMESPACE"],
                        artifact_dir=Path(redis_env["LSA_ARTIFACT_DIR"]),
                        signing_key_path=Path(redis_env["LSA_SIGNING_KEY_PATH"]),
                        migrate_on_start=False, job_stale_after_s=6)
    app = create_app(settings)
    log = tmp_path / "worker.log"
    model = export(build("mlp", seed=uuid.uuid4().int % 2**31), tmp_path / "mlp.onnx")
    x0 = center(7).numpy().astype(np.float64)
    label = predicted_label(model, x0)
    with TestClient(app) as c:
        m = upload(c, model.read_bytes(), "mlp.onnx")
        req = {"model_id": m["id"], "norm": "2", "at": x0.tolist(), "label": label,
               "min_radius": 1e-9}
        r = c.post("/certify", json=req)
        assert r.status_code == 202, r.text
        worker = start(["worker", "--queues", "bound"], redis_env, tmp_path, log)
        try:
            done = poll_job(c.get, r.json()["job_id"],
                            lambda j: j["status"] in ("succeeded", "failed"))
        finally:
            stop(worker)
        assert done["status"] == "succeeded", (done, log.read_text()[-2000:])
        cert = done["result"]
        assert cert["passed"] is True and cert["robustness"]["certified_radius"] > 1e-9
        # Signed by the worker with the server's key; the radii are stored for the server.
        assert c.post("/certificates/verify", json=cert).json()["valid"] is True
        assert c.get(f"/certificates/{cert['id']}").json() == cert
        again = c.post("/certify", json={**req, "min_radius": 1.0})
        assert again.status_code == 201, again.text
        assert again.json()["robustness"]["certified_radius"] == \
            cert["robustness"]["certified_radius"]
        rt = app.state.runtime
        with rt.sessions() as s:
            assert s.scalar(select(func.count()).select_from(RobustnessResultRow)
                            .where(RobustnessResultRow.model_id == m["id"])) == 1
