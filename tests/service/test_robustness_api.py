"""POST /certify with `at`, `label`, `min_radius`: a `robustness` job (202, Location,
Retry-After; progress is the radius sweep's step) whose result is a signed certificate that passes
iff the certified radius >= min_radius; the radii are stored per (model, centre, label, norm),
so another min_radius is answered at once (201), also by a fresh server; the certificate is
verifiable by POST /certificates/verify and `lsa verify [--recompute --at]` (any altered
field: invalid); bad input is 4xx naming the field before anything is queued."""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from typer.testing import CliRunner

from bench.local_models import build, center, export
from service.app import create_app
from service.cli import app as cli
from service.db import make_engine
from service.jobs.context import JobAborted, JobContext
from service.settings import Settings
from service.tables import Job, RobustnessResultRow, RobustnessSetResultRow
from service.tasks import SET_WORKERS_PRELOAD

from .conftest import rows_of, upload


@pytest.fixture
def mlp_onnx(tmp_path: Path) -> Path:
    # A new model per test: the session's database is shared, but each test's artifact
    # directory is its own, so a model uploaded before would have no bytes here.
    return export(build("mlp", seed=uuid.uuid4().int % 2**31), tmp_path / "mlp.onnx")


def seed4_mlp(tmp_path: Path) -> Path:
    """The MLP of seed 4 (on its inf-ball at 0.05 around centres 5-8 the sweep certifies two
    inputs and the attack flips one), its ONNX doc string made unique: the session's
    database is shared, and a model uploaded by another test has its bytes in that test's
    artifact directory."""
    import onnx

    path = export(build("mlp", seed=4), tmp_path / "mlp.onnx")
    proto = onnx.load(str(path))
    proto.doc_string = str(uuid.uuid4())
    onnx.save(proto, str(path))
    return path


def predicted_label(model: Path, x0: np.ndarray) -> int:
    from lsa_models.onnx import load_onnx

    f = load_onnx(model.read_bytes()).module.with_dtype(torch.float64)
    with torch.no_grad():
        return int(f(torch.from_numpy(x0)).argmax())


def wait_job(c: TestClient, accepted: Any, timeout: float = 180) -> dict[str, Any]:
    """Poll a 202's job to its end; the job's final row."""
    assert accepted.status_code == 202, accepted.text
    body = accepted.json()
    assert body["url"] == f"/jobs/{body['job_id']}" == accepted.headers["location"]
    assert int(accepted.headers["retry-after"]) >= 1
    deadline = time.monotonic() + timeout
    while True:
        r = c.get(body["url"])
        job = r.json()
        if job["status"] not in ("queued", "running"):
            assert "retry-after" not in r.headers
            return dict(job)
        assert int(r.headers["retry-after"]) >= 1
        assert time.monotonic() < deadline, job
        time.sleep(0.1)


def jobs_of(db_url: str, model_id: str) -> int:
    """How many jobs the database holds for the model."""
    return rows_of(db_url, Job, model_id)


