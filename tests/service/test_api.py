"""The REST API through httpx (TestClient), against SQLite and the real PostgreSQL."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from lsa_models.analysis import load_model_bytes
from service.app import create_app
from service.bounds.files import compute_report
from service.certificates.service import verify_certificate
from service.reports import bound_report
from service.settings import Settings
from service.tables import BoundResultRow, CertificateRow

from .conftest import tiny_model_bytes, upload


def _count_results(c: TestClient, model_id: str) -> int:
    rt = c.app.state.runtime  # type: ignore[attr-defined]
    with rt.sessions() as s:
        return int(s.scalar(select(func.count()).select_from(BoundResultRow)
                            .where(BoundResultRow.model_id == model_id)) or 0)


def test_models_upload_same_bytes_same_id(client: TestClient, model_bytes: bytes) -> None:
    r = client.post("/models", files={"file": ("a.safetensors", model_bytes)})
    assert r.status_code == 201, r.text
    first = r.json()
    assert first["sha256"] == hashlib.sha256(model_bytes).hexdigest()
    assert first["format"] == "native"
    assert first["summary"]["kind"] == "transformer"
    assert first["parameters"] == first["summary"]["parameters"] > 0
    # The name is not trusted: the same bytes under another name are the same model.
    r = client.post("/models", files={"file": ("other.bin", model_bytes)})
    assert r.status_code == 200
    assert r.json()["id"] == first["id"]


def test_models_list_get_and_download(client: TestClient, model_bytes: bytes) -> None:
    m = upload(client, model_bytes)
    got = client.get(f"/models/{m['id']}")
    assert got.status_code == 200 and got.json() == m
    listed = client.get("/models", params={"limit": 500}).json()
    assert m["id"] in [x["id"] for x in listed["items"]]
    assert listed["total"] >= 1
    f = client.get(f"/models/{m['id']}/file")
    assert f.status_code == 200 and f.content == model_bytes


@pytest.mark.parametrize(("data", "needle"), [
    (b"not a model at all", "x.onnx: "),
    (b"", "empty"),
])
def test_models_upload_bad_file_is_422(client: TestClient, data: bytes, needle: str) -> None:
    r = client.post("/models", files={"file": ("x.onnx", data)})
    assert r.status_code == 422
    body = r.json()
    assert body["error"] == "invalid_model" and needle in body["detail"]


def test_models_upload_corrupt_checkpoint_names_field(client: TestClient) -> None:
    data = bytearray(tiny_model_bytes(seed=5))
    data[-8:] = b"\xff" * 8  # NaN patterns in the last tensor
    r = client.post("/models", files={"file": ("m.safetensors", bytes(data))})
    assert r.status_code == 422
    assert r.json()["error"] == "invalid_model"


def test_models_upload_too_large_is_413(db_url: str,
                                        make_settings: Callable[..., Settings]) -> None:
    app = create_app(make_settings(db_url, max_upload_bytes=1000))
    with TestClient(app) as c:
        r = c.post("/models", files={"file": ("m.safetensors", tiny_model_bytes(seed=1))})
        assert r.status_code == 413
        assert "LSA_MAX_UPLOAD_BYTES=1000" in r.json()["detail"]
        # Far past the cap the whole request is refused before it is read.
        r = c.post("/models", files={"file": ("m.bin", b"\0" * (3 * 1024 * 1024))})
        assert r.status_code == 413
        assert r.json()["error"] == "payload_too_large"


def test_bound_matches_cli_and_is_stored_once(client: TestClient, model_bytes: bytes,
                                              tmp_path: Any) -> None:
    m = upload(client, model_bytes)
    req = {"model_id": m["id"], "norm": "2", "seq_len": 16}
    r = client.post("/bound", json=req)
    assert r.status_code == 200, r.text
    report = r.json()
    path = tmp_path / "m.safetensors"
    path.write_bytes(model_bytes)
    assert report == compute_report(path, "2", 16, None).model_dump(mode="json")
    assert report["verdict"] == "certified" and report["upper"] > 0
    again = client.post("/bound", json=req)
    assert again.status_code == 200 and again.json() == report
    assert _count_results(client, m["id"]) == 1
    # seq_len omitted means the model's default N: the same stored result when equal.
    r = client.post("/bound", json={"model_id": m["id"], "norm": "inf",
                                    "seq_len": m["default_seq_len"]})
    r2 = client.post("/bound", json={"model_id": m["id"], "norm": "inf"})
    assert r.json() == r2.json() and r2.json()["seq_len"] == m["default_seq_len"]
    assert _count_results(client, m["id"]) == 2


def test_bound_radius_changes_the_domain(client: TestClient, model_bytes: bytes) -> None:
    m = upload(client, model_bytes)
    r = client.post("/bound", json={"model_id": m["id"], "norm": "2", "seq_len": 8,
                                    "radius": 1.0})
    assert r.status_code == 200, r.text
    loaded = load_model_bytes(model_bytes, "m")
    expected = bound_report(loaded.certify("2", 8, 1.0), m["sha256"])
    assert r.json() == expected.model_dump(mode="json")
    assert r.json()["radius"] == 1.0


@pytest.mark.parametrize(("body", "where"), [
    ({"norm": "3"}, "body.norm"),
    ({"seq_len": 0}, "body.seq_len"),
    ({"radius": -1.0}, "body.radius"),
    ({"extra": 1}, "body.extra"),
])
def test_bound_bad_input_is_422_naming_the_field(client: TestClient, model_bytes: bytes,
                                                 body: dict[str, Any], where: str) -> None:
    m = upload(client, model_bytes)
    r = client.post("/bound", json={"model_id": m["id"], **body})
    assert r.status_code == 422
    assert r.json()["error"] == "validation_error" and where in r.json()["detail"]


def test_bound_unknown_model_is_404(client: TestClient) -> None:
    r = client.post("/bound", json={"model_id": "no-such-model", "norm": "2"})
    assert r.status_code == 404
    assert r.json() == {"error": "not_found", "detail": r.json()["detail"]}
    assert "POST /models" in r.json()["detail"]


def test_bound_model_too_big_for_sync_is_422_naming_limit(
        db_url: str, make_settings: Callable[..., Settings], model_bytes: bytes) -> None:
    app = create_app(make_settings(db_url, max_sync_parameters=10))
    with TestClient(app) as c:
        m = upload(c, model_bytes)
        for path, extra in (("/bound", {}), ("/certify", {"max_lipschitz": 1.0})):
            r = c.post(path, json={"model_id": m["id"], "norm": "2", **extra})
            assert r.status_code == 422, r.text
            assert r.json()["error"] == "model_too_large"
            assert "LSA_MAX_SYNC_PARAMETERS=10" in r.json()["detail"]


def test_certify_signs_and_verifies(client: TestClient, model_bytes: bytes) -> None:
    m = upload(client, model_bytes)
    upper = client.post("/bound", json={"model_id": m["id"], "norm": "2",
                                        "seq_len": 8}).json()["upper"]
    ok = client.post("/certify", json={"model_id": m["id"], "norm": "2", "seq_len": 8,
                                       "max_lipschitz": upper * 2})
    assert ok.status_code == 201, ok.text
    cert = ok.json()
    assert cert["passed"] is True and cert["upper"] == upper
    assert cert["model_sha256"] == m["sha256"] and cert["threshold"] == upper * 2
    assert set(cert) == {"id", "model_sha256", "norm", "seq_len", "radius", "threshold",
                         "upper", "lower", "passed", "method", "lsa_version", "issued_at",
                         "signature"}
    fail = client.post("/certify", json={"model_id": m["id"], "norm": "2", "seq_len": 8,
                                         "max_lipschitz": upper / 2}).json()
    assert fail["passed"] is False
    assert client.get(f"/certificates/{cert['id']}").json() == cert
    assert client.post("/certificates/verify", json=cert).json()["valid"] is True
    # Offline: the public key alone verifies it.
    pem = client.get("/certificates/public-key").json()["public_key_pem"]
    assert verify_certificate(cert, pem).valid


@pytest.mark.parametrize(("field", "value"), [
    ("passed", False), ("threshold", 1e300), ("upper", 1.0), ("seq_len", 9),
    ("model_sha256", "0" * 64), ("norm", "inf"), ("lsa_version", "9.9.9"),
    ("issued_at", "2020-01-01T00:00:00Z"), ("method", "made up"), ("radius", 3.0),
    ("lower", 1.0), ("id", "forged"),
])
def test_certificates_verify_rejects_altered_field(client: TestClient, model_bytes: bytes,
                                                   field: str, value: Any) -> None:
    m = upload(client, model_bytes)
    cert = client.post("/certify", json={"model_id": m["id"], "norm": "2", "seq_len": 8,
                                         "max_lipschitz": 1e30}).json()
    altered = {**cert, field: value}
    r = client.post("/certificates/verify", json=altered)
    assert r.status_code == 200
    assert r.json()["valid"] is False, field


def test_certificates_verify_malformed_is_invalid_not_500(client: TestClient) -> None:
    r = client.post("/certificates/verify", json={"id": 1})
    assert r.status_code == 200
    assert r.json()["valid"] is False and "malformed" in r.json()["reason"]


def test_certify_is_stored(client: TestClient, model_bytes: bytes) -> None:
    m = upload(client, model_bytes)
    cert = client.post("/certify", json={"model_id": m["id"], "norm": "inf",
                                         "max_lipschitz": 5.0}).json()
    rt = client.app.state.runtime  # type: ignore[attr-defined]
    with rt.sessions() as s:
        row = s.get(CertificateRow, cert["id"])
        assert row is not None and row.body == cert and row.passed == cert["passed"]


def test_errors_share_one_shape(client: TestClient) -> None:
    for method, path in (("GET", "/nope"), ("GET", "/jobs/none"), ("DELETE", "/jobs/none"),
                         ("GET", "/certificates/none"), ("PUT", "/models")):
        r = client.request(method, path)
        assert r.status_code in (404, 405), (method, path)
        assert set(r.json()) == {"error", "detail"}
    r = client.post("/bound", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and set(r.json()) == {"error", "detail"}


def test_health_ready_metrics(client: TestClient, model_bytes: bytes) -> None:
    assert client.get("/healthz").json()["status"] == "ok"
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"database": "ok", "broker": "in-process"}
    upload(client, model_bytes)
    text = client.get("/metrics").text
    assert 'lsa_http_requests_total{method="POST",route="/models",status="201"}' in text
    assert 'lsa_jobs{status="queued"}' in text and "lsa_models " in text


def test_certify_dot_product_attention_never_passes(client: TestClient) -> None:
    import torch

    from lsa_models import DotProductMHA, to_bytes

    torch.manual_seed(3)
    # Bare dot-product attention (no LayerNorm in front bounding its input).
    dp = DotProductMHA(8, 2)
    m = upload(client, to_bytes(dp))
    report = client.post("/bound", json={"model_id": m["id"], "norm": "2"}).json()
    assert report["verdict"] == "not_lipschitz" and report["upper"] is None
    cert = client.post("/certify", json={"model_id": m["id"], "norm": "2",
                                         "max_lipschitz": 1e300}).json()
    assert cert["passed"] is False and cert["upper"] is None
    assert client.post("/certificates/verify", json=cert).json()["valid"] is True


def test_models_upload_streamed_without_length_is_capped(
        db_url: str, make_settings: Callable[..., Settings]) -> None:
    app = create_app(make_settings(db_url, max_upload_bytes=1000))

    def body() -> Any:
        yield b"--xx\r\nContent-Disposition: form-data; name=\"file\"; filename=\"m\"\r\n\r\n"
        for _ in range(40):
            yield b"\0" * 65536
        yield b"\r\n--xx--\r\n"

    with TestClient(app) as c:
        r = c.post("/models", content=body(),
                   headers={"content-type": "multipart/form-data; boundary=xx"})
        assert r.status_code == 413 and r.json()["error"] == "payload_too_large"


def test_models_file_missing_from_store_is_404(client: TestClient, model_bytes: bytes) -> None:
    m = upload(client, model_bytes)
    rt = client.app.state.runtime  # type: ignore[attr-defined]
    rt.artifacts.path_for(m["sha256"]).unlink()
    r = client.get(f"/models/{m['id']}/file")
    assert r.status_code == 404 and "LSA_ARTIFACT_DIR" in r.json()["detail"]


def test_bound_empirical_job_yields_the_report(client: TestClient, model_bytes: bytes) -> None:
    import time

    from api_schemas import BoundReport

    m = upload(client, model_bytes)
    base = {"model_id": m["id"], "norm": "2", "seq_len": 4}
    req = {**base, "empirical": {"restarts": 1, "steps": 3, "seed": 0, "time_budget_s": 30}}
    r = client.post("/bound", json=req)
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    deadline = time.monotonic() + 60
    while (job := client.get(f"/jobs/{job_id}").json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    assert job["status"] == "succeeded", job
    report = BoundReport.model_validate(job["result"])
    assert report.lower is not None and report.upper is not None
    assert 0 < report.lower <= report.upper
    analytic = client.post("/bound", json=base).json()
    assert report.model_dump(exclude={"lower", "ratio", "witness"}) == \
        {k: v for k, v in analytic.items() if k not in ("lower", "ratio", "witness")}
    again = client.post("/bound", json=req)
    assert again.status_code == 200 and again.json() == job["result"]


def test_artifacts_content_addressed_with_metadata(client: TestClient) -> None:
    from service.artifacts import store_artifact
    from service.db import transaction
    from service.tables import Artifact

    rt = client.app.state.runtime  # type: ignore[attr-defined]
    data = b"png bytes " + bytes(range(256))
    with transaction(rt.sessions) as s:
        sha = store_artifact(s, rt.artifacts, data, "plot")
        assert store_artifact(s, rt.artifacts, data, "plot") == sha
    assert sha == hashlib.sha256(data).hexdigest()
    assert rt.artifacts.path_for(sha) == rt.settings.artifact_dir / sha[:2] / sha
    assert rt.artifacts.read_bytes(sha) == data
    with rt.sessions() as s:
        row = s.get(Artifact, sha)
        assert row is not None and row.size_bytes == len(data) and row.kind == "plot"
