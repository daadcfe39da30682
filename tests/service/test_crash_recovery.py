"""A job whose server is killed mid-run finishes after a restart: nothing lost, one result.

Runs the real `lsa serve` (embedded SQLite, in-process worker) as a process and SIGKILLs it
while an empirical bound job is computing."""

from __future__ import annotations

from pathlib import Path

import httpx
from sqlalchemy import func, select

from service.db import make_engine, make_session_factory
from service.tables import BoundResultRow, Job

from .conftest import tiny_model_bytes
from .procs import free_port, kill, poll_job, start, stop, wait_http


def test_crash_recovery_server_killed_mid_job_finishes_once(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {"LSA_DATABASE_URL": f"sqlite:///{tmp_path / 'var' / 'lsa.db'}",
           "LSA_ARTIFACT_DIR": str(tmp_path / "var" / "artifacts"),
           "LSA_SIGNING_KEY_PATH": str(tmp_path / "var" / "key.pem"),
           "LSA_REDIS_URL": "", "LSA_AUTH_REQUIRED": "false"}
    log = tmp_path / "serve.log"
    args = ["serve", "--port", str(port), "--log-level", "warning"]
    server = start(args, env, tmp_path, log)
    try:
        wait_http(base, server, log)
        http = httpx.Client(base_url=base, timeout=30)
        data = tiny_model_bytes(seed=21, d_model=16, n_layers=2)
        model = http.post("/models", files={"file": ("m.safetensors", data)}).json()
        req = {"model_id": model["id"], "norm": "2", "seq_len": 16,
               "empirical": {"restarts": 3, "steps": 100000, "seed": 7, "time_budget_s": 12}}
        r = http.post("/bound", json=req)
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
        # The search runs for its whole 12 s budget: a loaded machine still catches it running.
        poll_job(http.get, job_id, lambda j: j["status"] == "running" and j["progress"] > 0.05)
        kill(server)

        server = start(args, env, tmp_path, log)
        wait_http(base, server, log)
        done = poll_job(http.get, job_id, lambda j: j["status"] in ("succeeded", "failed"))
        assert done["status"] == "succeeded", done
        assert done["attempts"] == 2
        report = done["result"]
        assert report["upper"] is not None and report["lower"] is not None
        assert report["lower"] <= report["upper"]
        # The identical request is now answered from the one stored result.
        again = http.post("/bound", json=req)
        assert again.status_code == 200 and again.json() == report
    finally:
        stop(server)
    engine = make_engine(env["LSA_DATABASE_URL"])
    with make_session_factory(engine)() as s:
        assert s.scalar(select(func.count()).select_from(BoundResultRow)
                        .where(BoundResultRow.empirical.is_not(None))) == 1
        assert s.scalar(select(func.count()).select_from(Job)) == 1
    engine.dispose()
