"""End to end: `lsa serve` (uvicorn) in a subprocess on a free port, auth on, and the real
`lsa certify --server` / `lsa verify --server` command lines against it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from api_schemas.certificates import Certificate
from api_schemas.ci import CertifyReport
from lsa_models import L2MHA, DotProductMHA, save
from service.bounds.files import compute_report
from service.certificates.service import public_key_pem
from service.cli import app

BIN = Path(sys.executable).parent
STARTUP_S = 90.0


@dataclass(frozen=True)
class Server:
    url: str
    api_key: str
    env: dict[str, str]  # the settings the server runs with (LSA_*), for CLI subprocesses
    log: Path

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any LSA_ setting, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LSA_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


@contextmanager
def running_server(root: Path) -> Iterator[Server]:
    """Migrate a fresh SQLite database, make a write key, start `lsa serve`, wait for it."""
    settings = {
        "LSA_DATABASE_URL": f"sqlite:///{root / 'lsa.db'}",
        "LSA_ARTIFACT_DIR": str(root / "artifacts"),
        "LSA_SIGNING_KEY_PATH": str(root / "server-key.pem"),
        "LSA_AUTH_REQUIRED": "true",
    }
    runner = CliRunner()
    # CliRunner's env= sets and restores os.environ around the call.
    for args in (["db", "upgrade"], ["keys", "create", "--scope", "write"]):
        result = runner.invoke(app, args, env=settings)
        assert result.exit_code == 0, result.output
    api_key = result.stdout.strip().splitlines()[0]
    assert api_key.startswith("lsa_")
    port = free_port()
    log = root / "server.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [str(BIN / "lsa"), "serve", "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "warning"],
            env=clean_env(**settings), stdout=fh, stderr=subprocess.STDOUT, cwd=root)
    url = f"http://127.0.0.1:{port}"
    server = Server(url, api_key, settings, log)
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"lsa serve exited with {proc.returncode}:\n"
                                     f"{server.log_tail()}")
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"lsa serve not up after {STARTUP_S} s:\n"
                                     f"{server.log_tail()}")
            time.sleep(0.2)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory.mktemp("server")) as s:
        yield s


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e2e-models")
    torch.manual_seed(3)
    return {"l2": save(L2MHA(8, 2), root / "l2.safetensors"),
            "dp": save(DotProductMHA(8, 2), root / "dp.safetensors")}


def lsa(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "lsa"), *args], env=clean_env(**env), cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_e2e_certify_server_passes_and_the_report_matches_the_api(
        server: Server, models: dict[str, Path], tmp_path: Path) -> None:
    local = compute_report(models["l2"], "2", 8, None)
    assert local.upper is not None
    report_path = tmp_path / "report.json"
    proc = lsa("certify", str(models["l2"]), "--max-lipschitz", str(2 * local.upper),
               "--seq-len", "8", "--server", server.url, "--json", str(report_path),
               cwd=tmp_path, LSA_API_KEY=server.api_key)
    assert proc.returncode == 0, proc.stderr + server.log_tail()
    assert proc.stdout.startswith("PASSED")
    assert proc.stderr.splitlines() == ["lsa certify: [1/3] uploading the model",
                                        "lsa certify: [2/3] computing the bound",
                                        "lsa certify: [3/3] issuing the certificate"]
    report = CertifyReport.model_validate_json(report_path.read_text())
    assert report.source == "server" and report.server == server.url
    # The server's bound is the same computation as the local one (up to float summation
    # order, should the server's thread count differ).
    assert report.bound.model_dump(exclude={"upper", "layers"}) == local.model_dump(
        exclude={"upper", "layers"})
    assert report.bound.upper == pytest.approx(local.upper, rel=1e-9)
    assert [(lb.name, lb.kind, lb.status) for lb in report.bound.layers] == [
        (lb.name, lb.kind, lb.status) for lb in local.layers]
    # The certificate in the report is the one the server stored, field for field.
    headers = {"Authorization": f"Bearer {server.api_key}"}
    stored = httpx.get(f"{server.url}/certificates/{report.certificate.id}", headers=headers)
    assert stored.status_code == 200
    assert Certificate.model_validate(stored.json()) == report.certificate
    assert report.certificate.passed
    assert report.certificate.upper == report.bound.upper
    check = httpx.post(f"{server.url}/certificates/verify",
                       json=report.certificate.model_dump(mode="json"))
    assert check.json()["valid"] is True


def test_e2e_verify_server_key_and_recompute(server: Server, models: dict[str, Path],
                                             tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    proc = lsa("certify", str(models["l2"]), "--max-lipschitz", "1e6", "--seq-len", "8",
               "--server", server.url, "--json", str(report_path), cwd=tmp_path,
               LSA_API_KEY=server.api_key)
    assert proc.returncode == 0, proc.stderr
    proc = lsa("verify", str(report_path), str(models["l2"]), "--server", server.url,
               "--recompute", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bound: recomputed" in proc.stdout
    # Any other key is not the server's: the same certificate is rejected with it.
    other = tmp_path / "other-key.pem"
    other.write_text(public_key_pem(Ed25519PrivateKey.generate()))
    result = CliRunner().invoke(app, ["verify", str(report_path), "--public-key", str(other)])
    assert result.exit_code == 1 and "signature does not match" in result.stdout


def test_e2e_certify_server_fails_above_threshold_with_junit(
        server: Server, models: dict[str, Path], tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    proc = lsa("certify", str(models["l2"]), "--max-lipschitz", "1e-3", "--seq-len", "8",
               "--server", server.url, "--junit", str(junit), cwd=tmp_path,
               LSA_API_KEY=server.api_key)
    assert proc.returncode == 1, proc.stderr
    failure = ET.parse(junit).getroot().find("testsuite/testcase/failure")
    assert failure is not None and "exceeds the threshold 0.001" in (failure.get("message")
                                                                      or "")


def test_e2e_certify_server_not_lipschitz_fails(server: Server, models: dict[str, Path],
                                                tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    proc = lsa("certify", str(models["dp"]), "--max-lipschitz", "1e30", "--seq-len", "8",
               "--server", server.url, "--json", str(report_path), cwd=tmp_path,
               LSA_API_KEY=server.api_key)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(report_path.read_text())
    assert report["bound"]["verdict"] == "not_lipschitz"
    assert report["certificate"]["upper"] is None and report["certificate"]["passed"] is False


def test_e2e_certify_server_without_api_key_is_an_error(server: Server,
                                                        models: dict[str, Path],
                                                        tmp_path: Path) -> None:
    start = time.monotonic()
    proc = lsa("certify", str(models["l2"]), "--max-lipschitz", "10", "--server", server.url,
               cwd=tmp_path)
    assert proc.returncode == 2
    assert "HTTP 401" in proc.stderr and "API key" in proc.stderr
    assert time.monotonic() - start < 60  # a 4xx is not retried with backoff


def test_e2e_robustness_set_through_the_server_signs_the_local_statuses(
        server: Server, tmp_path: Path) -> None:
    """`lsa robustness --inputs --labels --radius --min-certified-accuracy --server`: the
    server decides the inputs and signs a certified-accuracy certificate whose statuses are
    the local set mode's; exit 0 when it passes, 1 when it does not; --server without the
    threshold, or outside the set mode, is exit 2."""
    from bench.local_models import build, center, export

    model = export(build("mlp", seed=11), tmp_path / "mlp.onnx")
    xs = np.stack([center(s).numpy()[0] for s in (5, 6)])  # (2, N, D)
    f = build("mlp", seed=11).double()
    with torch.no_grad():
        ys = f(torch.from_numpy(xs).double()).argmax(-1).numpy()
    ys[1] = (ys[1] + 1) % 4  # a wrong label: misclassified, so the accuracy is below 1
    np.save(tmp_path / "xs.npy", xs)
    np.save(tmp_path / "ys.npy", ys)
    args = ["robustness", str(model), "--inputs", str(tmp_path / "xs.npy"), "--labels",
            str(tmp_path / "ys.npy"), "--radius", "0.05", "--norm", "inf"]
    local = lsa(*args, "--json", "--counterexamples", str(tmp_path / "local.npz"),
                cwd=tmp_path)
    assert local.returncode == 0, local.stderr
    statuses = [s["status"] for s in json.loads(local.stdout)["samples"]]
    proc = lsa(*args, "--min-certified-accuracy", "0", "--server", server.url, "--json",
               "--certificate", str(tmp_path / "cert.json"), "--counterexamples",
               str(tmp_path / "server.npz"), cwd=tmp_path, LSA_API_KEY=server.api_key)
    assert proc.returncode == 0, proc.stderr + server.log_tail()
    cert = Certificate.model_validate_json(proc.stdout)
    assert Certificate.model_validate_json((tmp_path / "cert.json").read_text()) == cert
    # the server's counterexamples are the local run's (the attack is seeded per input)
    here, there = np.load(tmp_path / "local.npz"), np.load(tmp_path / "server.npz")
    assert all(np.array_equal(here[k], there[k]) for k in here.files)
    assert cert.robustness_set is not None and cert.robustness_set["statuses"] == statuses
    assert cert.passed and cert.threshold == 0
    check = httpx.post(f"{server.url}/certificates/verify", json=cert.model_dump(mode="json"))
    assert check.json()["valid"] is True
    assert statuses[1] == "misclassified"
    high = lsa(*args, "--min-certified-accuracy", "1", "--server", server.url, "--junit",
               str(tmp_path / "junit.xml"), cwd=tmp_path, LSA_API_KEY=server.api_key)
    assert high.returncode == 1 and "failed: certified accuracy" in high.stdout, high.stdout
    # the JUnit of a server's certificate: the gate failed, one case per input by its status
    suite = ET.parse(tmp_path / "junit.xml").getroot().find("testsuite")
    assert suite is not None and suite.get("failures") == "1"
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["certificate_id"] and props["model_sha256"] == cert.model_sha256
    cases = suite.findall("testcase")
    assert [c.find("skipped") is None for c in cases[1:]] == [s == "certified"
                                                               for s in statuses]
    bad = lsa(*args, "--server", server.url, cwd=tmp_path, LSA_API_KEY=server.api_key)
    assert bad.returncode == 2 and "--min-certified-accuracy" in bad.stderr
