"""`lsa verify`: accepts an untouched certificate; rejects any altered field, a wrong model
file, a wrong key, and (--recompute) a correctly signed certificate whose bound is wrong."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from api_schemas.certificates import Certificate
from lsa_models import L2MHA, save
from service.certificates.service import new_certificate_body, public_key_pem, sign_certificate
from service.cli import app
from service.signing_key import load_or_create_signing_key

runner = CliRunner()


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["verify", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        result.exception
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def issued(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A model, its `lsa certify --json` report, the bare certificate, and key files."""
    root = tmp_path_factory.mktemp("verify")
    torch.manual_seed(1)
    model = save(L2MHA(8, 2), root / "model.safetensors")
    other = save(L2MHA(8, 2), root / "other.safetensors")
    key = root / "signing.pem"
    report = root / "report.json"
    result = runner.invoke(app, ["certify", str(model), "--max-lipschitz", "1e6", "--seq-len",
                                 "8", "--key", str(key), "--json", str(report)])
    assert result.exit_code == 0, result.output
    cert = root / "cert.json"
    cert.write_text(json.dumps(json.loads(report.read_text())["certificate"]))
    public = root / "public.pem"
    public.write_text(public_key_pem(load_or_create_signing_key(key)))
    wrong = root / "wrong.pem"
    wrong.write_text(public_key_pem(Ed25519PrivateKey.generate()))
    return {"model": model, "other": other, "key": key, "report": report, "cert": cert,
            "public": public, "wrong": wrong, "root": root}


def test_verify_accepts_untouched_certificate(issued: dict[str, Path]) -> None:
    code, out, _ = invoke(str(issued["cert"]), str(issued["model"]), "--public-key",
                          str(issued["public"]), "--recompute")
    assert code == 0, out
    assert out.splitlines()[0] == "signature: valid"
    assert "model sha256: matches" in out and "bound: recomputed" in out
    assert out.splitlines()[-1].startswith("VALID: certificate")


def test_verify_accepts_the_certify_json_report_and_a_private_key_file(
        issued: dict[str, Path]) -> None:
    code, out, _ = invoke(str(issued["report"]), str(issued["model"]), "--public-key",
                          str(issued["key"]))
    assert code == 0, out


def _flip_hex(s: str) -> str:
    return ("1" if s[0] == "0" else "0") + s[1:]


def _flip_signature(s: str) -> str:
    raw = bytearray(base64.b64decode(s))
    raw[0] ^= 1
    return base64.b64encode(bytes(raw)).decode()


def _later(s: str) -> str:
    return (datetime.fromisoformat(s.replace("Z", "+00:00")) + timedelta(seconds=1)).isoformat()


ALTER: dict[str, Callable[[Any], Any]] = {
    "id": lambda v: v[:-1] + ("0" if v[-1] != "0" else "1"),
    "model_sha256": _flip_hex,
    "norm": lambda v: "inf" if v == "2" else "2",
    "seq_len": lambda v: v + 1,
    "radius": lambda v: 1.0 if v is None else v * 2,
    "threshold": lambda v: v * 10,
    "upper": lambda v: math.nextafter(v, math.inf),  # the smallest possible change
    "lower": lambda v: 0.5 if v is None else v / 2,
    "passed": lambda v: not v,
    "method": lambda v: v + " ",
    "lsa_version": lambda v: v + ".post1",
    "issued_at": _later,
    "signature": _flip_signature,
    # Absent from certificates of uploaded models: adding one must invalidate them too.
    "training": lambda v: {"test_bpc": 1.0} if v is None else {**v, "test_bpc": 0.0},
    "robustness": lambda v: {"certified_radius": 1.0} if v is None
    else {**v, "certified_radius": 0.0},
    "robustness_set": lambda v: {"certified_accuracy": 1.0} if v is None
    else {**v, "certified_accuracy": 0.0},
}


def test_verify_alterations_cover_every_field() -> None:
    assert set(ALTER) == set(Certificate.model_fields)


