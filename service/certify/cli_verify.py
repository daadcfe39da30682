"""`lsa verify CERT.json [MODEL]`: check a certificate offline.

Three checks, each can only fail closed: the Ed25519 signature over every field and the
verdict under the kind's pass rule (service.certificates.service.verify_certificate, as POST
/certificates/verify), the model
file's sha256 against the certificate's, and (`--recompute`) the analytic bound recomputed
here and compared with the certified one; for a robustness certificate, the radii recomputed
around `--at X0.npy` (whose sha256 must be the certificate's centre; the computation is
deterministic) and the certified radius compared. Exit 0 valid, 1 invalid, 2 error.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from api_schemas.certificates import Certificate
from service.bounds.local import model_input
from service.certificates.service import (
    certified_accuracy,
    lipschitz,
    load_public_key,
    robustness,
    verify_certificate,
)
from service.client import ClientConfig, ClientError, LSAClient
from service.robustness.verdicts import robustness_of
from service.signing_key import SigningKeyError

from ..bounds.files import compute_report
from ..kit.console import EXIT_FAILED, EXIT_OK, fail, local_key_path, set_threads

REL_TOL = 1e-9


def read_certificate(path: Path) -> dict[str, Any]:
    """The certificate object from a certificate file or an `lsa certify --json` report."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object (a certificate or an lsa certify "
                         f"--json report)")
    if "signature" not in data and isinstance(data.get("certificate"), dict):
        return dict(data["certificate"])
    return data


def read_public_key_file(path: Path) -> Any:
    """An Ed25519 public key PEM, or a private key PEM (its public half is used: handy for
    certificates signed locally with `lsa certify --key`)."""


    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the key ({exc.strerror or exc})") from None
    if b"PRIVATE KEY" in data:
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}: not a PEM key ({exc})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path}: not an Ed25519 key")
        return key.public_key()
    try:
        return load_public_key(data)
    except SigningKeyError as exc:
        raise ValueError(f"{path}: {exc}") from None


def server_public_key(server: str, api_key: str | None) -> Any:
    with LSAClient(ClientConfig(base_url=server, api_key=api_key)) as client:
        try:
            pem = client.public_key()
        except ClientError as exc:
            raise ValueError(f"server {server}: {exc}") from None
    try:
        return load_public_key(pem)
    except SigningKeyError as exc:
        raise ValueError(f"server {server}: public key: {exc}") from None


def local_public_key() -> Any:
    path = local_key_path()
    if not path.is_file():
        raise ValueError(f"no key given and no local signing key at {path}: pass "
                         f"--public-key FILE or --server URL")
    return read_public_key_file(path)


def same_bound(certified: float | None, recomputed: float | None) -> bool:
    if certified is None or recomputed is None:
        return certified is None and recomputed is None
    if not (math.isfinite(certified) and math.isfinite(recomputed)):
        return certified == recomputed
    return abs(certified - recomputed) <= REL_TOL * max(abs(certified), abs(recomputed))


