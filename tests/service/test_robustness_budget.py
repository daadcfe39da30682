"""Time budgets over REST: `time_budget_s` in robustness and certified-accuracy requests (422
naming it when it is not a number of seconds > 0; null: no budget); a job whose budget runs
out signs what was proven in time, the certificate saying so (a robustness certificate:
stopped_by_budget; a certified-accuracy one: the inputs it stopped), and `lsa verify
--recompute` checks it against the unbudgeted search."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from bench.local_models import build, center, export
from service.cli import app as cli

from .conftest import upload
from .test_robustness_api import predicted_label, wait_job


@pytest.fixture
def mlp_onnx(tmp_path: Path) -> Path:
    # a new model per test: the session's database is shared (test_robustness_api.py says why)
    return export(build("mlp", seed=uuid.uuid4().int % 2**31), tmp_path / "mlp.onnx")


X = [[0.0] * 16] * 8


@pytest.mark.parametrize("kind", ["robustness", "certified_accuracy"])
@pytest.mark.parametrize("bad", [-1, 0, "abc", "NaN", 1e9, [5]])
def test_bad_time_budget_is_422_naming_it(client: TestClient, kind: str, bad: Any) -> None:
    body: dict[str, Any] = (
        {"kind": kind, "model_id": "x", "at": X, "label": 0, "min_radius": 0.1}
        if kind == "robustness" else
        {"kind": kind, "model_id": "x", "inputs": [X], "labels": [0], "min_radius": 0.1,
         "min_certified_accuracy": 0.5})
    r = client.post("/certify", json={**body, "time_budget_s": bad})
    assert r.status_code == 422 and "time_budget_s" in r.text, r.text


def test_set_job_with_a_budget_reports_the_inputs_it_stopped(
        client: TestClient, mlp_onnx: Path, tmp_path: Path) -> None:
    """A budget spent before any step: every input unknown, the certificate naming them and
    its budget; the same request without a budget is its own result; `lsa verify
    --recompute` decides the set again without the budget and finds the certificate
    valid."""
    m = upload(client, mlp_onnx.read_bytes(), "mlp.onnx")
    xs = np.stack([center(s).numpy().astype(np.float64)[0] for s in (5, 6)])
    labels = [predicted_label(mlp_onnx, x[None]) for x in xs]
    req = {"kind": "certified_accuracy", "model_id": m["id"], "norm": "inf",
           "inputs": xs.tolist(), "labels": labels, "min_radius": 1e-4,
           "min_certified_accuracy": 0.5}
    job = wait_job(client, client.post("/certify", json={**req, "time_budget_s": 1e-6}))
    assert job["status"] == "succeeded", job
    cert = job["result"]
    rs = cert["robustness_set"]
    assert rs["time_budget_s"] == 1e-6 and rs["stopped_by_budget"] == [0, 1]
    assert rs["statuses"] == ["unknown", "unknown"] and cert["passed"] is False
    free = wait_job(client, client.post("/certify", json={**req, "time_budget_s": None}))
    frs = free["result"]["robustness_set"]
    assert "time_budget_s" not in frs and "stopped_by_budget" not in frs
    assert frs["statuses"] == ["certified", "certified"] and free["result"]["passed"] is True
    np.save(tmp_path / "xs.npy", xs)
    np.save(tmp_path / "ys.npy", np.array(labels))
    (tmp_path / "pub.pem").write_text(client.get("/certificates/public-key").json()[
        "public_key_pem"])
    (tmp_path / "cert.json").write_text(json.dumps(cert))
    res = CliRunner().invoke(cli, ["verify", str(tmp_path / "cert.json"), str(mlp_onnx),
                                   "--public-key", str(tmp_path / "pub.pem"), "--recompute",
                                   "--inputs", str(tmp_path / "xs.npy"), "--labels",
                                   str(tmp_path / "ys.npy")])
    assert res.exit_code == 0, res.output
    assert ("time budget: 2 inputs stopped by it (unknown); decided without it, the "
            "certified accuracy is 1.0") in res.stdout


def test_robustness_job_with_a_budget_signs_the_radius_found_in_time(
        client: TestClient, mlp_onnx: Path, tmp_path: Path) -> None:
    m = upload(client, mlp_onnx.read_bytes(), "mlp.onnx")
    x0 = center(5).numpy().astype(np.float64)
    label = predicted_label(mlp_onnx, x0)
    req = {"kind": "robustness", "model_id": m["id"], "norm": "inf", "at": x0.tolist(),
           "label": label, "min_radius": 1e-6, "time_budget_s": 1e-6}
    job = wait_job(client, client.post("/certify", json=req))
    assert job["status"] == "succeeded", job
    cert = job["result"]
    rob = cert["robustness"]
    assert rob["stopped_by_budget"] is True and rob["time_budget_s"] == 1e-6
    assert rob["certified_radius"] == 0.0 and cert["passed"] is False
    np.save(tmp_path / "x0.npy", x0)
    (tmp_path / "pub.pem").write_text(client.get("/certificates/public-key").json()[
        "public_key_pem"])
    (tmp_path / "cert.json").write_text(json.dumps(cert))
    res = CliRunner().invoke(cli, ["verify", str(tmp_path / "cert.json"), str(mlp_onnx),
                                   "--public-key", str(tmp_path / "pub.pem"), "--recompute",
                                   "--at", str(tmp_path / "x0.npy")])
    assert res.exit_code == 0, res.output
    assert "certified radius: 0.0, stopped by its time budget, is at most the recomputed" \
        in res.stdout
