"""POST /bound with `at` and `eps`: the local bound on a ball around one input, through REST,
equal to `lsa bound --at X0.npy --eps E --json`, stored and answered again from the store;
bad `at`/`eps` are 422 naming the field, an oversized `at` 413."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from bench.local_models import build, center, export
from service.app import create_app
from service.cli import app as cli
from service.settings import Settings
from service.tables import BoundResultRow

from .conftest import rows_of, upload


@pytest.fixture
def mlp_onnx(tmp_path: Path) -> Path:
    # A new model per test: the session's database is shared, but each test's artifact
    # directory is its own, so a model uploaded before would have no bytes here.
    return export(build("mlp", seed=uuid.uuid4().int % 2**31), tmp_path / "mlp.onnx")


@pytest.fixture
def x0() -> np.ndarray:
    return center(5).numpy().astype(np.float64)  # (1, N, D)


def local_request(model_id: str, x0: np.ndarray, eps: float, **extra: Any) -> dict[str, Any]:
    return {"model_id": model_id, "norm": "2", "at": x0.tolist(), "eps": eps, **extra}


def test_local_bound_rest_equals_cli_and_is_stored(client: TestClient, mlp_onnx: Path,
                                                   x0: np.ndarray, tmp_path: Path) -> None:
    m = upload(client, mlp_onnx.read_bytes(), "mlp.onnx")
    r = client.post("/bound", json=local_request(m["id"], x0, 0.05))
    assert r.status_code == 200, r.text
    rest = r.json()
    np.save(tmp_path / "x0.npy", x0)
    res = CliRunner().invoke(cli, ["bound", str(mlp_onnx), "--at", str(tmp_path / "x0.npy"),
                                   "--eps", "0.05", "--json"])
    assert res.exit_code == 0, res.output
    local = json.loads(res.stdout)
    assert rest["upper"] == local["upper"] and rest["verdict"] == "certified"
    assert rest["domain"] == local["domain"]
    assert rest["domain"]["kind"] == "ball" and rest["domain"]["eps"] == 0.05
    assert rest["model_sha256"] == m["sha256"]
    # The centre without its batch dimension is the same ball: the same stored answer.
    again = client.post("/bound", json=local_request(m["id"], x0[0], 0.05))
    assert again.status_code == 200 and again.json() == rest
    # Another eps is another request (its own key and row), never the cached one.
    wider = client.post("/bound", json=local_request(m["id"], x0, 0.5)).json()
    assert wider["domain"]["eps"] == 0.5 and wider["upper"] >= rest["upper"]


def test_local_bound_second_call_comes_from_the_store(db_url: str, mlp_onnx: Path,
                                                      x0: np.ndarray,
                                                      make_settings: Callable[..., Settings]
                                                      ) -> None:
    settings = make_settings(db_url)
    with TestClient(create_app(settings)) as c:
        m = upload(c, mlp_onnx.read_bytes(), "mlp.onnx")
        first = c.post("/bound", json=local_request(m["id"], x0, 0.01)).json()
    # A fresh server (empty memory caches) answers from the stored row.
    with TestClient(create_app(settings)) as c:
        second = c.post("/bound", json=local_request(m["id"], x0, 0.01)).json()
    assert second == first
    assert rows_of(settings.database_url, BoundResultRow, m["id"]) == 1


@pytest.mark.parametrize(("change", "field"), [
    ({"eps": 0}, "eps"), ({"eps": -1.0}, "eps"), ({"eps": None}, "at"),
    ({"at": None}, "eps"), ({"at": [[1.0, 2.0], [3.0]]}, "at"), ({"at": [1.0, 2.0]}, "at"),
    ({"at": [[[[[1.0]]]]]}, "at"), ({"at": [[[[1.0]]], [[[1.0]]]]}, "at"),
    ({"at": [[1.0, "x"]]}, "at"), ({"at": []}, "at"),
    ({"radius": 1.0}, "radius"),
])
def test_local_bound_bad_request_is_422_naming_the_field(
        client: TestClient, x0: np.ndarray, change: dict[str, Any], field: str) -> None:
    body = {k: v for k, v in {**local_request("any", x0, 0.1), **change}.items()
            if v is not None}
    r = client.post("/bound", json=body)
    assert r.status_code == 422, r.text
    assert field in r.json()["detail"], r.json()


def test_local_bound_wrong_shape_or_nonfinite_is_422(client: TestClient, mlp_onnx: Path,
                                                      x0: np.ndarray) -> None:
    m = upload(client, mlp_onnx.read_bytes(), "mlp.onnx")
    wrong = client.post("/bound", json=local_request(m["id"], x0[0, :, :-1], 0.1))
    assert wrong.status_code == 422 and "at: the input has shape" in wrong.json()["detail"]
    text = json.dumps(local_request(m["id"], x0, 0.1)).replace(
        str(x0.tolist()[0][0][0]), "NaN", 1)
    nan = client.post("/bound", content=text, headers={"content-type": "application/json"})
    assert nan.status_code == 422, nan.text
    assert "at" in nan.json()["detail"] and "finite" in nan.json()["detail"]


def test_local_bound_empirical_runs_as_a_job(client: TestClient, mlp_onnx: Path,
                                             x0: np.ndarray) -> None:
    m = upload(client, mlp_onnx.read_bytes(), "mlp.onnx")
    certified = client.post("/bound", json=local_request(m["id"], x0, 0.05)).json()
    emp = {"restarts": 2, "steps": 5, "seed": 0, "time_budget_s": 60}
    r = client.post("/bound", json=local_request(m["id"], x0, 0.05, empirical=emp))
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    deadline = time.monotonic() + 120
    while (job := client.get(f"/jobs/{job_id}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
    assert job["status"] == "succeeded", job
    report = job["result"]
    assert report["upper"] == certified["upper"] and report["domain"] == certified["domain"]
    assert 0 < report["lower"] <= report["upper"]
    assert report["witness"]["source"] == "search"
    # The witness lies in the ball.
    w = np.asarray(report["witness"]["input"]).reshape(x0.shape)
    assert np.linalg.norm(w - x0) <= 0.05 * (1 + 1e-9)
    again = client.post("/bound", json=local_request(m["id"], x0, 0.05, empirical=emp))
    assert again.status_code == 200 and again.json() == report


@pytest.fixture
def small_limits(db_url: str, make_settings: Callable[..., Settings]) -> Iterator[TestClient]:
    app = create_app(make_settings(db_url, max_at_elements=16, max_json_bytes=4096))
    with TestClient(app) as c:
        yield c


def test_local_bound_and_robustness_oversized_at_is_413(small_limits: TestClient, mlp_onnx: Path,
                                         x0: np.ndarray) -> None:
    m = upload(small_limits, mlp_onnx.read_bytes(), "mlp.onnx")
    r = small_limits.post("/bound", json=local_request(m["id"], x0, 0.1))
    assert r.status_code == 413 and "LSA_MAX_AT_ELEMENTS" in r.json()["detail"]
    huge = local_request(m["id"], np.zeros((400, 8)), 0.1)
    r = small_limits.post("/bound", json=huge)
    assert r.status_code == 413 and "LSA_MAX_JSON_BYTES" in r.json()["detail"]
    # The same limits hold for a robustness request, before anything is queued.
    robust = {"model_id": m["id"], "at": x0.tolist(), "label": 0, "min_radius": 0.1}
    r = small_limits.post("/certify", json=robust)
    assert r.status_code == 413 and "LSA_MAX_AT_ELEMENTS" in r.json()["detail"]
    r = small_limits.post("/certify", json={**robust, "at": np.zeros((400, 8)).tolist()})
    assert r.status_code == 413 and "LSA_MAX_JSON_BYTES" in r.json()["detail"]
    # and for a certified-accuracy request, counted over all its inputs
    small = np.zeros((2, 4)).tolist()  # 8 numbers each: 16 in all fit, 24 do not
    many = {"model_id": m["id"], "inputs": [small] * 3, "labels": [0, 0, 0],
            "min_radius": 0.1, "min_certified_accuracy": 0.5}
    r = small_limits.post("/certify", json=many)
    assert r.status_code == 413 and "inputs: 24 numbers" in r.json()["detail"], r.text