@pytest.mark.parametrize("field", sorted(ALTER))
def test_verify_rejects_any_altered_field(issued: dict[str, Path], tmp_path: Path,
                                          field: str) -> None:
    data = json.loads(issued["cert"].read_text())
    data[field] = ALTER[field](data.get(field))
    altered = tmp_path / "altered.json"
    altered.write_text(json.dumps(data))
    code, out, _ = invoke(str(altered), "--public-key", str(issued["public"]))
    assert code == 1, (field, out)
    assert out.startswith("INVALID:")


def test_verify_rejects_an_added_field(issued: dict[str, Path], tmp_path: Path) -> None:
    data = json.loads(issued["cert"].read_text())
    data["note"] = "trust me"
    altered = tmp_path / "altered.json"
    altered.write_text(json.dumps(data))
    code, out, _ = invoke(str(altered), "--public-key", str(issued["public"]))
    assert code == 1 and "malformed certificate" in out


def test_verify_rejects_a_wrong_model_file(issued: dict[str, Path]) -> None:
    code, out, _ = invoke(str(issued["cert"]), str(issued["other"]), "--public-key",
                          str(issued["public"]))
    assert code == 1
    assert "has sha256" in out and str(issued["other"]) in out


def test_verify_rejects_a_wrong_key(issued: dict[str, Path]) -> None:
    code, out, _ = invoke(str(issued["cert"]), str(issued["model"]), "--public-key",
                          str(issued["wrong"]))
    assert code == 1
    assert "signature does not match" in out


def _signed(issued: dict[str, Path], tmp_path: Path, **changes: Any) -> Path:
    """A certificate correctly signed by the right key, but with `changes` to its claims."""
    data = json.loads(issued["cert"].read_text())
    data.pop("signature")
    data.pop("id")
    data.pop("issued_at")
    data.update(changes)
    cert = sign_certificate(new_certificate_body(**data), load_or_create_signing_key(
        issued["key"]))
    path = tmp_path / "forged.json"
    path.write_text(cert.model_dump_json())
    return path


def test_verify_recompute_rejects_a_signed_but_wrong_bound(issued: dict[str, Path],
                                                           tmp_path: Path) -> None:
    upper = json.loads(issued["cert"].read_text())["upper"]
    forged = _signed(issued, tmp_path, upper=upper * (1 + 1e-6))
    # The signature alone cannot tell: it is the right key.
    code, _, _ = invoke(str(forged), str(issued["model"]), "--public-key", str(issued["public"]))
    assert code == 0
    code, out, _ = invoke(str(forged), str(issued["model"]), "--public-key",
                          str(issued["public"]), "--recompute")
    assert code == 1 and "recomputed bound" in out


def test_verify_recompute_rejects_an_inconsistent_verdict(issued: dict[str, Path],
                                                          tmp_path: Path) -> None:
    upper = json.loads(issued["cert"].read_text())["upper"]
    forged = _signed(issued, tmp_path, threshold=upper / 2, passed=True)
    # the lipschitz rule on the signed upper bound tells, without recomputing anything
    code, out, _ = invoke(str(forged), "--public-key", str(issued["public"]))
    assert code == 1 and "the lipschitz rule" in out and "passed=False" in out, out
    code, out, _ = invoke(str(forged), str(issued["model"]), "--public-key",
                          str(issued["public"]), "--recompute")
    assert code == 1 and "passed=True" in out


def test_verify_recompute_tolerance_is_relative_1e_9() -> None:
    from service.certify.cli_verify import same_bound

    assert same_bound(100.0, 100.0 * (1 + 5e-10))
    assert not same_bound(100.0, 100.0 * (1 + 2e-9))
    assert same_bound(None, None) and not same_bound(None, 1.0) and not same_bound(1.0, None)


