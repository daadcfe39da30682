"""The training form of POST /certify: a tiny end-to-end request on the in-process worker
(model, ONNX, certificate and plot stored; progress visible), corpus uploads, bad requests as
4xx naming the field, cancellation, and a re-run that finds the stored result."""

from __future__ import annotations

import hashlib
import io
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update

from api_schemas.certificates import CertificateBody, canonical_bytes
from service.app import create_app
from service.db import transaction
from service.jobs import run_job
from service.runtime import Runtime
from service.settings import Settings
from service.tables import CertificateRow, Job, UploadedModel

TINY_CORPUS = Path(__file__).resolve().parent.parent / "data" / "tiny_corpus.txt"

# Small enough for one CPU core in seconds; long enough (a few seconds of steps) that the
# job's progress is seen while it trains.
TINY: dict[str, Any] = {"d_model": 16, "n_heads": 2, "n_layers": 1, "d_ff": 32, "seq_len": 16,
                        "attention": "contractive_l2", "c": 0.5, "steps": 120, "batch_size": 8,
                        "eval_tokens": 512, "recon_sequences": 2, "device": "cpu", "seed": 3}


@pytest.fixture
def sqlite_client(sqlite_migrated: str,
                  make_settings: Callable[..., Settings]) -> Iterator[TestClient]:
    app = create_app(make_settings(sqlite_migrated, max_training_steps=10_000,
                                   max_corpus_bytes=64 * 1024))
    with TestClient(app) as c:
        yield c


@pytest.fixture
def train_client(db_url: str, make_settings: Callable[..., Settings]) -> Iterator[TestClient]:
    app = create_app(make_settings(db_url, max_training_steps=10_000,
                                   max_corpus_bytes=64 * 1024))
    with TestClient(app) as c:
        yield c


@pytest.fixture
def limited_client(db_url: str, make_settings: Callable[..., Settings]) -> Iterator[TestClient]:
    app = create_app(make_settings(db_url, max_training_steps=100, max_corpus_bytes=8192,
                                   max_training_elements=10**6))
    with TestClient(app) as c:
        yield c


def runtime_of(c: TestClient) -> Runtime:
    rt = c.app.state.runtime  # type: ignore[attr-defined]
    assert isinstance(rt, Runtime)
    return rt


def upload_corpus(c: TestClient, data: bytes, name: str = "tiny.txt") -> Any:
    return c.post("/corpora", files={"file": (name, io.BytesIO(data), "text/plain")})


def tiny_corpus_id(c: TestClient) -> str:
    # Unique text per call: the migrated database outlives each test's artifact directory.
    r = upload_corpus(c, TINY_CORPUS.read_bytes() + f"\n{uuid.uuid4()}\n".encode())
    assert r.status_code in (200, 201), r.text
    return str(r.json()["id"])