def verify(
    certificate: Annotated[Path, typer.Argument(
        help="Certificate JSON (from the server, or an `lsa certify --json` report)")],
    model: Annotated[Path | None, typer.Argument(
        help="The model file; its sha256 must match the certificate's")] = None,
    public_key: Annotated[Path | None, typer.Option(
        "--public-key", help="Ed25519 public key PEM (a private key PEM works too)")] = None,
    server: Annotated[str | None, typer.Option(
        "--server", help="Fetch the public key from this lsa server")] = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="LSA_API_KEY", help="API key for --server")] = None,
    recompute: Annotated[bool, typer.Option(
        "--recompute", help="Recompute the analytic bound (a robustness certificate: the "
        "certified radius around --at; a certified-accuracy one: the verdicts of --inputs "
        f"--labels) from MODEL and compare (relative {REL_TOL:g})")
    ] = False,
    at: Annotated[Path | None, typer.Option(
        "--at", help="With --recompute of a robustness certificate: the input X0 (.npy) it "
        "was issued for (its sha256 must be the certificate's center_sha256)")] = None,
    inputs: Annotated[Path | None, typer.Option(
        "--inputs", help="With --recompute of a certified-accuracy certificate: the inputs "
        "(.npy, stacked as sent) it was issued for")] = None,
    labels: Annotated[Path | None, typer.Option(
        "--labels", help="With --inputs: their labels (.npy); with the inputs they must "
        "hash to the certificate's inputs_sha256")] = None,
) -> None:
    """Check a certificate's signature, model hash and (--recompute) bound offline."""
    _check_options(public_key, server, recompute, model, at, inputs, labels)
    try:
        cert_data = read_certificate(certificate)
        pub = choose_public_key(public_key, server, api_key)
    except ValueError as exc:
        fail(str(exc))
    if model is not None and not model.is_file():
        fail(f"{model}: no such file")

    result = verify_certificate(cert_data, pub)
    if not result.valid:
        typer.echo(f"INVALID: {certificate}: {result.reason}")
        raise typer.Exit(EXIT_FAILED)
    typer.echo("signature: valid")


    cert = Certificate.model_validate(cert_data)
    if model is not None:
        check_model_hash(cert, model)
    if recompute:
        assert model is not None
        _recompute(cert, model, at, inputs, labels)
    verdict = "passed" if cert.passed else "failed"
    if cert.robustness_set is not None:
        rs = cert.robustness_set
        typer.echo(f"VALID: certified-accuracy certificate {cert.id} ({verdict}: certified "
                   f"accuracy {rs.get('certified_accuracy')} vs {cert.threshold:g} on "
                   f"{rs.get('n')} inputs at radius {rs.get('radius')}, {cert.norm}-norm)")
        raise typer.Exit(EXIT_OK)
    if cert.training is not None:
        typer.echo(f"VALID: training certificate {cert.id} ({verdict}: largest branch bound "
                   f"{cert.upper} vs c {cert.threshold:g}, invertible "
                   f"{cert.training.get('invertible')}, {cert.norm}-norm, N={cert.seq_len})")
        raise typer.Exit(EXIT_OK)
    if cert.robustness is not None:
        typer.echo(f"VALID: robustness certificate {cert.id} ({verdict}: certified radius "
                   f"{cert.robustness.get('certified_radius')} vs min_radius "
                   f"{cert.threshold:g}, label {cert.robustness.get('label')}, "
                   f"{cert.norm}-norm)")
        raise typer.Exit(EXIT_OK)
    typer.echo(f"VALID: certificate {cert.id} ({verdict}: upper {cert.upper} vs threshold "
               f"{cert.threshold:g}, {cert.norm}-norm, N={cert.seq_len})")
    raise typer.Exit(EXIT_OK)


def _check_options(public_key: Path | None, server: str | None, recompute: bool,
                   model: Path | None, at: Path | None, inputs: Path | None,
                   labels: Path | None) -> None:
    """Exit 2 naming the options that do not go together."""
    if public_key is not None and server is not None:
        fail("give --public-key or --server, not both")
    if recompute and model is None:
        fail("--recompute needs the MODEL file: lsa verify CERT.json MODEL --recompute")
    if at is not None and not recompute:
        fail("--at is the input of a robustness certificate's --recompute: add --recompute "
             "or drop --at")
    if (inputs is not None or labels is not None) and not recompute:
        fail("--inputs and --labels are a certified-accuracy certificate's set for "
             "--recompute: add --recompute or drop them")


def _recompute(cert: Certificate, model: Path, at: Path | None, inputs: Path | None,
               labels: Path | None) -> None:
    """The check of --recompute for the certificate's kind (exit 2 for another kind's
    options)."""
    if cert.robustness_set is not None:
        if at is not None:
            fail("--at is for robustness certificates; this one certifies an accuracy: give "
                 "--inputs and --labels")
        check_recomputed_set(cert, model, inputs, labels)
        return
    if inputs is not None or labels is not None:
        fail("--inputs and --labels are for certified-accuracy certificates; this one is "
             "not: drop them")
    if cert.robustness is not None:
        check_recomputed_radius(cert, model, at)
    elif at is not None:
        fail("--at is for robustness certificates; this one certifies a Lipschitz bound: "
             "drop --at")
    else:
        check_recomputed(cert, model)


def choose_public_key(public_key: Path | None, server: str | None, api_key: str | None) -> Any:
    if public_key is not None:
        return read_public_key_file(public_key)
    if server is not None:
        return server_public_key(server, api_key)
    return local_public_key()