def test_verify_default_key_is_the_local_signing_key(issued: dict[str, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LSA_SIGNING_KEY_PATH", str(issued["key"]))
    code, out, _ = invoke(str(issued["cert"]), str(issued["model"]))
    assert code == 0, out
    monkeypatch.setenv("LSA_SIGNING_KEY_PATH", str(issued["root"] / "absent.pem"))
    code, _, err = invoke(str(issued["cert"]))
    assert code == 2 and "--public-key" in err


@pytest.mark.parametrize("case,needle", [
    ("missing_cert", "no such file"),
    ("not_json", "not JSON"),
    ("missing_key", "cannot read the key"),
    ("not_a_key", "not a PEM public key"),
    ("recompute_without_model", "--recompute needs the MODEL"),
    ("two_key_sources", "not both"),
    ("missing_model", "no such file"),
])
def test_verify_exit_2_on_bad_input(issued: dict[str, Path], tmp_path: Path, case: str,
                                    needle: str) -> None:
    cert, pub = str(issued["cert"]), str(issued["public"])
    junk = tmp_path / "junk.txt"
    junk.write_text("{ not json")
    args = {
        "missing_cert": [str(tmp_path / "none.json"), "--public-key", pub],
        "not_json": [str(junk), "--public-key", pub],
        "missing_key": [cert, "--public-key", str(tmp_path / "none.pem")],
        "not_a_key": [cert, "--public-key", str(junk)],
        "recompute_without_model": [cert, "--public-key", pub, "--recompute"],
        "two_key_sources": [cert, "--public-key", pub, "--server", "http://127.0.0.1:1"],
        "missing_model": [cert, str(tmp_path / "none.safetensors"), "--public-key", pub],
    }[case]
    code, _, err = invoke(*args)
    assert code == 2
    assert err.startswith("lsa: error:") and needle in err


# --- robustness certificates: --recompute --at X0.npy -------------------------------------


@pytest.fixture(scope="module")
def robust_issued(issued: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                  ) -> dict[str, Any]:
    """An MLP classifier (ONNX), a centre, its radii, and a certificate signed with the
    local key the way the server signs one (service.certificates.service.robustness_body)."""
    import numpy as np

    from bench.local_models import build, center, export
    from service.certificates.service import robustness_body, sign
    from service.robustness.verdicts import robustness_of

    root = tmp_path_factory.mktemp("robust")
    model = export(build("mlp", seed=3), root / "mlp.onnx")
    x0 = center(4).numpy().astype(np.float64)  # (1, N, D)
    np.save(root / "x0.npy", x0)
    np.save(root / "x1.npy", x0 + 1e-3)
    res = runner.invoke(app, ["robustness", str(model), "--at", str(root / "x0.npy"),
                              "--label", "0", "--json"])
    assert res.exit_code == 0, res.output
    label = int(json.loads(res.stdout)["predicted"])
    from service.kit.inputs import load_model

    radii = robustness_of(load_model(model), hashlib.sha256(model.read_bytes()).hexdigest(),
                          x0, label, "2")
    assert radii["certified_radius"] > 0
    key = load_or_create_signing_key(issued["key"])
    cert = sign(robustness_body(radii, x0.shape[-2], radii["certified_radius"] / 2), key)
    path = root / "cert.json"
    path.write_text(cert.model_dump_json())
    return {"model": model, "x0": root / "x0.npy", "x1": root / "x1.npy", "cert": path,
            "radii": radii, "key": key, "root": root}


def _robust_forged(r: dict[str, Any], radius_factor: float = 1.0,
                   passed: bool | None = None) -> Path:
    from service.certificates.service import robustness_body, sign

    radii = {**r["radii"], "certified_radius": r["radii"]["certified_radius"] * radius_factor}
    cert = sign(robustness_body(radii, 8, r["radii"]["certified_radius"] / 2), r["key"])
    if passed is not None:
        body = {k: v for k, v in cert.model_dump().items() if k != "signature"}
        cert = sign_certificate(new_certificate_body(**{**body, "passed": passed}), r["key"])
    path = r["root"] / f"forged-{uuid.uuid4().hex[:8]}.json"
    path.write_text(cert.model_dump_json())
    return path


def test_verify_recompute_robustness_reaches_the_same_radius(
        issued: dict[str, Path], robust_issued: dict[str, Any]) -> None:
    r = robust_issued
    code, out, err = invoke(str(r["cert"]), str(r["model"]), "--public-key",
                            str(issued["public"]), "--recompute", "--at", str(r["x0"]))
    assert code == 0, (out, err)
    assert f"certified radius: recomputed {r['radii']['certified_radius']}" in out
    assert "VALID: robustness certificate" in out and "passed" in out


def test_verify_recompute_robustness_rejects_a_signed_but_wrong_radius(
        issued: dict[str, Path], robust_issued: dict[str, Any]) -> None:
    r = robust_issued
    forged = _robust_forged(r, radius_factor=1 + 1e-6)
    code, _, _ = invoke(str(forged), str(r["model"]), "--public-key", str(issued["public"]))
    assert code == 0  # the signature alone cannot tell: it is the right key
    code, out, _ = invoke(str(forged), str(r["model"]), "--public-key", str(issued["public"]),
                          "--recompute", "--at", str(r["x0"]))
    assert code == 1 and "recomputed certified radius" in out


def test_verify_recompute_robustness_rejects_an_inconsistent_verdict(
        issued: dict[str, Path], robust_issued: dict[str, Any]) -> None:
    r = robust_issued
    forged = _robust_forged(r, passed=False)  # radius >= min_radius, yet "failed"
    # the robustness rule on the signed radius tells, without recomputing anything
    code, out, _ = invoke(str(forged), "--public-key", str(issued["public"]))
    assert code == 1 and "the robustness rule" in out and "passed=True" in out, out
    code, out, _ = invoke(str(forged), str(r["model"]), "--public-key", str(issued["public"]),
                          "--recompute", "--at", str(r["x0"]))
    assert code == 1 and "passed=False" in out


def test_verify_recompute_robustness_rejects_another_centre(
        issued: dict[str, Path], robust_issued: dict[str, Any]) -> None:
    r = robust_issued
    code, out, _ = invoke(str(r["cert"]), str(r["model"]), "--public-key",
                          str(issued["public"]), "--recompute", "--at", str(r["x1"]))
    assert code == 1 and "INVALID" in out and r["radii"]["center_sha256"] in out


@pytest.mark.parametrize("case,needle", [
    ("no_at", "needs the input it was issued for"),
    ("at_without_recompute", "add --recompute"),
    ("at_on_a_lipschitz_certificate", "drop --at"),
    ("at_missing_file", "no such file"),
    ("at_wrong_shape", "the input has shape"),
])
def test_verify_recompute_robustness_exit_2_on_bad_input(
        issued: dict[str, Path], robust_issued: dict[str, Any], tmp_path: Path, case: str,
        needle: str) -> None:
    import numpy as np

    r = robust_issued
    np.save(tmp_path / "short.npy", np.zeros((3, 16)))
    pub, cert, model = str(issued["public"]), str(r["cert"]), str(r["model"])
    args = {
        "no_at": [cert, model, "--public-key", pub, "--recompute"],
        "at_without_recompute": [cert, model, "--public-key", pub, "--at", str(r["x0"])],
        "at_on_a_lipschitz_certificate": [str(issued["cert"]), str(issued["model"]),
                                          "--public-key", pub, "--recompute", "--at",
                                          str(r["x0"])],
        "at_missing_file": [cert, model, "--public-key", pub, "--recompute", "--at",
                            str(tmp_path / "none.npy")],
        "at_wrong_shape": [cert, model, "--public-key", pub, "--recompute", "--at",
                           str(tmp_path / "short.npy")],
    }[case]
    code, out, err = invoke(*args)
    assert code == 2, (out, err)
    assert err.startswith("lsa: error:") and needle in err
