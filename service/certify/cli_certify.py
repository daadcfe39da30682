"""`lsa certify MODEL --max-lipschitz L`: the CI gate.

Exit 0: the certified bound is at most L. Exit 1: it is above L, or none exists (not
Lipschitz on the domain, or not certified). Exit 2: bad input or the server could not be used.
Without `--server` everything runs here and the certificate is signed with a local key, so
`lsa verify` checks local and server certificates alike.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from api_schemas.bounds import BoundReport
from api_schemas.certificates import Certificate
from api_schemas.ci import CertifyReport, Outcome
from service.certificates.service import lipschitz_body, sign
from service.client import ClientConfig, ClientError, LSAClient
from service.signing_key import SigningKeyError, load_or_create_signing_key

from ..bounds.files import compute_report
from ..kit.console import EXIT_ERROR, EXIT_FAILED, EXIT_OK, local_key_path, set_threads
from ..kit.gate_reports import append_summary, junit_bytes, junit_suite, md_cell, write_file

LOCAL_STEPS = ("loading and bounding the model", "signing the certificate")
SERVER_STEPS = ("uploading the model", "computing the bound", "issuing the certificate")


class CertifyError(Exception):
    """Bad input or an unusable server: exit 2, and the message goes to every report."""


# --- progress ------------------------------------------------------------------------------


class StageProgress:
    """A rich progress bar on a terminal; one plain line per stage otherwise (CI logs keep
    every line, and carriage-return redraws turn into noise there)."""

    def __init__(self, total: int, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.total = total
        self.done = 0
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        # Some CI runners allocate a pseudo-terminal; CI=... still means a log file.
        if self.console.is_terminal and not os.environ.get("CI"):
            self._bar = Progress(TextColumn("[bold]lsa certify[/]"), BarColumn(),
                                 TextColumn("{task.description}"), TimeElapsedColumn(),
                                 console=self.console, transient=True)
            self._task = self._bar.add_task("starting", total=total)
            self._bar.start()

    def stage(self, text: str) -> None:
        """Begin the next stage."""
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=self.done, description=text)
        else:
            print(f"lsa certify: [{self.done + 1}/{self.total}] {text}",
                  file=self.console.file, flush=True)
        self.done += 1

    def job(self, stage: str, fraction: float | None) -> None:
        """Progress reported by a server job within the current stage."""
        frac = min(max(float(fraction), 0.0), 1.0) if fraction is not None else None
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=stage,
                             completed=self.done - 1 + (frac or 0.0))
        else:
            pct = "" if frac is None else f" {100 * frac:.0f}%"
            print(f"lsa certify:       {stage}{pct}", file=self.console.file, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


# --- the decision --------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    model: Path
    threshold: float
    norm: str
    seq_len: int | None
    radius: float | None


def check_request(req: Request) -> None:
    if req.norm not in ("2", "inf"):
        raise CertifyError(f"--norm must be 2 or inf, got {req.norm!r}")
    if not (math.isfinite(req.threshold) and req.threshold > 0):
        raise CertifyError(f"--max-lipschitz must be a finite number > 0, got {req.threshold}")
    if req.seq_len is not None and req.seq_len < 1:
        raise CertifyError(f"--seq-len must be >= 1, got {req.seq_len}")
    if req.radius is not None and not (math.isfinite(req.radius) and req.radius > 0):
        raise CertifyError(f"--radius must be a finite number > 0, got {req.radius}")
    if not req.model.is_file():
        raise CertifyError(f"{req.model}: no such file; pass a .safetensors (lsa_models.save) "
                           f"or .onnx model")


def decision_message(cert: Certificate, bound: BoundReport) -> str:
    where = f"{cert.norm}-norm, N={cert.seq_len}" + (
        f", radius {cert.radius:g}" if cert.radius is not None else "")
    if cert.upper is not None and cert.passed:
        return f"certified Lipschitz bound {cert.upper:.6g} <= {cert.threshold:g} ({where})"
    if cert.upper is not None:
        return (f"certified Lipschitz bound {cert.upper:.6g} exceeds the threshold "
                f"{cert.threshold:g} ({where})")
    if bound.verdict == "not_lipschitz":
        return f"not Lipschitz ({where}): {bound.reason or 'no finite constant exists'}"
    return f"no certified bound ({where}): {bound.reason or 'not certified'}"


def certify_local(req: Request, key_path: Path | None, progress: StageProgress
                  ) -> tuple[Certificate, BoundReport]:
    """The server's Lipschitz certificate (service.certificates.service: the same body and pass
    rule), of a bound computed here, signed with the local key."""


    progress.stage(LOCAL_STEPS[0])
    set_threads()  # imports torch: seconds, so inside the first stage
    try:
        bound = compute_report(req.model, req.norm, req.seq_len, req.radius)
    except (ValueError, TypeError, OSError) as exc:
        raise CertifyError(str(exc)) from None
    progress.stage(LOCAL_STEPS[1])
    path = key_path if key_path is not None else default_key_path()
    try:
        key = load_or_create_signing_key(path)
    except (SigningKeyError, OSError) as exc:
        raise CertifyError(f"signing key: {exc}; pass --key FILE (an Ed25519 PEM private "
                           f"key, created if missing)") from None
    body = lipschitz_body(bound, req.threshold, lsa_version=bound.lsa_version)
    return sign(body, key), bound


def default_key_path() -> Path:
    """The service settings' signing key (LSA_SIGNING_KEY_PATH), so a local certificate is
    signed with the same key a server on this machine uses."""
    try:
        return local_key_path()
    except ValueError as exc:
        raise CertifyError(str(exc)) from None


def certify_server(req: Request, server: str, api_key: str | None, timeout_s: float,
                   retries: int, progress: StageProgress) -> tuple[Certificate, BoundReport]:
    try:
        config = ClientConfig(base_url=server, api_key=api_key, timeout_s=timeout_s,
                              retries=retries)
    except ValueError as exc:
        raise CertifyError(str(exc)) from None
    try:
        with LSAClient(config) as client:
            progress.stage(SERVER_STEPS[0])
            model = client.upload_model(req.model)
            progress.stage(SERVER_STEPS[1])
            bound = client.bound(model["id"], req.norm, req.seq_len, req.radius,
                                 progress=progress.job)
            progress.stage(SERVER_STEPS[2])
            cert = client.certify(model["id"], req.norm, req.threshold, req.seq_len,
                                  req.radius, progress=progress.job)
    except (ClientError, KeyError, ValueError) as exc:
        # pydantic's ValidationError is a ValueError: the server's answer did not match the
        # API schema, which is as unusable as no answer.
        raise CertifyError(f"server {server}: {exc}") from None
    except OSError as exc:
        raise CertifyError(str(exc)) from None
    # The gate is about this exact file: the server's answers must name its hash.
    digest = hashlib.sha256(req.model.read_bytes()).hexdigest()
    for what, sha in (("certificate", cert.model_sha256), ("bound report", bound.model_sha256)):
        if sha != digest:
            raise CertifyError(f"server {server}: the {what} is for sha256 {sha}, but "
                               f"{req.model} has sha256 {digest}")
    return cert, bound


# --- reports -------------------------------------------------------------------------------


def junit_xml(req: Request, outcome: str, message: str, elapsed_s: float,
              cert: Certificate | None = None) -> bytes:
    """One test suite with one test case; `failure` for exit 1, `error` for exit 2."""
    fields: dict[str, Any] = {"model": str(req.model), "threshold": req.threshold,
                              "norm": req.norm, "seq_len": req.seq_len, "radius": req.radius}
    if cert is not None:
        fields.update(seq_len=cert.seq_len, upper=cert.upper, model_sha256=cert.model_sha256,
                      certificate_id=cert.id, lsa_version=cert.lsa_version)
    root, suite = junit_suite("lsa certify", elapsed_s, tests=1,
                              failures=int(outcome == "failed"),
                              errors=int(outcome == "error"), skipped=0, properties=fields)
    case = ET.SubElement(suite, "testcase", {
        "classname": "lsa.certify",
        "name": f"{req.model}: Lipschitz bound <= {req.threshold:g} ({req.norm}-norm)",
        "time": f"{elapsed_s:.3f}"})
    if outcome == "failed":
        kind = "LipschitzBoundExceeded" if cert is not None and cert.upper is not None \
            else "NotCertified"
        ET.SubElement(case, "failure", {"message": message, "type": kind}).text = message
    elif outcome == "error":
        ET.SubElement(case, "error", {"message": message, "type": "CertifyError"}).text = message
    ET.SubElement(case, "system-out").text = message
    return junit_bytes(root)


def summary_markdown(req: Request, outcome: str, message: str, cert: Certificate | None,
                     bound: BoundReport | None) -> str:
    icon = {"passed": "✅", "failed": "❌", "error": "⚠️"}[outcome]
    title = {"passed": "passed", "failed": "failed", "error": "error"}[outcome]
    lines = [f"### {icon} lsa certify {title}: `{req.model}`", "", md_cell(message), "",
             "| | |", "|---|---|", f"| threshold | {req.threshold:g} |",
             f"| norm | {req.norm} |"]
    if cert is not None:
        upper = "none" if cert.upper is None else f"{cert.upper:.6g}"
        lines += [f"| sequence length | {cert.seq_len} |",
                  f"| radius | {'unbounded' if cert.radius is None else f'{cert.radius:g}'} |",
                  f"| certified upper bound | {upper} |",
                  f"| model sha256 | `{cert.model_sha256}` |",
                  f"| certificate | `{cert.id}` |",
                  f"| lsa version | {cert.lsa_version} |"]
    if bound is not None and bound.layers:
        lines += ["", "<details><summary>Per-layer bounds</summary>", "",
                  "| layer | kind | upper | status |", "|---|---|---:|---|"]
        for lb in bound.layers:
            upper = "-" if lb.upper is None else f"{lb.upper:.6g}"
            lines.append(f"| {md_cell(lb.name)} | {md_cell(lb.kind)} | {upper} | {lb.status} |")
        lines += ["", "</details>"]
    return "\n".join(lines) + "\n\n"


def write_reports(req: Request, outcome: str, message: str, elapsed_s: float,
                  report: CertifyReport | None, json_path: Path | None,
                  junit_path: Path | None, summary_path: Path | None) -> None:
    cert = report.certificate if report is not None else None
    bound = report.bound if report is not None else None
    if json_path is not None and report is not None:
        write_file(json_path, report.model_dump_json(indent=2).encode() + b"\n")
    if junit_path is not None:
        write_file(junit_path, junit_xml(req, outcome, message, elapsed_s, cert))
    if summary_path is not None:
        append_summary(summary_path, summary_markdown(req, outcome, message, cert, bound))


# --- the command ---------------------------------------------------------------------------


def run_certify(req: Request, *, server: str | None, api_key: str | None, key_path: Path | None,
                timeout_s: float, retries: int, json_path: Path | None,
                junit_path: Path | None, summary_path: Path | None,
                echo: Callable[[str], None]) -> int:
    """Everything `lsa certify` does; returns the exit code."""
    start = time.monotonic()
    progress = StageProgress(len(SERVER_STEPS) if server else len(LOCAL_STEPS))
    report: CertifyReport | None = None
    outcome: str  # passed | failed | error
    try:
        check_request(req)
        if server and key_path is not None:
            raise CertifyError("--key signs local certificates; with --server the server "
                               "signs with its own key: drop one of them")
        if server:
            cert, bound = certify_server(req, server, api_key, timeout_s, retries, progress)
        else:
            cert, bound = certify_local(req, key_path, progress)
        decided: Outcome = "passed" if cert.passed else "failed"
        outcome, message = decided, decision_message(cert, bound)
        report = CertifyReport(model_file=str(req.model), threshold=req.threshold,
                               outcome=decided, message=message,
                               source="server" if server else "local", server=server,
                               certificate=cert, bound=bound)
        code = EXIT_OK if cert.passed else EXIT_FAILED
    except CertifyError as exc:
        outcome, message, code = "error", str(exc), EXIT_ERROR
    except Exception as exc:  # noqa: BLE001
        # A traceback exits 1, which a pipeline would read as "bound too high": say error.
        outcome, message = "error", f"internal error: {type(exc).__name__}: {exc}"
        code = EXIT_ERROR
    finally:
        progress.close()
    try:
        write_reports(req, outcome, message, time.monotonic() - start, report, json_path,
                      junit_path, summary_path)
    except OSError as exc:
        print(f"lsa: error: cannot write a report: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if code == EXIT_ERROR:
        print(f"lsa: error: {' '.join(message.split())}", file=sys.stderr)
    else:
        echo(f"{'PASSED' if code == EXIT_OK else 'FAILED'}: {req.model}: {message}")
        if report is not None:
            echo(f"certificate {report.certificate.id} (model sha256 "
                 f"{report.certificate.model_sha256})")
    return code


def certify(
    model: Annotated[Path, typer.Argument(help="Model file: .safetensors (lsa_models.save), "
                                          ".onnx, or a .zip of an .onnx with external data")],
    max_lipschitz: Annotated[float, typer.Option(
        "--max-lipschitz", help="Fail (exit 1) when the certified bound is above this")],
    norm: Annotated[str, typer.Option("--norm", help="2 (Frobenius) or inf")] = "2",
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="Sequence length N")] = None,
    radius: Annotated[float | None, typer.Option(
        "--radius", help="Bound every input token's 2-norm by R (bounded domain)")] = None,
    server: Annotated[str | None, typer.Option(
        "--server", envvar="LSA_SERVER", help="lsa server URL; unset: compute locally")] = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="LSA_API_KEY", help="API key for --server")] = None,
    key: Annotated[Path | None, typer.Option(
        "--key", help="Local signing key (Ed25519 PEM, created if missing); default: "
        "LSA_SIGNING_KEY_PATH or ./var/signing_key.pem")] = None,
    json_out: Annotated[Path | None, typer.Option(
        "--json", help="Write the report (certificate + bound) as JSON")] = None,
    junit: Annotated[Path | None, typer.Option("--junit", help="Write JUnit XML")] = None,
    summary: Annotated[Path | None, typer.Option(
        "--summary", help="Append a Markdown summary (e.g. $GITHUB_STEP_SUMMARY)")] = None,
    timeout: Annotated[float, typer.Option(
        "--timeout", help="Seconds per HTTP request to --server")] = 120.0,
    retries: Annotated[int, typer.Option(
        "--retries", help="Retries on 5xx and connection errors")] = 4,
) -> None:
    """Gate a model on its certified Lipschitz bound: exit 0 passed, 1 failed, 2 error."""
    req = Request(model=model, threshold=max_lipschitz, norm=norm, seq_len=seq_len,
                  radius=radius)
    code = run_certify(req, server=server, api_key=api_key, key_path=key, timeout_s=timeout,
                       retries=retries, json_path=json_out, junit_path=junit,
                       summary_path=summary, echo=typer.echo)
    raise typer.Exit(code)