def check_model_hash(cert: Certificate, model: Path) -> None:
    """Exit 1 unless `model`'s bytes are the ones the certificate is for."""
    from lsa_models.analysis import sha256_hex  # deferred: lsa_models imports torch

    try:
        digest = sha256_hex(model.read_bytes())
    except OSError as exc:
        fail(f"{model}: cannot read ({exc.strerror or exc})")
    if digest != cert.model_sha256:
        typer.echo(f"INVALID: {model} has sha256 {digest}, the certificate is for "
                   f"{cert.model_sha256}")
        raise typer.Exit(EXIT_FAILED)
    typer.echo(f"model sha256: matches ({digest})")


def check_recomputed(cert: Certificate, model: Path) -> None:
    """Exit 1 unless the bound recomputed here matches the certified one and gives the same
    verdict under the Lipschitz pass rule (service.certificates.service.lipschitz)."""


    set_threads()
    try:
        report = compute_report(model, cert.norm, cert.seq_len, cert.radius)
    except (ValueError, TypeError, OSError) as exc:
        fail(f"recomputing the bound: {exc}")
    except Exception as exc:  # a traceback would exit 1, which reads as "invalid"
        fail(f"recomputing the bound: internal error: {type(exc).__name__}: {exc}")
    if not same_bound(cert.upper, report.upper):
        typer.echo(f"INVALID: recomputed bound {report.upper} differs from the certified "
                   f"{cert.upper} (lsa {report.lsa_version} here, {cert.lsa_version} in "
                   f"the certificate)")
        raise typer.Exit(EXIT_FAILED)
    upper = report.upper
    recomputed = lipschitz(upper if report.verdict == "certified" else None, cert.threshold)
    if recomputed != cert.passed:
        typer.echo(f"INVALID: the certificate says passed={cert.passed}, but the bound "
                   f"{upper} against the threshold {cert.threshold:g} gives {recomputed}")
        raise typer.Exit(EXIT_FAILED)
    typer.echo(f"bound: recomputed {upper} matches the certified {cert.upper}")


def check_recomputed_radius(cert: Certificate, model: Path, at: Path | None) -> None:
    """Exit 1 unless the radii recomputed here around `at` give the certified radius and the
    same verdict under the robustness pass rule (service.certificates.service.robustness);
    exit 2 without `at`."""
    from lsa_models import __version__  # deferred: torch
    from lsa_models.engine.drivers.centre import center_sha256, check_center
    from lsa_models.engine.routes.certify import as_onnx

    from ..kit.inputs import load_center, load_model

    assert cert.robustness is not None
    if at is None:
        fail("--recompute of a robustness certificate needs the input it was issued for: "
             "lsa verify CERT.json MODEL --recompute --at X0.npy")
    rob = cert.robustness
    set_threads()
    try:
        loaded = load_model(model)
        x0 = model_input(loaded, load_center(at), field="--at")
        # the engine's own shape check, so a wrong shape is an error, not another centre
        check_center(as_onnx(loaded, x0.shape[-2] if x0.ndim >= 2 else None), x0)
    except (ValueError, TypeError, OSError) as exc:
        text = str(exc)
        fail(text if text.startswith("--at") else f"--at: {text}")
    digest = center_sha256(x0)
    if digest != rob.get("center_sha256"):
        typer.echo(f"INVALID: {at} has sha256 {digest} (as float64), the certificate is for "
                   f"the input {rob.get('center_sha256')}")
        raise typer.Exit(EXIT_FAILED)
    try:
        # without a time budget: a search its budget did not stop is the unbudgeted one
        radii = robustness_of(loaded, loaded.sha256, x0, int(rob["label"]), cert.norm)
    except (ValueError, TypeError, KeyError) as exc:
        fail(f"recomputing the radii: {exc}")
    except Exception as exc:  # a traceback would exit 1, which reads as "invalid"
        fail(f"recomputing the radii: internal error: {type(exc).__name__}: {exc}")
    certified, recomputed = rob.get("certified_radius"), radii["certified_radius"]
    if rob.get("stopped_by_budget") is True and isinstance(certified, int | float) \
            and float(certified) <= recomputed * (1 + REL_TOL):
        # its budget stopped the search: a prefix of the unbudgeted one, its radius at most
        # the recomputed one (sound, not the tightest); passed implies the recomputed passes
        typer.echo(f"certified radius: {certified}, stopped by its time budget, is at most "
                   f"the recomputed {recomputed} (searched without a budget)")
        return
    if not isinstance(certified, int | float) or not same_bound(float(certified), recomputed):
        typer.echo(f"INVALID: recomputed certified radius {recomputed} differs from the "
                   f"certified {certified} (lsa {__version__} here, {cert.lsa_version} in "
                   "the certificate)")
        raise typer.Exit(EXIT_FAILED)
    verdict = robustness(recomputed, cert.threshold)
    if verdict != cert.passed:
        typer.echo(f"INVALID: the certificate says passed={cert.passed}, but the certified "
                   f"radius {recomputed} against min_radius {cert.threshold:g} gives {verdict}")
        raise typer.Exit(EXIT_FAILED)
    typer.echo(f"certified radius: recomputed {recomputed} matches the certified {certified}")


