"""Every kind of certificate judged alike by the library, `lsa verify` and POST
/certificates/verify: one passing and one failing certificate of each kind, issued by the
server, and a forgery of each (signed with the server's key, `passed` flipped) that all three
judges refuse under the kind's pass rule (service.certificates.service)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from api_schemas.certificates import Certificate, CertificateBody
from bench.local_models import build, center, export
from service.app import create_app
from service.certificates.service import (
    RULE_TEXT,
    kind_of,
    new_certificate_body,
    sign_certificate,
    verdict,
    verify_certificate,
)
from service.cli import app as cli
from service.settings import Settings
from service.signing_key import load_or_create_signing_key

from .conftest import tiny_model_bytes, upload
from .test_robustness_api import predicted_label, wait_job
from .test_training import TINY, poll, tiny_corpus_id

KINDS = ("lipschitz", "robustness", "certified_accuracy", "training")


@pytest.fixture
def kinds_client(sqlite_migrated: str, make_settings: Callable[..., Settings]
                 ) -> Iterator[TestClient]:
    app = create_app(make_settings(sqlite_migrated, max_training_steps=10_000,
                                   max_corpus_bytes=64 * 1024))
    with TestClient(app) as c:
        yield c


def _certify(c: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    """The certificate of one POST /certify: at once (201) or as its job's result."""
    r = c.post("/certify", json=body)
    if r.status_code == 201:
        return dict(r.json())
    job = wait_job(c, r) if "training" not in body else poll(c, r.json()["job_id"], 120)
    assert job["status"] == "succeeded", job
    result = job["result"]
    if "certificate_id" in result:  # a training job's result names its certificate
        result = c.get(f"/certificates/{result['certificate_id']}").json()
    return dict(result)


def issued_pair(c: TestClient, kind: str, tmp_path: Path) -> tuple[dict[str, Any], ...]:
    """(a passing certificate, a failing one) of `kind`, both issued by the server."""
    if kind == "lipschitz":
        m = upload(c, tiny_model_bytes(seed=uuid.uuid4().int % 2**31))
        req = {"kind": "lipschitz", "model_id": m["id"], "norm": "2", "seq_len": 4}
        return (_certify(c, {**req, "max_lipschitz": 1e12}),
                _certify(c, {**req, "max_lipschitz": 1e-9}))
    model = export(build("mlp", seed=uuid.uuid4().int % 2**31), tmp_path / "mlp.onnx")
    m = upload(c, model.read_bytes(), "mlp.onnx")
    xs = [center(i).numpy().astype(np.float64) for i in (1, 2)]
    labels = [predicted_label(model, x) for x in xs]
    if kind == "robustness":
        req = {"kind": "robustness", "model_id": m["id"], "norm": "inf", "at": xs[0].tolist(),
               "label": labels[0]}
        return (_certify(c, {**req, "min_radius": 1e-6}),
                _certify(c, {**req, "min_radius": 1e6}))
    if kind == "certified_accuracy":
        # the second input's label is not its prediction: misclassified, so accuracy < 1
        req = {"kind": "certified_accuracy", "model_id": m["id"], "norm": "inf",
               "inputs": [x.tolist() for x in xs],
               "labels": [labels[0], 1 if labels[1] == 0 else 0],
               "min_radius": 1e-6}
        return (_certify(c, {**req, "min_certified_accuracy": 0.0}),
                _certify(c, {**req, "min_certified_accuracy": 1.0}))
    spec = {**TINY, "steps": 8, "corpus": tiny_corpus_id(c)}
    # contractive branches <= c < 1: invertible; dot-product attention: never
    return (_certify(c, {"kind": "training", "training": spec}),
            _certify(c, {"kind": "training", "training": {**spec, "attention": "dp"}}))


def forged(cert: dict[str, Any], key_path: Path) -> dict[str, Any]:
    """`cert` with `passed` flipped, correctly signed with the server's own key."""
    fields = {k: v for k, v in cert.items() if k != "signature"}
    body = new_certificate_body(**{**fields, "passed": not cert["passed"]})
    return sign_certificate(body, load_or_create_signing_key(key_path)).model_dump(mode="json")


def judge_library(cert: dict[str, Any], public_pem: str) -> tuple[Any, ...]:
    res = verify_certificate(cert, public_pem)
    return ("valid", res.passed) if res.valid else ("invalid",)


def judge_cli(cert: dict[str, Any], public: Path, tmp_path: Path) -> tuple[Any, ...]:
    path = tmp_path / f"cert-{uuid.uuid4().hex[:8]}.json"
    path.write_text(json.dumps(cert))
    res = CliRunner().invoke(cli, ["verify", str(path), "--public-key", str(public)])
    if res.exit_code == 1:
        assert "INVALID" in res.stdout, res.output
        return ("invalid",)
    assert res.exit_code == 0, res.output
    said = re.search(r"^VALID: .*? \((passed|failed): ", res.stdout, re.M)
    assert said is not None, res.stdout
    return ("valid", said.group(1) == "passed")


def judge_rest(c: TestClient, cert: dict[str, Any]) -> tuple[Any, ...]:
    r = c.post("/certificates/verify", json=cert)
    assert r.status_code == 200, r.text
    out = r.json()
    return ("valid", out["passed"]) if out["valid"] else ("invalid",)


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_gets_the_same_verdict_from_library_cli_and_rest(
        kinds_client: TestClient, kind: str, tmp_path: Path) -> None:
    c = kinds_client
    public_pem = c.get("/certificates/public-key").json()["public_key_pem"]
    public = tmp_path / "public.pem"
    public.write_text(public_pem)
    key_path = c.app.state.runtime.settings.signing_key_path  # type: ignore[attr-defined]
    good, bad = issued_pair(c, kind, tmp_path)
    for cert, passed in ((good, True), (bad, False)):
        body = CertificateBody.model_validate(
            {k: v for k, v in cert.items() if k != "signature"})
        assert kind_of(body) == kind and cert["passed"] is passed, cert
        assert verdict(body) is passed  # the kind's rule on the signed figures
        want = ("valid", passed)
        assert judge_library(cert, public_pem) == want
        assert judge_cli(cert, public, tmp_path) == want
        assert judge_rest(c, cert) == want
        fake = forged(cert, key_path)
        assert judge_library(fake, public_pem) == judge_cli(fake, public, tmp_path) == \
            judge_rest(c, fake) == ("invalid",)
        reason = c.post("/certificates/verify", json=fake).json()["reason"]
        assert f"the {kind} rule ({RULE_TEXT[kind]})" in reason and \
            f"passed={not passed}" in reason
    # the signature still guards every field: an altered figure is refused by all three
    altered = {**good, "threshold": good["threshold"] * 2 + 1}
    assert judge_library(altered, public_pem) == judge_cli(altered, public, tmp_path) == \
        judge_rest(c, altered) == ("invalid",)
    Certificate.model_validate(good)