def counted_calls(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """`module.name` replaced by a wrapper that appends 1 to the returned list per call."""
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def hold_first_job(monkeypatch: pytest.MonkeyPatch, stage: str
                   ) -> tuple[threading.Event, threading.Event]:
    """(reached, release): the first job whose progress stage matches the regex `stage` sets
    `reached` and holds there until `release` is set (60 s at most)."""
    reached, release = threading.Event(), threading.Event()
    real_progress = JobContext.progress

    def held(self: JobContext, fraction: float, stage_now: str | None = None, *,
             force: bool = False) -> None:
        if stage_now is not None and re.match(stage, stage_now) and not reached.is_set():
            reached.set()
            release.wait(60)
        real_progress(self, fraction, stage_now, force=force)

    monkeypatch.setattr(JobContext, "progress", held)
    return reached, release


def wait_for_waiting(c: TestClient, job_url: str, other_job: str) -> None:
    """Until the job at `job_url` says it waits for `other_job` (60 s at most)."""
    deadline = time.monotonic() + 60
    while not (c.get(job_url).json()["stage"] or "").startswith(f"waiting for job {other_job}"):
        assert time.monotonic() < deadline
        time.sleep(0.1)


def certify(c: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    """The certificate of a robustness request: at once (201) or through its job."""
    r = c.post("/certify", json=body)
    if r.status_code == 201:
        return dict(r.json())
    job = wait_job(c, r)
    assert job["status"] == "succeeded" and job["kind"] == "robustness", job
    return dict(job["result"])


def test_robustness_certificate_is_a_job_then_cached_and_verifies(
        client: TestClient, mlp_onnx: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    stages: list[str] = []
    real_progress = JobContext.progress

    def recording(self: JobContext, fraction: float, stage: str | None = None, *,
                  force: bool = False) -> None:
        stages.append(stage or "")
        real_progress(self, fraction, stage, force=force)

    monkeypatch.setattr(JobContext, "progress", recording)
    m = upload(client, mlp_onnx.read_bytes(), "mlp.onnx")
    x0 = center(5).numpy().astype(np.float64)  # (1, N, D)
    label = predicted_label(mlp_onnx, x0)
    req = {"model_id": m["id"], "norm": "2", "at": x0.tolist(), "label": label,
           "time_budget_s": None}  # the unbudgeted search: its steps are pinned below
    first = client.post("/certify", json={**req, "min_radius": 1e-9})
    job = wait_job(client, first)
    assert job["status"] == "succeeded" and job["kind"] == "robustness", job
    assert job["queue"] == "bound" and job["progress"] == 1.0
    cert = job["result"]
    rob = cert["robustness"]
    assert rob["certified_radius"] > 1e-9 and cert["passed"] is True
    assert rob["label"] == label and rob["predicted"] == label and rob["min_radius"] == 1e-9
    assert rob["attack_radius"] is None or rob["certified_radius"] <= rob["attack_radius"]
    assert cert["threshold"] == 1e-9 and cert["upper"] is None
    # Progress named each engine run of the radius sweep with the radius certified so far.
    steps = [s for s in stages if re.match(r"radius sweep \d+/\d+, ", s)]
    assert len(steps) == rob["sweep_runs"] > 1
    assert steps[0].startswith("radius sweep 1/30, certified ")
    assert steps[-1] == (f"radius sweep {rob['sweep_runs']}/30, certified "
                         f"{rob['certified_radius']:.3g}")
    # Another min_radius: the stored radii, signed at once (201), the same radius.
    too_far = client.post("/certify", json={**req, "min_radius": 2 * rob["certified_radius"]})
    assert too_far.status_code == 201, too_far.text
    failed = too_far.json()
    assert failed["passed"] is False and failed["id"] != cert["id"]
    assert failed["robustness"]["certified_radius"] == rob["certified_radius"]
    # A label that is not the prediction is certified nowhere: radius 0, failed.
    other = certify(client, {**req, "label": (label + 1) % 4, "min_radius": 1e-9})
    assert other["robustness"]["certified_radius"] == 0 and other["passed"] is False
    # The same input through the CLI gives the same certified radius.
    np.save(tmp_path / "x0.npy", x0)
    res = CliRunner().invoke(cli, ["robustness", str(mlp_onnx), "--at",
                                   str(tmp_path / "x0.npy"), "--label", str(label), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["certified_radius"] == rob["certified_radius"]
    for c in (cert, failed):
        assert client.get(f"/certificates/{c['id']}").json() == c
        assert client.post("/certificates/verify", json=c).json()["valid"] is True
    # Offline, with the server's key; --recompute reaches the same radius around x0.
    pem = client.get("/certificates/public-key").json()["public_key_pem"]
    (tmp_path / "pub.pem").write_text(pem)
    (tmp_path / "cert.json").write_text(json.dumps(cert))
    res = CliRunner().invoke(cli, ["verify", str(tmp_path / "cert.json"), str(mlp_onnx),
                                   "--public-key", str(tmp_path / "pub.pem"), "--recompute",
                                   "--at", str(tmp_path / "x0.npy")])
    assert res.exit_code == 0, res.output
    assert "certified radius: recomputed" in res.stdout and "robustness certificate" in \
        res.stdout
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


def test_robustness_radii_are_stored_once_and_a_fresh_server_signs_from_them(
        db_url: str, mlp_onnx: Path, make_settings: Callable[..., Settings]) -> None:
    settings = make_settings(db_url)
    x0 = center(6).numpy().astype(np.float64)
    with TestClient(create_app(settings)) as c:
        m = upload(c, mlp_onnx.read_bytes(), "mlp.onnx")
        req = {"model_id": m["id"], "norm": "inf", "at": x0.tolist(),
               "label": predicted_label(mlp_onnx, x0)}
        # Two identical requests while the first is queued or running share one job.
        a = c.post("/certify", json={**req, "min_radius": 1e-6})
        b = c.post("/certify", json={**req, "min_radius": 1e-6})
        if b.status_code == 202:
            assert b.json()["job_id"] == a.json()["job_id"]
        first = wait_job(c, a)["result"]
    # Empty memory caches: the stored radii, the centre given without its batch dimension.
    with TestClient(create_app(settings)) as c:
        again = c.post("/certify", json={**req, "at": x0[0].tolist(), "min_radius": 1e-3})
        assert again.status_code == 201, again.text
    cert = again.json()
    assert cert["norm"] == "inf" and cert["threshold"] == 1e-3
    for k in ("certified_radius", "attack_radius", "margins", "center_sha256"):
        assert cert["robustness"][k] == first["robustness"][k]
    rows = rows_of(settings.database_url, RobustnessResultRow, m["id"])
    jobs = rows_of(settings.database_url, Job, m["id"])
    assert rows == 1 and jobs in (1, 2)  # b found a's job, or a had finished


@pytest.mark.parametrize(("body", "field"), [
    ({"label": 0, "min_radius": 0.1}, "at"),
    ({"at": [[1.0]], "min_radius": 0.1}, "label"),
    ({"at": [[1.0]], "label": 0}, "min_radius"),
    ({"at": [[1.0]], "label": -1, "min_radius": 0.1}, "label"),
    ({"at": [[1.0]], "label": 0, "min_radius": 0.1, "max_lipschitz": 10.0}, "max_lipschitz"),
    ({"at": [[1.0]], "label": 0, "min_radius": 0.1, "seq_len": 8}, "seq_len"),
    ({"at": [[1.0]], "label": 0, "min_radius": -1.0}, "min_radius"),
    ({"at": [[1.0]], "label": 0, "min_radius": 0.0}, "min_radius"),
    ({"at": [[1.0]], "label": 0, "min_radius": float("inf")}, "min_radius"),
    ({"at": [[1.0, float("inf")]], "label": 0, "min_radius": 0.1}, "at"),
    ({"at": [[1.0], [2.0, 3.0]], "label": 0, "min_radius": 0.1}, "at"),
    ({"at": [[[[[1.0]]]]], "label": 0, "min_radius": 0.1}, "at"),
    ({"at": [[[[1.0]]], [[[1.0]]]], "label": 0, "min_radius": 0.1}, "at"),
])
def test_robustness_request_mixing_or_missing_is_422(client: TestClient, body: dict[str, Any],
                                                     field: str) -> None:
    r = client.post("/certify", content=json.dumps({"model_id": "m", **body}),
                    headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert field in r.json()["detail"]


def test_robustness_bad_label_or_shape_is_422_before_any_job(
        client: TestClient, db_url: str, mlp_onnx: Path) -> None:
    m = upload(client, mlp_onnx.read_bytes(), "mlp.onnx")
    x0 = center(5).numpy().astype(np.float64)
    req = {"model_id": m["id"], "at": x0.tolist(), "label": 0, "min_radius": 0.1}
    r = client.post("/certify", json={**req, "label": 9})
    assert r.status_code == 422 and "label must be in 0..3" in r.json()["detail"], r.text
    r = client.post("/certify", json={**req, "at": x0[0, :3].tolist()})
    assert r.status_code == 422 and r.json()["detail"].startswith("at: the input has shape")
    r = client.post("/certify", json={**req, "at": x0[0, :, :-1].tolist()})
    assert r.status_code == 422 and "(8, 16)" in r.json()["detail"], r.text
    image = np.zeros((1, 2, 8, 8)).tolist()  # an image for a model that takes tokens
    r = client.post("/certify", json={**req, "at": image})
    assert r.status_code == 422 and r.json()["detail"].startswith("at: "), r.text
    r = client.post("/certify", json={**req, "model_id": str(uuid.uuid4())})
    assert r.status_code == 404 and "POST /models" in r.json()["detail"]
    assert jobs_of(db_url, m["id"]) == 0


def test_robustness_job_of_a_vanished_model_fails_naming_it(
        db_url: str, make_settings: Callable[..., Settings]) -> None:
    from service.robustness.jobs import run_robustness
    from service.runtime import Runtime

    rt = Runtime(make_settings(db_url))
    try:
        params = {"model_id": str(uuid.uuid4()), "norm": "2", "label": 0, "at": [[0.0]],
                  "seq_len": 1, "min_radius": 0.1, "radii_key": "k", "request_key": "r"}
        with pytest.raises(ValueError, match="no longer exists"):
            run_robustness(JobContext(rt, str(uuid.uuid4()), 1, params))
    finally:
        rt.close()


def test_robustness_job_cancelled_mid_bisection_stores_nothing(
        client: TestClient, db_url: str, mlp_onnx: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from service.robustness.jobs import certificate_id_for_job
    from service.tables import CertificateRow

    in_bisection, cancelled, aborted = threading.Event(), threading.Event(), threading.Event()
    real_progress = JobContext.progress

    def held(self: JobContext, fraction: float, stage: str | None = None, *,
             force: bool = False) -> None:
        if stage is not None and re.match(r"radius sweep \d+/", stage):
            in_bisection.set()
            cancelled.wait(60)  # the next progress write is the cancel check
        try:
            real_progress(self, fraction, stage, force=force)
        except JobAborted:
            aborted.set()
            raise

    monkeypatch.setattr(JobContext, "progress", held)
    m = upload(client, mlp_onnx.read_bytes(), "mlp.onnx")
    x0 = center(8).numpy().astype(np.float64)
    r = client.post("/certify", json={"model_id": m["id"], "at": x0.tolist(),
                                      "label": predicted_label(mlp_onnx, x0),
                                      "min_radius": 1e-6})
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    assert in_bisection.wait(60)
    assert client.delete(f"/jobs/{job_id}").json()["status"] == "cancelled"
    cancelled.set()
    assert aborted.wait(30)  # the bisection stopped at its next step
    time.sleep(0.5)  # and the run unwound (run_job writes nothing for an aborted job)
    engine = make_engine(db_url)
    try:
        job = client.get(f"/jobs/{job_id}").json()
        assert job["status"] == "cancelled" and job["result"] is None, job
        with engine.connect() as conn:
            assert conn.scalar(select(func.count()).select_from(RobustnessResultRow).where(
                RobustnessResultRow.model_id == m["id"])) == 0
            assert conn.scalar(select(func.count()).select_from(CertificateRow).where(
                CertificateRow.id == certificate_id_for_job(job_id))) == 0
    finally:
        engine.dispose()


def test_robustness_job_rerun_after_a_crash_returns_its_certificate(
        client: TestClient, db_url: str, mlp_onnx: Path) -> None:
    from sqlalchemy import update

    from service.robustness.jobs import run_robustness

    m = upload(client, mlp_onnx.read_bytes(), "mlp.onnx")
    x0 = center(9).numpy().astype(np.float64)
    r = client.post("/certify", json={"model_id": m["id"], "at": x0.tolist(), "label": 0,
                                      "min_radius": 1e-6})
    job = wait_job(client, r)
    assert job["status"] == "succeeded", job
    # As if its worker died after storing everything: the job is claimed again.
    rt = client.app.state.runtime  # type: ignore[attr-defined]
    with rt.sessions.begin() as s:
        s.execute(update(Job).where(Job.id == job["id"]).values(status="running"))
        params = dict(s.get(Job, job["id"]).params)
    again = run_robustness(JobContext(rt, job["id"], job["attempts"], params))
    assert again == job["result"]
    certs = client.get(f"/certificates/{job['result']['id']}")
    assert certs.status_code == 200 and certs.json() == job["result"]


def test_robustness_certificate_of_a_job_is_stored_once(client: TestClient,
                                                        mlp_onnx: Path) -> None:
    from service.kit.inputs import load_model
    from service.models.service import ModelRef
    from service.robustness.service import issue_robustness_certificate
    from service.robustness.verdicts import robustness_of
    from service.tables import UploadedModel

    m = upload(client, mlp_onnx.read_bytes(), "mlp.onnx")
    rt = client.app.state.runtime  # type: ignore[attr-defined]
    with rt.sessions() as s:
        model = ModelRef.of(s.get(UploadedModel, m["id"]))
    x0 = center(10).numpy().astype(np.float64)
    radii = robustness_of(load_model(mlp_onnx), m["sha256"], x0, 0, "inf")
    cert_id = str(uuid.uuid4())
    # Two attempts of one job (the first presumed dead but finishing): one certificate.
    first = issue_robustness_certificate(rt, model, radii, 8, 1e-3, cert_id=cert_id)
    second = issue_robustness_certificate(rt, model, radii, 8, 1e-3, cert_id=cert_id)
    assert second == first and client.get(f"/certificates/{cert_id}").json() == \
        first.model_dump(mode="json")
    with pytest.raises(ValueError, match="the radii are for model"):
        other = ModelRef(**{**model.__dict__, "sha256": "0" * 64})
        issue_robustness_certificate(rt, other, radii, 8, 1e-3)


def test_robustness_jobs_for_the_same_radii_compute_them_once(
        db_url: str, mlp_onnx: Path, make_settings: Callable[..., Settings],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import service.robustness.jobs as robustness_jobs

    calls = counted_calls(monkeypatch, robustness_jobs, "robustness_of")
    # the first job holds mid-bisection
    in_bisection, release = hold_first_job(monkeypatch, r"radius sweep \d+/")
    x0 = center(11).numpy().astype(np.float64)
    with TestClient(create_app(make_settings(db_url, worker_threads=2))) as c:
        m = upload(c, mlp_onnx.read_bytes(), "mlp.onnx")
        req = {"model_id": m["id"], "at": x0.tolist(), "label": predicted_label(mlp_onnx, x0)}
        a = c.post("/certify", json={**req, "min_radius": 1e-6})
        assert in_bisection.wait(60)
        b = c.post("/certify", json={**req, "min_radius": 1e-3})
        assert b.status_code == 202 and b.json()["job_id"] != a.json()["job_id"]
        wait_for_waiting(c, b.json()["url"], a.json()["job_id"])
        release.set()
        first, second = wait_job(c, a)["result"], wait_job(c, b)["result"]
    assert calls == [1]
    assert first["robustness"]["certified_radius"] == second["robustness"]["certified_radius"]
    assert (first["threshold"], second["threshold"]) == (1e-6, 1e-3)


def test_certified_accuracy_certificate_is_a_job_that_signs_the_verdicts(
        client: TestClient, mlp_onnx: Path, tmp_path: Path) -> None:
    """POST /certify with inputs, labels, min_radius, min_certified_accuracy: a
    `robustness_set` job (progress per input) whose result is a signed certificate: the
    counts and statuses of lsa_models.engine.routes.at_radius.decide_all (the CLI's set mode gives
    the same), passed iff certified_accuracy >= the threshold; it verifies, any altered field
    does not; `lsa verify` checks it, and with --recompute --inputs --labels decides the set
    again: a forged but signed certificate, or another set, is invalid."""
    m = upload(client, mlp_onnx.read_bytes(), "mlp.onnx")
    xs = np.stack([center(s).numpy().astype(np.float64)[0] for s in (5, 6, 7)])  # (3, N, D)
    labels = [predicted_label(mlp_onnx, x[None]) for x in xs]
    labels[2] = (labels[2] + 1) % 4  # one wrong label: misclassified
    req = {"model_id": m["id"], "norm": "inf", "inputs": xs.tolist(), "labels": labels,
           "min_radius": 0.01, "min_certified_accuracy": 0.5, "time_budget_s": None}
    job = wait_job(client, client.post("/certify", json=req))
    assert job["status"] == "succeeded" and job["kind"] == "robustness_set", job
    assert job["queue"] == "bound" and job["progress"] == 1.0
    cert = job["result"]
    rs = cert["robustness_set"]
    assert rs["n"] == 3 and rs["labels"] == labels and rs["statuses"][2] == "misclassified"
    assert sum(rs["counts"].values()) == 3 and rs["radius"] == 0.01
    assert rs["certified_accuracy"] == rs["counts"]["certified"] / 3
    assert cert["threshold"] == 0.5 and cert["upper"] is None
    assert cert["passed"] is (rs["certified_accuracy"] >= 0.5)
    assert "robustness" not in cert
    np.save(tmp_path / "xs.npy", xs)
    np.save(tmp_path / "ys.npy", np.array(labels))
    res = CliRunner().invoke(cli, ["robustness", str(mlp_onnx), "--inputs",
                                   str(tmp_path / "xs.npy"), "--labels",
                                   str(tmp_path / "ys.npy"), "--radius", "0.01", "--norm",
                                   "inf", "--json", "--time-budget", "none"])
    assert res.exit_code == 0, res.output
    assert [s["status"] for s in json.loads(res.stdout)["samples"]] == rs["statuses"]
    assert client.get(f"/certificates/{cert['id']}").json() == cert
    assert client.post("/certificates/verify", json=cert).json()["valid"] is True
    for field, value in (("certified_accuracy", 1.0), ("radius", 1.0),
                         ("inputs_sha256", "0" * 64), ("statuses", ["certified"] * 3)):
        altered = {**cert, "robustness_set": {**rs, field: value}}
        assert client.post("/certificates/verify", json=altered).json()["valid"] is False
    pem = client.get("/certificates/public-key").json()["public_key_pem"]
    (tmp_path / "pub.pem").write_text(pem)
    (tmp_path / "cert.json").write_text(json.dumps(cert))
    ok = CliRunner().invoke(cli, ["verify", str(tmp_path / "cert.json"), str(mlp_onnx),
                                  "--public-key", str(tmp_path / "pub.pem")])
    assert ok.exit_code == 0 and "certified-accuracy certificate" in ok.stdout, ok.output
    verify = ["verify", str(tmp_path / "cert.json"), str(mlp_onnx), "--public-key",
              str(tmp_path / "pub.pem"), "--recompute"]
    again = CliRunner().invoke(cli, verify)
    assert again.exit_code == 2 and "--recompute --inputs X.npy --labels Y.npy" in again.stderr
    sets = ["--inputs", str(tmp_path / "xs.npy"), "--labels", str(tmp_path / "ys.npy")]
    again = CliRunner().invoke(cli, [*verify, *sets])
    assert again.exit_code == 0, again.output
    assert "inputs sha256: matches" in again.stdout and "statuses and the certified" in \
        again.stdout
    # another set (one label changed) is not the one certified
    np.save(tmp_path / "ys2.npy", np.array([labels[0], labels[1], labels[2] + 1]))
    other = CliRunner().invoke(cli, [*verify, "--inputs", str(tmp_path / "xs.npy"),
                                     "--labels", str(tmp_path / "ys2.npy")])
    assert other.exit_code == 1 and "the certificate is for the set" in other.stdout
    # a correctly signed certificate whose statuses are not what the inputs get
    from service.certificates.service import certified_accuracy_body, sign
    from service.signing_key import load_or_create_signing_key

    key = load_or_create_signing_key(tmp_path / "k.pem")
    n = len(rs["statuses"])
    forged_samples = [{"label": y, "status": "certified"} for y in labels]
    forged = sign(certified_accuracy_body(
        {"model_sha256": cert["model_sha256"], "norm": "inf", "n": n,
         "counts": {**rs["counts"]}, "certified_accuracy": 1.0,
         "attack_accuracy": rs["attack_accuracy"], "samples": forged_samples},
        cert["seq_len"], 0.01, 0.5, rs["inputs_sha256"]), key)
    (tmp_path / "forged.json").write_text(forged.model_dump_json())
    bad = CliRunner().invoke(cli, ["verify", str(tmp_path / "forged.json"), str(mlp_onnx),
                                   "--public-key", str(tmp_path / "k.pem"), "--recompute",
                                   *sets])
    differ = [i for i, st in enumerate(rs["statuses"]) if st != "certified"]  # 2 at least
    assert bad.exit_code == 1 and f"decided again, the inputs {differ}" in bad.stdout, \
        bad.output
    for extra, msg in ((["--at", str(tmp_path / "xs.npy")], "--at is for robustness"),):
        wrong = CliRunner().invoke(cli, [*verify, *sets, *extra])
        assert wrong.exit_code == 2 and msg in wrong.stderr
    lone = CliRunner().invoke(cli, verify[:5] + sets)
    assert lone.exit_code == 2 and "add --recompute" in lone.stderr


@pytest.mark.parametrize(("change", "msg"), [
    ({"labels": [0]}, "labels: 1 for 2 inputs"),
    ({"min_certified_accuracy": None}, "min_certified_accuracy: required"),
    ({"min_radius": None}, "min_radius: required"),
    ({"label": 0}, "label: not with inputs/labels"),
    ({"inputs": []}, "inputs: an empty list"),
    ({"min_certified_accuracy": 1.5}, "less than or equal to 1"),
    ({"labels": [0, -1]}, "greater than or equal to 0"),
])
def test_certified_accuracy_request_errors_are_422(client: TestClient, change: dict[str, Any],
                                                   msg: str) -> None:
    x = [[0.0] * 16] * 8
    body = {"model_id": "x", "inputs": [x, x], "labels": [0, 1], "min_radius": 0.1,
            "min_certified_accuracy": 0.5}
    r = client.post("/certify", json={k: v for k, v in {**body, **change}.items()
                                      if v is not None})
    assert r.status_code == 422 and msg in r.text, r.text


def test_certified_accuracy_bad_input_shape_or_label_is_422_before_any_job(
        client: TestClient, db_url: str, mlp_onnx: Path) -> None:
    m = upload(client, mlp_onnx.read_bytes(), "mlp.onnx")
    x = center(5).numpy().astype(np.float64)[0].tolist()
    base = {"model_id": m["id"], "inputs": [x, x], "labels": [0, 1], "min_radius": 0.1,
            "min_certified_accuracy": 0.5}
    short = [row[:15] for row in x]
    r = client.post("/certify", json={**base, "inputs": [short, short]})
    assert r.status_code == 422 and "inputs[0]: the input has shape (8, 15)" in r.text, r.text
    r = client.post("/certify", json={**base, "labels": [0, 9]})
    assert r.status_code == 422 and "label must be in 0..3" in r.text, r.text
    assert jobs_of(db_url, m["id"]) == 0


def test_certified_accuracy_verdicts_are_stored_once_and_signed_for_any_threshold(
        db_url: str, mlp_onnx: Path, make_settings: Callable[..., Settings],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A set's verdicts are decided once per (model, inputs, labels, norm, radius): a
    request with another threshold while the first job runs waits for it (the inputs are
    decided once), and after it, on a fresh server (empty caches), the same set is signed at
    once (201) against any threshold, with the stored statuses, and no new job."""
    import service.robustness.jobs as robustness_jobs

    calls = counted_calls(monkeypatch, robustness_jobs, "verdicts_of")
    # the first job holds after its first input
    deciding, release = hold_first_job(monkeypatch, r"\d+/\d+ inputs decided")
    settings = make_settings(db_url, worker_threads=2)
    xs = np.stack([center(s).numpy().astype(np.float64)[0] for s in (5, 6)])  # (2, N, D)
    labels = [predicted_label(mlp_onnx, x[None]) for x in xs]
    with TestClient(create_app(settings)) as c:
        m = upload(c, mlp_onnx.read_bytes(), "mlp.onnx")
        req = {"model_id": m["id"], "norm": "inf", "inputs": xs.tolist(), "labels": labels,
               "min_radius": 0.01}
        a = c.post("/certify", json={**req, "min_certified_accuracy": 0.5})
        assert deciding.wait(60)
        b = c.post("/certify", json={**req, "min_certified_accuracy": 1.0})
        assert b.status_code == 202 and b.json()["job_id"] != a.json()["job_id"]
        wait_for_waiting(c, b.json()["url"], a.json()["job_id"])
        release.set()
        first, second = wait_job(c, a)["result"], wait_job(c, b)["result"]
    assert calls == [1]
    assert first["robustness_set"]["statuses"] == second["robustness_set"]["statuses"]
    acc = first["robustness_set"]["certified_accuracy"]
    assert (first["passed"], second["passed"]) == (acc >= 0.5, acc >= 1.0)
    with TestClient(create_app(settings)) as c:
        again = c.post("/certify", json={**req, "min_certified_accuracy": 0.0})
        assert again.status_code == 201, again.text
        cert = again.json()
        assert c.post("/certificates/verify", json=cert).json()["valid"] is True
    assert cert["passed"] is True and cert["threshold"] == 0.0
    assert cert["robustness_set"]["statuses"] == first["robustness_set"]["statuses"]
    assert cert["robustness_set"]["inputs_sha256"] == first["robustness_set"]["inputs_sha256"]
    assert calls == [1] and jobs_of(settings.database_url, m["id"]) == 2
    assert rows_of(settings.database_url, RobustnessSetResultRow, m["id"]) == 1


def test_certified_accuracy_without_the_sweep_is_its_own_result(
        client: TestClient, db_url: str, tmp_path: Path) -> None:
    """"sweep": false (the CLI's --no-sweep): a job whose certificate records it, whose
    inputs only the sweep certifies stay unknown, and whose stored verdicts are not those of
    the same set with the sweep (each is decided once, apart); "sweep" without inputs is
    422."""
    mlp_onnx = seed4_mlp(tmp_path)
    m = upload(client, mlp_onnx.read_bytes(), "mlp.onnx")
    xs = np.stack([center(s).numpy().astype(np.float32).astype(np.float64)[0]
                   for s in (5, 6, 7, 8)])
    labels = [predicted_label(mlp_onnx, x[None]) for x in xs]
    req = {"model_id": m["id"], "norm": "inf", "inputs": xs.tolist(), "labels": labels,
           "min_radius": 0.05, "min_certified_accuracy": 0.0, "time_budget_s": None}
    fast = wait_job(client, client.post("/certify", json={**req, "sweep": False}))["result"]
    full = wait_job(client, client.post("/certify", json=req))["result"]
    assert fast["robustness_set"]["sweep"] is False and "sweep" not in full["robustness_set"]
    by_sweep = [a != b for a, b in zip(full["robustness_set"]["statuses"],
                                       fast["robustness_set"]["statuses"], strict=True)]
    assert any(by_sweep)  # the premise: on this set the sweep certifies some input
    for a, b, differs in zip(full["robustness_set"]["statuses"],
                             fast["robustness_set"]["statuses"], by_sweep, strict=True):
        assert (a, b) == ("certified", "unknown") if differs else a == b
    assert client.post("/certificates/verify", json=fast).json()["valid"] is True
    assert jobs_of(db_url, m["id"]) == 2
    again = client.post("/certify", json={**req, "sweep": False, "min_certified_accuracy": 1})
    assert again.status_code == 201 and again.json()["robustness_set"]["sweep"] is False
    bad = client.post("/certify", json={"model_id": m["id"], "max_lipschitz": 1.0,
                                        "sweep": False})
    assert bad.status_code == 422 and "sweep: only with inputs" in bad.text


def test_certified_accuracy_counterexamples_are_flips_of_the_set(
        client: TestClient, tmp_path: Path) -> None:
    """GET /certificates/{id}/counterexamples: one per attacked status, each a point within
    the radius of its input (as sent) where the model's largest output is the flip class, not
    the label; the same for a certificate signed later from the stored verdicts; 404 naming
    the reason for a Lipschitz certificate or an unknown id."""
    from lsa_models.onnx import load_onnx

    path = seed4_mlp(tmp_path)
    m = upload(client, path.read_bytes(), "mlp.onnx")
    xs = np.stack([center(s).numpy().astype(np.float32).astype(np.float64)[0]
                   for s in (5, 6, 7, 8)])  # (4, N, D)
    labels = [predicted_label(path, x[None]) for x in xs]
    req = {"model_id": m["id"], "norm": "inf", "inputs": xs.tolist(), "labels": labels,
           "min_radius": 0.05, "min_certified_accuracy": 0.5, "time_budget_s": None}
    cert = wait_job(client, client.post("/certify", json=req))["result"]
    statuses = cert["robustness_set"]["statuses"]
    assert "attacked" in statuses  # the premise, as in the CLI's test of this model
    got = client.get(f"/certificates/{cert['id']}/counterexamples")
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["certificate_id"] == cert["id"] and body["radius"] == 0.05
    items = body["counterexamples"]
    assert [c["index"] for c in items] == [i for i, s in enumerate(statuses) if s == "attacked"]
    f64 = load_onnx(path.read_bytes()).module.with_dtype(torch.float64)
    for c in items:
        point = np.asarray(c["input"])
        assert point.shape == xs[c["index"]].shape
        assert np.abs(point - xs[c["index"]]).max() <= 0.05
        with torch.no_grad():
            assert int(f64(torch.from_numpy(point[None])).argmax()) == c["flip_class"] \
                != c["label"] == labels[c["index"]]
    later = client.post("/certify", json={**req, "min_certified_accuracy": 1.0})
    assert later.status_code == 201
    again = client.get(f"/certificates/{later.json()['id']}/counterexamples").json()
    assert again["counterexamples"] == items
    # the memory cache keeps the verdicts without the points (as large as the inputs each)
    rt = client.app.state.runtime  # type: ignore[attr-defined]
    from service.robustness.service import SET_MEMORY_PREFIX, set_result_key

    key = set_result_key(cert["model_sha256"], cert["robustness_set"]["inputs_sha256"], "inf",
                         0.05)
    cached = rt.reports.get(SET_MEMORY_PREFIX + key)
    assert isinstance(cached, bytes) and "counterexamples" not in json.loads(cached)
    lip = certify(client, {"model_id": m["id"], "norm": "2", "max_lipschitz": 1e9})
    none = client.get(f"/certificates/{lip['id']}/counterexamples")
    assert none.status_code == 404 and "not a certified-accuracy certificate" in none.text
    assert client.get("/certificates/nope/counterexamples").status_code == 404


def test_certified_accuracy_job_decides_in_worker_processes_and_a_cancel_ends_them(
        db_url: str, tmp_path: Path, make_settings: Callable[..., Settings],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """LSA_SET_WORKERS=2: a set job decides its inputs in processes from a forkserver (the
    server's threads are never forked), with the serial verdicts; a job cancelled while its
    inputs are being decided ends its worker processes (idle ones shut down, busy ones
    killed: tests/service/test_set_pool.py pins that on slower inputs) and stores nothing."""
    from lsa_models.engine.routes import at_radius
    from lsa_models.onnx import load_onnx
    from service.robustness import set_pool

    methods: list[str] = []
    pools: list[Any] = []
    real = set_pool._in_processes

    def spy(*args: Any) -> Any:
        methods.append(args[7])  # the start method
        return real(*args)

    class Recorded(set_pool.ProcessPoolExecutor):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            pools.append(self)

    # the server starts the forkserver with the preload its jobs' pools ask for
    assert SET_WORKERS_PRELOAD == set_pool.FORKSERVER_PRELOAD
    monkeypatch.setattr(set_pool, "_in_processes", spy)
    monkeypatch.setattr(set_pool, "ProcessPoolExecutor", Recorded)
    path = seed4_mlp(tmp_path)
    om = load_onnx(path.read_bytes())
    xs = np.stack([center(s).numpy().astype(np.float64)[0] for s in (5, 6, 7, 8)])
    labels = [predicted_label(path, x[None]) for x in xs]
    serial = [v.status for v in at_radius.decide_all(om, xs, np.array(labels), "inf",
                                                         0.05).verdicts]
    settings = make_settings(db_url, set_workers=2)
    req = {"norm": "inf", "inputs": xs.tolist(), "labels": labels, "min_radius": 0.05,
           "min_certified_accuracy": 0.5, "time_budget_s": None}
    with TestClient(create_app(settings)) as c:
        m = upload(c, path.read_bytes(), "mlp.onnx")
        job = wait_job(c, c.post("/certify", json={**req, "model_id": m["id"]}))
        assert job["status"] == "succeeded", job
        assert job["result"]["robustness_set"]["statuses"] == serial
        assert methods == ["forkserver"]

        # another set (radius 0.06) held after its first input until it is cancelled
        deciding, release = hold_first_job(monkeypatch, r"\d+/\d+ inputs decided")
        r = c.post("/certify", json={**req, "model_id": m["id"], "min_radius": 0.06})
        assert r.status_code == 202, r.text
        assert deciding.wait(60)
        procs = list(pools[-1]._processes.values())
        assert len(pools) == 2 and len(procs) == 2
        assert c.delete(r.json()["url"]).json()["status"] == "cancelled"
        release.set()  # the next progress write is the cancel check
        deadline = time.monotonic() + 30
        while any(p.exitcode is None for p in procs):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert c.get(r.json()["url"]).json()["status"] == "cancelled"
    assert rows_of(settings.database_url, RobustnessSetResultRow, m["id"]) == 1