def check_recomputed_set(cert: Certificate, model: Path, inputs: Path | None,
                         labels: Path | None) -> None:
    """Exit 1 unless the inputs and labels hash to the certificate's inputs_sha256 and,
    decided again here at its radius, give its statuses, certified accuracy and verdict
    (certified_accuracy >= threshold); exit 2 without them."""
    from lsa_models import __version__  # deferred: torch

    from ..kit.inputs import load_model
    from ..robustness.cli_set import load_set
    from ..robustness.verdicts import decide_set, inputs_sha256, set_json
    from ..settings import default_set_workers

    rs = cert.robustness_set
    assert rs is not None
    if inputs is None or labels is None:
        fail("--recompute of a certified-accuracy certificate needs the set it was issued "
             "for: lsa verify CERT.json MODEL --recompute --inputs X.npy --labels Y.npy")
    set_threads()
    try:
        loaded = load_model(model)
        xs, ys, _ = load_set(loaded, inputs, labels)  # as the server took them
    except (ValueError, TypeError, OSError) as exc:
        fail(str(exc))
    digest = inputs_sha256(xs, ys.tolist())
    if digest != rs.get("inputs_sha256"):
        typer.echo(f"INVALID: {inputs} and {labels} hash to {digest}, the certificate is for "
                   f"the set {rs.get('inputs_sha256')} (give the inputs stacked as they were "
                   "sent, and their labels)")
        raise typer.Exit(EXIT_FAILED)
    typer.echo(f"inputs sha256: matches ({digest})")
    try:
        out = set_json(loaded.sha256, decide_set(loaded, xs, ys, cert.norm,
                                                 float(rs["radius"]),
                                                 sweep=rs.get("sweep") is not False,
                                                 workers=default_set_workers()))
    except (ValueError, TypeError, KeyError) as exc:
        fail(f"deciding the inputs: {exc}")
    except Exception as exc:  # a traceback would exit 1, which reads as "invalid"
        fail(f"deciding the inputs: internal error: {type(exc).__name__}: {exc}")
    statuses = [s["status"] for s in out["samples"]]
    stopped = set(rs.get("stopped_by_budget") or [])
    if stopped:
        # decided without the budget (every verdict it did not stop is the same): an input
        # it stopped reads unknown in the certificate, whatever it is decided now
        certified_now = out["certified_accuracy"]
        statuses = ["unknown" if i in stopped else s for i, s in enumerate(statuses)]
        out["certified_accuracy"] = statuses.count("certified") / max(1, len(statuses))
        typer.echo(f"time budget: {len(stopped)} inputs stopped by it (unknown); decided "
                   f"without it, the certified accuracy is {certified_now}")
    if statuses != rs.get("statuses"):
        diff = [i for i, (a, b) in enumerate(zip(statuses, rs.get("statuses") or [],
                                                 strict=False)) if a != b]
        typer.echo(f"INVALID: decided again, the inputs {diff[:10]} get {statuses} where the "
                   f"certificate says {rs.get('statuses')} (lsa {__version__} here, "
                   f"{cert.lsa_version} in the certificate)")
        raise typer.Exit(EXIT_FAILED)
    ok = certified_accuracy(out["certified_accuracy"], cert.threshold)
    if out["certified_accuracy"] != rs.get("certified_accuracy") or ok != cert.passed:
        typer.echo(f"INVALID: the certificate says certified accuracy "
                   f"{rs.get('certified_accuracy')}, passed={cert.passed}; decided again: "
                   f"{out['certified_accuracy']}, passed={ok}")
        raise typer.Exit(EXIT_FAILED)
    typer.echo(f"verdicts: decided again, the {len(statuses)} statuses and the certified "
               f"accuracy {out['certified_accuracy']} match")
