"""The service under concurrent load, through real sockets: every answer 200 (no 500, no
dropped connection) for cached and uncached /bound on SQLite and PostgreSQL; honest 503 with
Retry-After only when the compute queue is full; an uploaded ONNX model is compared with
onnxruntime once, at upload. (Throughput is measured in bench/api_load.py, not here.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from lsa_models import Transformer, TransformerConfig
from service.app import create_app
from service.settings import Settings

from .conftest import tiny_model_bytes, upload
from .serving import fire, serve

CACHED = 120
UNCACHED = 24


def test_load_cached_and_uncached_bound_all_answer_200(
        db_url: str, make_settings: Callable[..., Settings]) -> None:
    app = create_app(make_settings(db_url))
    with TestClient(app) as c, serve(app) as base:
        models = [upload(c, tiny_model_bytes(seed=1000 + i)) for i in range(UNCACHED // 4)]
        cached = {"model_id": models[0]["id"], "norm": "2", "seq_len": 8}
        assert httpx.post(f"{base}/bound", json=cached, timeout=60).status_code == 200
        for concurrency in (50, 200):
            out = fire(base, [("POST", "/bound", cached)] * CACHED, concurrency)
            assert out.statuses == [200] * CACHED, (concurrency, out.errors[:3])
        # Distinct, never computed: every one is a computation on the compute pool.
        distinct = [("POST", "/bound", {"model_id": m["id"], "norm": norm, "seq_len": n})
                    for m in models for norm in ("2", "inf") for n in (5, 7)]
        out = fire(base, distinct, len(distinct))
        assert out.statuses == [200] * len(distinct), out.errors[:3]
        assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200
        assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200


def test_load_full_compute_queue_answers_503_with_retry_after(
        sqlite_migrated: str, make_settings: Callable[..., Settings]) -> None:
    app = create_app(make_settings(sqlite_migrated, compute_threads=1, compute_queue_limit=1))
    with TestClient(app) as c, serve(app) as base:
        m = upload(c, tiny_model_bytes(seed=77, d_model=16, n_layers=2))
        distinct = [("POST", "/bound", {"model_id": m["id"], "norm": "2", "seq_len": n})
                    for n in range(2, 26)]
        out = fire(base, distinct, len(distinct))
        assert set(out.statuses) <= {200, 503}, out.errors[:3]
        assert out.count(200) >= 1 and out.count(503) >= 1, out.statuses
        assert out.retry_after and all(int(v) > 0 for v in out.retry_after)
        busy = [e for e in out.errors if "LSA_COMPUTE_QUEUE_LIMIT" in e]
        assert len(busy) == out.count(503)
        # Back-pressure, not breakage: the refused requests succeed when retried.
        again = fire(base, distinct, 1)
        assert again.statuses == [200] * len(distinct)


def test_load_uploaded_onnx_is_not_compared_with_onnxruntime_again(
        sqlite_migrated: str, make_settings: Callable[..., Settings], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxruntime

    from lsa_models.onnx import export_onnx, loading

    torch.manual_seed(5)
    model = Transformer(TransformerConfig(d_model=8, n_heads=2, n_layers=1, d_ff=16))
    path = export_onnx(model, tmp_path / "m.onnx", seq_len=6)
    calls: list[str] = []
    real_compare = loading.compare_with_onnxruntime

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append("compare")
        return real_compare(*args, **kwargs)

    monkeypatch.setattr(loading, "compare_with_onnxruntime", counting)
    app = create_app(make_settings(sqlite_migrated))
    rt = app.state.runtime
    with TestClient(app) as c:
        m = upload(c, path.read_bytes(), "m.onnx")
        assert m["format"] == "onnx" and calls == ["compare"]
        # A fresh process's view: nothing parsed in memory.
        rt.models.clear()

        def no_onnxruntime(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("onnxruntime ran again for an uploaded, verified model")

        monkeypatch.setattr(onnxruntime, "InferenceSession", no_onnxruntime)
        for radius in (None, 2.0):
            body: dict[str, Any] = {"model_id": m["id"], "norm": "2", "radius": radius}
            r = c.post("/bound", json=body)
            assert r.status_code == 200, r.text
        assert calls == ["compare"]
        assert rt.models.loads == 1  # parsed once for both requests (the LRU)


def test_load_reads_with_a_session_never_wait_for_a_thread_holding_a_connection(
        db_url: str, make_settings: Callable[..., Settings]) -> None:
    """Many more concurrent reads than request threads and connections, on every route that
    reads through the session dependency: all 200. (A sync route had its response validated
    on a second request thread while its session held a connection: with every thread
    waiting for a connection the server answered nothing until the pool timed out; 200
    concurrent GET /jobs/{id} on the default settings all timed out.) Few request threads
    make the pool small, so the old order deadlocked at once here."""
    app = create_app(make_settings(db_url, request_threads=3))
    with TestClient(app) as c, serve(app) as base:
        m = upload(c, tiny_model_bytes(seed=77))
        accepted = c.post("/bound", json={"model_id": m["id"], "norm": "2", "seq_len": 4,
                                          "empirical": {"restarts": 1, "steps": 2}})
        assert accepted.status_code == 202, accepted.text  # an empirical bound is a job
        job = accepted.json()["job_id"]
        cert = c.post("/certify", json={"model_id": m["id"], "norm": "2", "seq_len": 4,
                                        "max_lipschitz": 1e12}).json()["id"]
        paths = [f"/models/{m['id']}", "/models", f"/certificates/{cert}",
                 f"/models/{m['id']}/file", f"/jobs/{job}"]
        out = fire(base, [("GET", p, None) for p in paths] * 30, 60, timeout_s=30)
        assert out.statuses == [200] * len(out.statuses), out.errors[:3]
        assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200