def poll(c: TestClient, job_id: str, timeout: float,
         seen: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job = c.get(f"/jobs/{job_id}").json()
        if seen is not None:
            seen.append(job)
        if job["status"] not in ("queued", "running"):
            return dict(job)
        assert time.monotonic() < deadline, f"job still {job['status']} at {job['stage']}"
        time.sleep(0.05)


def test_training_end_to_end_stores_model_onnx_certificate_and_plot(
        train_client: TestClient) -> None:
    c = train_client
    t0 = time.monotonic()
    corpus_id = tiny_corpus_id(c)
    r = c.post("/certify", json={"training": {**TINY, "corpus": corpus_id}})
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    seen: list[dict[str, Any]] = []
    job = poll(c, job_id, timeout=110, seen=seen)
    assert job["status"] == "succeeded", job["error"]
    assert job["kind"] == "train_certified" and job["queue"] == "training"
    assert time.monotonic() - t0 < 120

    # Progress was visible while it trained, and never went backwards.
    training = [j for j in seen if j["status"] == "running"
                and (j["stage"] or "").startswith("training: step ")]
    assert training, [j["stage"] for j in seen]
    assert all(0 < j["progress"] < 1 for j in training)
    fractions = [j["progress"] for j in seen]
    assert fractions == sorted(fractions)

    res = job["result"]
    cert_id, model_id = res["certificate_id"], res["model_id"]
    # The model row: bound-able, downloadable, its bytes the stored artifact.
    m = c.get(f"/models/{model_id}").json()
    assert m["format"] == "native" and m["summary"]["kind"] == "char_lm"
    assert m["default_seq_len"] == m["fixed_seq_len"] == TINY["seq_len"]
    data = c.get(res["artifacts"]["model"]["url"]).content
    assert hashlib.sha256(data).hexdigest() == m["sha256"] == res["artifacts"]["model"]["sha256"]
    b = c.post("/bound", json={"model_id": model_id, "norm": "2"})
    assert b.status_code == 200, b.text
    assert b.json()["verdict"] == "certified" and b.json()["upper"] > 0

    # ONNX export: runs and gives logits for the vocabulary.
    onnx_bytes = c.get(res["artifacts"]["onnx"]["url"]).content
    assert hashlib.sha256(onnx_bytes).hexdigest() == res["artifacts"]["onnx"]["sha256"]
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
    logits = sess.run(None, {"tokens": np.zeros((1, TINY["seq_len"]), dtype=np.int64)})[0]
    vocab = m["summary"]["config"]["vocab_size"]
    assert logits.shape == (1, TINY["seq_len"], vocab) and np.isfinite(logits).all()
    # The plot.
    png = c.get(res["artifacts"]["plot"]["url"])
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    assert png.content.startswith(b"\x89PNG\r\n\x1a\n")

    # The signed certificate carries the training facts.
    cert = c.get(f"/certificates/{cert_id}").json()
    t = cert["training"]
    assert cert["threshold"] == TINY["c"] and cert["passed"] is True
    assert cert["model_sha256"] == m["sha256"] and cert["seq_len"] == TINY["seq_len"]
    assert t["branches"] and all(br["lipschitz_upper"] <= TINY["c"] < 1 for br in t["branches"])
    assert cert["upper"] == max(br["lipschitz_upper"] for br in t["branches"])
    assert t["invertible"] is True and t["trunk_lipschitz_upper"] > 1
    rec = t["reconstruction"]
    assert rec["converged"] and rec["bound_holds"] and rec["max_error"] <= 1e-5
    assert 0 < t["test_bpc"] < 10 and res["test_bpc"] == t["test_bpc"]
    assert t["corpus"]["id"] == corpus_id and t["job_id"] == job_id
    assert c.post("/certificates/verify", json=cert).json()["valid"] is True
    forged = {**cert, "training": {**t, "test_bpc": t["test_bpc"] / 2}}
    assert c.post("/certificates/verify", json=forged).json()["valid"] is False

    # The work directory is gone; a re-run (as after a crash) returns the stored result
    # without training again or storing anything twice.
    rt = runtime_of(c)
    assert not (Path(rt.settings.artifact_dir) / "training" / job_id).exists()
    with transaction(rt.sessions) as s:
        s.execute(update(Job).where(Job.id == job_id).values(status="queued"))
    t1 = time.monotonic()
    run_job(rt, job_id)
    assert time.monotonic() - t1 < 5
    with rt.sessions() as s:
        again = s.get(Job, job_id)
        assert again is not None and again.status == "succeeded" and again.attempts == 2
        assert again.result == res
        assert s.scalar(select(func.count()).select_from(CertificateRow)
                        .where(CertificateRow.model_id == model_id)) == 1
        assert s.scalar(select(func.count()).select_from(UploadedModel)
                        .where(UploadedModel.sha256 == m["sha256"])) == 1


def test_training_cancel_stops_the_job(sqlite_client: TestClient) -> None:
    c = sqlite_client
    corpus_id = tiny_corpus_id(c)
    r = c.post("/certify", json={"training": {**TINY, "steps": 10_000, "corpus": corpus_id}})
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    deadline = time.monotonic() + 60
    while True:
        job = c.get(f"/jobs/{job_id}").json()
        assert job["status"] in ("queued", "running"), job
        if (job["stage"] or "").startswith("training: step"):
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert c.delete(f"/jobs/{job_id}").json()["status"] == "cancelled"
    work = Path(runtime_of(c).settings.artifact_dir) / "training" / job_id
    deadline = time.monotonic() + 30
    while work.exists():  # the handler stops at its next progress write and cleans up
        assert time.monotonic() < deadline, "the training job kept running after cancel"
        time.sleep(0.05)
    job = c.get(f"/jobs/{job_id}").json()
    assert job["status"] == "cancelled" and job["result"] is None
    with runtime_of(c).sessions() as s:
        assert s.scalar(select(func.count()).select_from(UploadedModel)
                        .where(UploadedModel.filename == f"char_lm-{job_id[:8]}.safetensors")) == 0


@pytest.mark.parametrize(("change", "status", "field"), [
    ({"attention": "softmax"}, 422, "training.attention"),
    ({"c": 1.0}, 422, "training.c"),
    ({"c": 1.5}, 422, "training.c"),
    ({"steps": 101}, 422, "training.steps"),
    ({"corpus": "00000000-0000-4000-8000-000000000000"}, 404, "training.corpus"),
    ({"d_model": 10, "n_heads": 3}, 422, "training."),
    ({"seq_len": 230}, 422, "training.seq_len"),
    ({"steps": 0}, 422, "training.steps"),
    ({"device": "tpu"}, 422, "training.device"),
    ({"batch_size": 10_000}, 422, "LSA_MAX_TRAINING_ELEMENTS"),
    ({"unknown": 1}, 422, "training.unknown"),
])
def test_training_bad_request_is_4xx_naming_the_field(
        limited_client: TestClient, change: dict[str, Any], status: int, field: str) -> None:
    c = limited_client
    corpus_id = tiny_corpus_id(c)
    spec = {**TINY, "steps": 10, "corpus": corpus_id, **change}
    r = c.post("/certify", json={"training": spec})
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error", "detail"} and field in body["detail"], body


@pytest.mark.parametrize(("body", "needle"), [
    ({"training": {**TINY, "steps": 10}, "model_id": "x", "max_lipschitz": 1.0}, "model_id"),
    ({"training": {**TINY, "steps": 10}, "norm": "inf"}, "norm"),
    ({"norm": "2", "max_lipschitz": 1.0}, "model_id"),
    ({"model_id": "x"}, "max_lipschitz"),
])
def test_training_certify_forms_are_exclusive(limited_client: TestClient, body: dict[str, Any],
                                              needle: str) -> None:
    r = limited_client.post("/certify", json=body)
    assert r.status_code == 422, r.text
    assert needle in r.json()["detail"]


def test_training_corpora_upload_checks(limited_client: TestClient) -> None:
    c = limited_client
    text = f"héllo wörld, a small text {uuid.uuid4()}. " * 20
    first = upload_corpus(c, text.encode())
    assert first.status_code == 201, first.text
    out = first.json()
    assert out["chars"] == len(text) and out["vocab_size"] == len(set(text))
    assert out["filename"] == "tiny.txt"
    assert out["size_bytes"] == len(text.encode())
    assert out["sha256"] == hashlib.sha256(text.encode()).hexdigest()
    again = upload_corpus(c, text.encode())
    assert again.status_code == 200 and again.json()["id"] == out["id"]
    assert c.get(f"/corpora/{out['id']}").json() == out
    assert c.get(f"/artifacts/{out['sha256']}").content == text.encode()

    bad = upload_corpus(c, b"abc\xff\xfedef")
    assert bad.status_code == 422 and bad.json()["error"] == "invalid_corpus"
    assert "UTF-8" in bad.json()["detail"]
    empty = upload_corpus(c, b"")
    assert empty.status_code == 422 and "empty" in empty.json()["detail"]
    big = upload_corpus(c, b"a" * 8193)
    assert big.status_code == 413 and "LSA_MAX_CORPUS_BYTES" in big.json()["detail"]
    assert c.get("/corpora/nope").status_code == 404
    assert c.get("/artifacts/" + "0" * 64).status_code == 404


def test_training_canonical_bytes_unchanged_without_training() -> None:
    body = CertificateBody(id="x", model_sha256="0" * 64, norm="2", seq_len=4, threshold=1.0,
                           upper=0.5, passed=True, method="m", lsa_version="0",
                           issued_at="2026-12-02T12:00:00Z")  # type: ignore[arg-type]
    assert b"training" not in canonical_bytes(body)
    with_training = body.model_copy(update={"training": {"test_bpc": 1.5}})
    assert b'"training":{"test_bpc":1.5}' in canonical_bytes(with_training)


def test_training_non_contractive_attention_is_certified_but_not_invertible(
        sqlite_client: TestClient) -> None:
    c = sqlite_client
    spec = {**TINY, "attention": "dp", "steps": 5, "corpus": tiny_corpus_id(c)}
    r = c.post("/certify", json={"training": spec})
    assert r.status_code == 202, r.text
    job = poll(c, r.json()["job_id"], timeout=60)
    assert job["status"] == "succeeded", job["error"]
    res = job["result"]
    assert res["invertible"] is False and res["max_branch_lipschitz"] is None
    cert = c.get(res["certificate_url"]).json()
    assert cert["passed"] is False and cert["upper"] is None
    assert cert["training"]["invertible"] is False
    assert cert["training"]["reconstruction"] is None
    assert "no invertibility certificate" in cert["method"]
    assert c.post("/certificates/verify", json=cert).json()["valid"] is True


def test_training_worker_without_the_signing_key_fails_clearly(
        sqlite_migrated: str, make_settings: Callable[..., Settings], tmp_path: Path) -> None:
    from api_schemas.training import TrainingSpec
    from service.jobs import submit_job
    from service.training.jobs import TrainingJobParams

    missing = tmp_path / "no-key.pem"
    # A worker runtime: nothing consumes its queue, so run_job below is the only run.
    rt = Runtime(make_settings(sqlite_migrated, signing_key_path=missing))
    try:
        params = TrainingJobParams(spec=TrainingSpec(**{**TINY, "corpus": "ptb"}),
                                   corpus_id=None, corpus_sha256=None)
        with transaction(rt.sessions) as s:
            job_id = submit_job(s, rt, "train_certified", params.model_dump(mode="json")).id
        run_job(rt, job_id)
        with rt.sessions() as s:
            job = s.get(Job, job_id)
            assert job is not None and job.status == "failed"
            assert job.error is not None and "LSA_SIGNING_KEY_PATH" in job.error
        assert not missing.exists()
    finally:
        rt.close()
