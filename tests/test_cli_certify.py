"""`lsa certify`: one test per exit code, the JSON/JUnit/Markdown reports, progress output."""

from __future__ import annotations

import io
import json
import socket
import threading
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from api_schemas.certificates import Certificate
from api_schemas.ci import CertifyReport
from lsa_models import L2MHA, DotProductMHA, save
from service.bounds.files import compute_report
from service.certificates.service import verify_certificate
from service.certify.cli_certify import StageProgress
from service.cli import app
from service.signing_key import load_or_create_signing_key

runner = CliRunner()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    out = {"l2": root / "l2.safetensors", "dp": root / "dp.safetensors",
           "junk": root / "junk.safetensors"}
    save(L2MHA(8, 2), out["l2"])
    save(DotProductMHA(8, 2), out["dp"])
    out["junk"].write_bytes(b"definitely not a model")
    return out


@pytest.fixture(scope="module")
def l2_upper(models: dict[str, Path]) -> float:
    upper = compute_report(models["l2"], "2", 8, None).upper
    assert upper is not None
    return upper


def certify(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["certify", *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        result.exception
    return result.exit_code, result.stdout, result.stderr


def test_certify_exit_0_when_bound_below_threshold(models: dict[str, Path], l2_upper: float,
                                                   tmp_path: Path) -> None:
    key = tmp_path / "key.pem"
    out = tmp_path / "report.json"
    code, stdout, _ = certify(str(models["l2"]), "--max-lipschitz", str(2 * l2_upper),
                              "--seq-len", "8", "--key", str(key), "--json", str(out))
    assert code == 0, stdout
    assert stdout.startswith("PASSED")
    report = CertifyReport.model_validate_json(out.read_text())
    assert report.outcome == "passed" and report.source == "local"
    assert report.certificate.passed and report.certificate.upper == l2_upper
    assert report.certificate.threshold == 2 * l2_upper
    # The bound in the report is exactly what `lsa bound --json` computes.
    assert report.bound == compute_report(models["l2"], "2", 8, None)
    # Signed with the local key: verifiable offline.
    signing = load_or_create_signing_key(key)
    assert verify_certificate(report.certificate, signing.public_key()).valid


def test_certify_exit_1_when_bound_above_threshold(models: dict[str, Path], l2_upper: float,
                                                   tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    out = tmp_path / "report.json"
    threshold = l2_upper * 0.99
    code, stdout, _ = certify(str(models["l2"]), "--max-lipschitz", repr(threshold),
                              "--seq-len", "8", "--key", str(tmp_path / "k.pem"),
                              "--junit", str(junit), "--json", str(out))
    assert code == 1
    assert stdout.startswith("FAILED") and "exceeds the threshold" in stdout
    report = CertifyReport.model_validate_json(out.read_text())
    assert report.outcome == "failed" and not report.certificate.passed
    root = ET.parse(junit).getroot()
    assert root.tag == "testsuites" and root.get("failures") == "1" and root.get("errors") == "0"
    case = root.find("testsuite/testcase")
    assert case is not None
    assert str(models["l2"]) in (case.get("name") or "")
    assert f"{threshold:g}" in (case.get("name") or "")
    failure = case.find("failure")
    assert failure is not None
    assert "exceeds the threshold" in (failure.get("message") or "")
    assert f"{l2_upper:.6g}" in (failure.get("message") or "")
    props = {p.get("name"): p.get("value") for p in root.iterfind("testsuite/properties/property")}
    assert props["model"] == str(models["l2"])
    assert float(props["threshold"] or "nan") == threshold
    assert float(props["upper"] or "nan") == l2_upper


def test_certify_exit_1_when_not_lipschitz(models: dict[str, Path], tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    out = tmp_path / "report.json"
    code, stdout, _ = certify(str(models["dp"]), "--max-lipschitz", "1e30", "--seq-len", "8",
                              "--key", str(tmp_path / "k.pem"), "--junit", str(junit),
                              "--json", str(out))
    assert code == 1
    assert "not Lipschitz" in stdout
    report = CertifyReport.model_validate_json(out.read_text())
    assert report.bound.verdict == "not_lipschitz"
    assert report.certificate.upper is None and not report.certificate.passed
    failure = ET.parse(junit).getroot().find("testsuite/testcase/failure")
    assert failure is not None and "not Lipschitz" in (failure.get("message") or "")
    assert failure.get("type") == "NotCertified"


def test_certify_radius_bounds_dot_product_domain(models: dict[str, Path],
                                                  tmp_path: Path) -> None:
    """Given a radius the verdict is the library's (certified or not), never 'not Lipschitz'."""
    out = tmp_path / "report.json"
    code, _, _ = certify(str(models["dp"]), "--max-lipschitz", "1e30", "--seq-len", "8",
                         "--radius", "1.0", "--key", str(tmp_path / "k.pem"),
                         "--json", str(out))
    report = CertifyReport.model_validate_json(out.read_text())
    assert report.bound.radius == 1.0 and report.certificate.radius == 1.0
    assert report.bound.verdict != "not_lipschitz"
    assert code == (0 if report.certificate.passed else 1)


@pytest.mark.parametrize("args,needle", [
    (["{missing}", "--max-lipschitz", "10"], "no such file"),
    (["{junk}", "--max-lipschitz", "10"], "junk.safetensors"),
    (["{l2}", "--max-lipschitz", "10", "--norm", "1"], "--norm must be 2 or inf"),
    (["{l2}", "--max-lipschitz", "-1"], "--max-lipschitz must be a finite number > 0"),
    (["{l2}", "--max-lipschitz", "nan"], "--max-lipschitz must be a finite number > 0"),
    (["{l2}", "--max-lipschitz", "10", "--seq-len", "0"], "--seq-len must be >= 1"),
    (["{l2}", "--max-lipschitz", "10", "--server", "localhost:1"], "http:// or https://"),
    (["{l2}", "--max-lipschitz", "10", "--server", "http://127.0.0.1:1", "--key", "{key}"],
     "drop one of them"),
])
def test_certify_exit_2_on_bad_input(models: dict[str, Path], tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch, args: list[str],
                                     needle: str) -> None:
    monkeypatch.setenv("LSA_SIGNING_KEY_PATH", str(tmp_path / "k.pem"))
    paths = {"missing": str(tmp_path / "nope.safetensors"), "junk": str(models["junk"]),
             "l2": str(models["l2"]), "key": str(tmp_path / "k.pem")}
    junit = tmp_path / "junit.xml"
    out = tmp_path / "report.json"
    argv = [a.format(**paths) for a in args]
    code, stdout, stderr = certify(*argv, "--junit", str(junit), "--json", str(out))
    assert code == 2
    last = stderr.splitlines()[-1]
    assert last.startswith("lsa: error:") and needle in last
    assert "Traceback" not in stderr
    # CI still gets a JUnit file saying why; no JSON report without a certificate.
    error = ET.parse(junit).getroot().find("testsuite/testcase/error")
    assert error is not None and needle in (error.get("message") or "")
    assert not out.exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_certify_exit_2_when_server_unreachable(models: dict[str, Path],
                                                tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, _, stderr = certify(str(models["l2"]), "--max-lipschitz", "10", "--server", url,
                              "--retries", "0")
    assert code == 2
    assert url in stderr and "is the server running" in stderr


@pytest.fixture
def failing_server() -> Iterator[tuple[str, list[str]]]:
    """Answers every request with 500 {error, detail}; records the paths."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append(self.path)
            length = int(self.headers.get("content-length") or 0)
            self.rfile.read(length)
            body = b'{"error": "internal", "detail": "disk full"}'
            self.send_response(500)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def test_certify_exit_2_when_server_keeps_failing(models: dict[str, Path], tmp_path: Path,
                                                  failing_server: tuple[str, list[str]]) -> None:
    url, seen = failing_server
    junit = tmp_path / "junit.xml"
    code, _, stderr = certify(str(models["l2"]), "--max-lipschitz", "10", "--server", url,
                              "--retries", "1", "--junit", str(junit))
    assert code == 2
    assert seen == ["/models", "/models"]  # retried once, then gave up
    assert "HTTP 500" in stderr and "disk full" in stderr
    error = ET.parse(junit).getroot().find("testsuite/testcase/error")
    assert error is not None and "disk full" in (error.get("message") or "")


@pytest.fixture
def lying_server() -> Iterator[tuple[str, list[tuple[str, str | None]]]]:
    """Well-formed answers about some other model (the schema examples)."""
    from api_schemas.bounds import BoundReport
    from api_schemas.certificates import CERTIFICATE_EXAMPLE

    answers = {
        "/models": {"id": "m1", "sha256": "9f2c" + "0" * 60, "format": "native",
                    "summary": {}},
        "/bound": BoundReport.model_json_schema()["examples"][0],
        "/certify": {**CERTIFICATE_EXAMPLE, "signature": "c2ln"},
    }
    seen: list[tuple[str, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append((self.path, self.headers.get("Authorization")))
            self.rfile.read(int(self.headers.get("content-length") or 0))
            body = json.dumps(answers[self.path]).encode()
            self.send_response(201 if self.path != "/bound" else 200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def test_certify_exit_2_when_the_server_certifies_another_file(
        models: dict[str, Path], tmp_path: Path,
        lying_server: tuple[str, list[tuple[str, str | None]]]) -> None:
    url, seen = lying_server
    code, _, stderr = certify(str(models["l2"]), "--max-lipschitz", "1e6", "--server", url,
                              "--api-key", "lsa_k_secret")
    assert code == 2
    assert "the certificate is for sha256 9f2c" in stderr
    assert seen == [(path, "Bearer lsa_k_secret") for path in ("/models", "/bound", "/certify")]


def test_certify_summary_markdown_is_appended(models: dict[str, Path], l2_upper: float,
                                              tmp_path: Path) -> None:
    summary = tmp_path / "summary.md"
    summary.write_text("# earlier step\n")
    key = str(tmp_path / "k.pem")
    certify(str(models["l2"]), "--max-lipschitz", "1e6", "--seq-len", "8", "--key", key,
            "--summary", str(summary))
    certify(str(models["dp"]), "--max-lipschitz", "1e6", "--seq-len", "8", "--key", key,
            "--summary", str(summary))
    text = summary.read_text()
    assert text.startswith("# earlier step\n")
    assert f"### ✅ lsa certify passed: `{models['l2']}`" in text
    assert f"### ❌ lsa certify failed: `{models['dp']}`" in text
    assert f"| certified upper bound | {l2_upper:.6g} |" in text
    assert "| threshold | 1e+06 |" in text
    assert f"| &lt;model&gt; | l2_mha | {l2_upper:.6g} | certified |" in text


def test_certify_plain_progress_lines_off_a_terminal(models: dict[str, Path],
                                                     tmp_path: Path) -> None:
    _, _, stderr = certify(str(models["l2"]), "--max-lipschitz", "1e6", "--seq-len", "8",
                           "--key", str(tmp_path / "k.pem"))
    lines = stderr.splitlines()
    assert lines == ["lsa certify: [1/2] loading and bounding the model",
                     "lsa certify: [2/2] signing the certificate"]


def test_certify_progress_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    buf = io.StringIO()
    progress = StageProgress(3, Console(file=buf, force_terminal=True, width=100))
    progress.stage("uploading the model")
    progress.job("bounding", 0.5)
    progress.stage("issuing the certificate")
    progress.close()
    text = buf.getvalue()
    assert "\x1b[" in text  # drawn with terminal control codes
    assert "[1/3]" not in text  # not the plain CI lines


def test_certify_default_key_comes_from_settings(models: dict[str, Path], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    key = tmp_path / "from-env" / "signing.pem"
    monkeypatch.setenv("LSA_SIGNING_KEY_PATH", str(key))
    out = tmp_path / "r.json"
    code, _, _ = certify(str(models["l2"]), "--max-lipschitz", "1e6", "--seq-len", "8",
                         "--json", str(out))
    assert code == 0 and key.is_file()
    cert = Certificate.model_validate(json.loads(out.read_text())["certificate"])
    assert verify_certificate(cert, load_or_create_signing_key(key).public_key()).valid


def test_certify_plain_lines_in_ci_even_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    buf = io.StringIO()
    progress = StageProgress(3, Console(file=buf, force_terminal=True, width=100))
    progress.stage("uploading the model")
    progress.stage("computing the bound")
    progress.job("bounding", 0.5)
    progress.close()
    assert buf.getvalue().splitlines() == ["lsa certify: [1/3] uploading the model",
                                           "lsa certify: [2/3] computing the bound",
                                           "lsa certify:       bounding 50%"]
