"""POST /certify with `at`, `label`, `min_radius`: a signed robustness certificate that passes
iff the certified radius >= min_radius, stored, verifiable by POST /certificates/verify and
`lsa verify` (any altered field: invalid); mixing certificate kinds is 422."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from bench.local_models import build, center, export
from service.cli import app as cli

from .conftest import upload


@pytest.fixture
def mlp_onnx(tmp_path: Path) -> Path:
    # A new model per test: the session's database is shared, but each test's artifact
    # directory is its own, so a model uploaded before would have no bytes here.
    return export(build("mlp", seed=uuid.uuid4().int % 2**31), tmp_path / "mlp.onnx")


def predicted_label(model: Path, x0: np.ndarray) -> int:
    from lsa_models.onnx import load_onnx

    f = load_onnx(model.read_bytes()).module.with_dtype(torch.float64)
    with torch.no_grad():
        return int(f(torch.from_numpy(x0)).argmax())


def test_robustness_certificate_passes_fails_and_verifies(client: TestClient, mlp_onnx: Path,
                                                          tmp_path: Path) -> None:
    m = upload(client, mlp_onnx.read_bytes(), "mlp.onnx")
    x0 = center(5).numpy().astype(np.float64)  # (1, N, D)
    label = predicted_label(mlp_onnx, x0)
    req = {"model_id": m["id"], "norm": "2", "at": x0.tolist(), "label": label}
    ok = client.post("/certify", json={**req, "min_radius": 1e-9})
    assert ok.status_code == 201, ok.text
    cert = ok.json()
    rob = cert["robustness"]
    assert rob["certified_radius"] > 1e-9 and cert["passed"] is True
    assert rob["label"] == label and rob["predicted"] == label and rob["min_radius"] == 1e-9
    assert rob["attack_radius"] is None or rob["certified_radius"] <= rob["attack_radius"]
    assert cert["threshold"] == 1e-9 and cert["upper"] is None
    # A label that is not the prediction is certified nowhere: radius 0, failed.
    other = client.post("/certify", json={**req, "label": (label + 1) % 4,
                                          "min_radius": 1e-9}).json()
    assert other["robustness"]["certified_radius"] == 0 and other["passed"] is False
    # The same input through the CLI gives the same certified radius.
    np.save(tmp_path / "x0.npy", x0)
    res = CliRunner().invoke(cli, ["robustness", str(mlp_onnx), "--at",
                                   str(tmp_path / "x0.npy"), "--label", str(label), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["certified_radius"] == rob["certified_radius"]
    # Asking for more than is certified fails (same radius, other verdict).
    too_far = client.post("/certify", json={**req, "min_radius": 2 * rob["certified_radius"]})
    assert too_far.status_code == 201
    failed = too_far.json()
    assert failed["passed"] is False
    assert failed["robustness"]["certified_radius"] == rob["certified_radius"]
    for c in (cert, failed):
        assert client.get(f"/certificates/{c['id']}").json() == c
        assert client.post("/certificates/verify", json=c).json()["valid"] is True
    # Offline, with the server's key.
    pem = client.get("/certificates/public-key").json()["public_key_pem"]
    (tmp_path / "pub.pem").write_text(pem)
    (tmp_path / "cert.json").write_text(json.dumps(cert))
    res = CliRunner().invoke(cli, ["verify", str(tmp_path / "cert.json"), str(mlp_onnx),
                                   "--public-key", str(tmp_path / "pub.pem")])
    assert res.exit_code == 0 and "robustness certificate" in res.stdout, res.output
    tampered = {**cert, "robustness": {**rob, "certified_radius": rob["certified_radius"] * 2}}
    (tmp_path / "bad.json").write_text(json.dumps(tampered))
    res = CliRunner().invoke(cli, ["verify", str(tmp_path / "bad.json"),
                                   "--public-key", str(tmp_path / "pub.pem")])
    assert res.exit_code == 1 and "INVALID" in res.stdout
    for field, value in (("label", label + 1), ("min_radius", 1.0), ("center_sha256", "0" * 64),
                         ("attack_radius", 9.0)):
        altered = {**cert, "robustness": {**rob, field: value}}
        assert client.post("/certificates/verify", json=altered).json()["valid"] is False
    for field, value in (("passed", False), ("threshold", 1.0)):
        assert client.post("/certificates/verify",
                           json={**cert, field: value}).json()["valid"] is False
    dropped = {k: v for k, v in cert.items() if k != "robustness"}
    assert client.post("/certificates/verify", json=dropped).json()["valid"] is False


@pytest.mark.parametrize(("body", "field"), [
    ({"label": 0, "min_radius": 0.1}, "at"),
    ({"at": [[1.0]], "min_radius": 0.1}, "label"),
    ({"at": [[1.0]], "label": 0, "min_radius": 0.1, "max_lipschitz": 10.0}, "max_lipschitz"),
    ({"at": [[1.0]], "label": 0, "min_radius": 0.1, "seq_len": 8}, "seq_len"),
    ({"at": [[1.0]], "label": 0, "min_radius": -1.0}, "min_radius"),
    ({"at": [[1.0]], "label": 0, "min_radius": 0.0}, "min_radius"),
    ({"at": [[1.0, float("inf")]], "label": 0, "min_radius": 0.1}, "at"),
])
def test_robustness_request_mixing_or_missing_is_422(client: TestClient, body: dict[str, Any],
                                                     field: str) -> None:
    r = client.post("/certify", content=json.dumps({"model_id": "m", **body}),
                    headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert field in r.json()["detail"]


def test_robustness_bad_label_or_shape_is_422(client: TestClient, mlp_onnx: Path) -> None:
    m = upload(client, mlp_onnx.read_bytes(), "mlp.onnx")
    x0 = center(5).numpy().astype(np.float64)
    r = client.post("/certify", json={"model_id": m["id"], "at": x0.tolist(), "label": 9,
                                      "min_radius": 0.1})
    assert r.status_code == 422 and "label must be in 0..3" in r.json()["detail"]
    r = client.post("/certify", json={"model_id": m["id"], "at": x0[0, :3].tolist(),
                                      "label": 0, "min_radius": 0.1})
    assert r.status_code == 422 and r.json()["detail"].startswith("at: ")

