"""Certificates: the one module that states, signs, stores and judges them.

Four kinds, told apart by the section a certificate carries (`kind_of`):

- `lipschitz`: no section; the certified Lipschitz upper bound against `max_lipschitz`;
- `robustness`: `robustness`; the certified radius around one input against `min_radius`;
- `certified_accuracy`: `robustness_set`; the fraction of a set certified robust at a radius
  against `min_certified_accuracy`;
- `training`: `training`; a trained model's residual branches against their cap `c < 1`.

Each kind has one pass rule, a function named after it below. `passed` is never set by a
caller: the body builders (`lipschitz_body`, `robustness_body`, `certified_accuracy_body`,
`training_body`) leave it to `verdict`, which applies the kind's rule to the body's own
figures, and `sign` applies it again. `issue` signs with the server's key and stores: the one
insert of a certificate. `verify_certificate` checks the Ed25519 signature and that `passed`
is what the kind's rule gives on the signed figures, so the server (POST
/certificates/verify) and `lsa verify` judge every kind alike, and a certificate signed
locally (`lsa certify`, `lsa robustness --certificate`) is built by the same functions.

The private key is a PEM file created (mode 0600) on first use if none exists
(service.signing_key). Verification needs only the public key, so anyone can re-check a
certificate without the server.
"""

from __future__ import annotations

import base64
import binascii
import math
import uuid
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api_schemas.bounds import BoundReport
from api_schemas.certificates import (
    Certificate,
    CertificateBody,
    CertificateKind,
    VerifyResult,
    canonical_bytes,
)

from ..db import after_commit, transaction
from ..errors import NotFound
from ..signing_key import SigningKeyError
from ..tables import CertificateRow

if TYPE_CHECKING:
    from ..runtime import Runtime


# ---- the pass rules, one per kind -----------------------------------------------------------


def lipschitz(upper: float | None, threshold: float) -> bool:
    """A Lipschitz certificate passes iff a certified upper bound exists, is finite and is
    <= the threshold (`upper` is None when the bound is not certified)."""
    return upper is not None and math.isfinite(upper) and upper <= threshold


def robustness(certified_radius: float, min_radius: float) -> bool:
    """A robustness certificate passes iff the certified radius is finite, positive (0 means
    nothing was certified, e.g. the label is not the prediction) and at least min_radius."""
    return (math.isfinite(certified_radius) and certified_radius > 0
            and certified_radius >= min_radius)


def certified_accuracy(accuracy: float, min_accuracy: float) -> bool:
    """A certified-accuracy certificate passes iff the fraction of the inputs certified
    robust at the radius is at least min_certified_accuracy."""
    return math.isfinite(accuracy) and accuracy >= min_accuracy


def training(invertible: bool, c: float, max_branch: float | None) -> bool:
    """A training certificate passes iff every residual branch is certified contractive
    (`invertible`), the cap c is < 1 and the largest branch bound is a Lipschitz pass
    against c: only then is the trained trunk certified invertible."""
    return bool(invertible) and c < 1.0 and lipschitz(max_branch, c)


def kind_of(body: CertificateBody) -> CertificateKind:
    """The certificate's kind, from the section it carries."""
    if body.training is not None:
        return "training"
    if body.robustness_set is not None:
        return "certified_accuracy"
    if body.robustness is not None:
        return "robustness"
    return "lipschitz"


def _number(section: dict[str, Any], name: str) -> float:
    value = section.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}: {value!r} is not a number")
    return float(value)


def verdict(body: CertificateBody) -> bool:
    """What the kind's pass rule gives on the body's own signed figures; ValueError when a
    figure the rule needs is missing or not a number."""
    kind = kind_of(body)
    if kind == "training":
        t = body.training or {}
        return training(t.get("invertible") is True, body.threshold, body.upper)
    if kind == "certified_accuracy":
        return certified_accuracy(_number(body.robustness_set or {}, "certified_accuracy"),
                                  body.threshold)
    if kind == "robustness":
        return robustness(_number(body.robustness or {}, "certified_radius"), body.threshold)
    return lipschitz(body.upper, body.threshold)


RULE_TEXT: dict[str, str] = {
    "lipschitz": "upper is finite and <= threshold",
    "robustness": "certified_radius is finite, > 0 and >= threshold (min_radius)",
    "certified_accuracy": "certified_accuracy >= threshold (min_certified_accuracy)",
    "training": "invertible, threshold c < 1 and upper (the largest branch bound) <= c",
}


# ---- the bodies: every signed field of each kind; `passed` is the kind's rule's -------------


def new_certificate_body(**fields: Any) -> CertificateBody:
    """A body with these exact fields (a fresh id and time unless given). Low level: it signs
    whatever `passed` it is given; certificates are built by the kinds' builders below."""
    fields.setdefault("id", str(uuid.uuid4()))
    fields.setdefault("issued_at", datetime.now(UTC).replace(microsecond=0))
    return CertificateBody(**fields)


def _ruled(**fields: Any) -> CertificateBody:
    """A new body whose `passed` is its kind's rule on its figures."""
    body = new_certificate_body(passed=False, **fields)
    return body.model_copy(update={"passed": verdict(body)})


def _version(given: str | None) -> str:
    if given is not None:
        return given
    from lsa_models import __version__  # deferred: imports torch

    return __version__


def lipschitz_body(report: BoundReport, threshold: float, *, lower: float | None = None,
                   lsa_version: str | None = None) -> CertificateBody:
    """The Lipschitz certificate of a bound report against `threshold` (max_lipschitz): an
    upper bound is stated only when it is certified; `lower`: the best empirical lower bound
    known for the domain (the report's own by default)."""
    upper = report.upper if report.verdict == "certified" else None
    return _ruled(model_sha256=report.model_sha256, norm=report.norm, seq_len=report.seq_len,
                  radius=report.radius, threshold=threshold, upper=upper,
                  lower=report.lower if lower is None else lower, method=report.method,
                  lsa_version=_version(lsa_version))


# The radii's fields a robustness certificate signs (robustness_of's object less timings).
ROBUSTNESS_FIELDS = ("label", "predicted", "certified_radius", "attack_radius", "margins",
                     "pair_constants", "center_sha256", "sweep_runs")


def robustness_body(radii: dict[str, Any], seq_len: int, min_radius: float, *,
                    cert_id: str | None = None) -> CertificateBody:
    """The robustness certificate of `radii` (service.robustness.verdicts.robustness_of's
    object) against `min_radius`."""
    from lsa_models.engine.routes.constant import METHOD  # deferred: torch

    # radii stored before the sweep's runs were named so call them bisection_steps
    section = {k: radii[k] if k in radii or k != "sweep_runs" else radii["bisection_steps"]
               for k in ROBUSTNESS_FIELDS}
    if radii.get("time_budget_s") is not None:
        # searched within a time budget: whether it stopped the search (the radius is then
        # the largest certified in time; a recomputation without it may find a larger one)
        section["time_budget_s"] = radii["time_budget_s"]
        section["stopped_by_budget"] = bool(radii.get("stopped_by_budget"))
    section["min_radius"] = min_radius
    fields: dict[str, Any] = {} if cert_id is None else {"id": cert_id}
    return _ruled(
        model_sha256=radii["model_sha256"], norm=radii["norm"], seq_len=seq_len, radius=None,
        threshold=min_radius, upper=None, lower=None,
        method="robustness: every margin f_label - f_j stays positive on the ball of the "
        "certified radius (bisection on r; " + METHOD + ")", lsa_version=_version(None),
        robustness=section, **fields)


def certified_accuracy_body(out: dict[str, Any], seq_len: int, min_radius: float,
                            min_accuracy: float, inputs_sha256: str, *,
                            cert_id: str | None = None) -> CertificateBody:
    """The certified-accuracy certificate of a set's verdicts
    (service.robustness.verdicts.set_json's object) at `min_radius` against `min_accuracy`."""
    from lsa_models.engine.routes.constant import METHOD  # deferred: torch

    section = {"radius": min_radius, "n": out["n"], "counts": out["counts"],
               "certified_accuracy": out["certified_accuracy"],
               "attack_accuracy": out["attack_accuracy"],
               "min_certified_accuracy": min_accuracy, "inputs_sha256": inputs_sha256,
               "labels": [s["label"] for s in out["samples"]],
               "statuses": [s["status"] for s in out["samples"]]}
    if out.get("sweep") is False:
        # decided without the radius sweep (lsa robustness --no-sweep): a recomputation
        # must skip it too
        section["sweep"] = False
    if out.get("time_budget_s") is not None:
        # each input decided within a time budget: the inputs it stopped (unknown; decided
        # again without it, they may be certified or attacked)
        section["time_budget_s"] = out["time_budget_s"]
        section["stopped_by_budget"] = [s["index"] for s in out["samples"]
                                        if s.get("stopped_by_budget")]
    fields: dict[str, Any] = {} if cert_id is None else {"id": cert_id}
    return _ruled(
        model_sha256=out["model_sha256"], norm=out["norm"], seq_len=seq_len, radius=None,
        threshold=min_accuracy, upper=None, lower=None,
        method="certified accuracy: the fraction of the inputs whose every margin f_label - "
        "f_j stays positive on the ball of the radius (affine forms or the radius sweep; "
        + METHOD + ")", lsa_version=_version(None), robustness_set=section, **fields)


def training_body(cert_id: str, model_sha256: str, seq_len: int, c: float,
                  max_branch: float | None, method: str,
                  section: dict[str, Any]) -> CertificateBody:
    """The training certificate of a trained model: threshold the cap c, upper the largest
    certified branch bound; `section` is the training record (its `invertible` says whether
    every branch was certified contractive)."""
    return _ruled(id=cert_id, model_sha256=model_sha256, norm="2", seq_len=seq_len,
                  radius=None, threshold=c, upper=max_branch, lower=None,
                  method=method[:2000], lsa_version=_version(None), training=section)


# ---- signing and storing --------------------------------------------------------------------


def sign_certificate(body: CertificateBody, key: Ed25519PrivateKey) -> Certificate:
    """The Ed25519 signature over `body` as it is (low level: `sign` applies the rule)."""
    signature = base64.b64encode(key.sign(canonical_bytes(body))).decode()
    return Certificate(**body.model_dump(), signature=signature)


def sign(body: CertificateBody, key: Ed25519PrivateKey) -> Certificate:
    """`body` signed with `key`, its `passed` set by its kind's rule (the server's `issue`
    and the CLI's local certificates)."""
    return sign_certificate(body.model_copy(update={"passed": verdict(body)}), key)


def issue(session: Session, runtime: Runtime, model_id: str,
          body: CertificateBody) -> Certificate:
    """Sign `body` with the server's key under its kind's rule and store it, in the caller's
    transaction: the one place a certificate is inserted. A certificate already stored under
    the same id (a job's: its id is derived from the job's, and an earlier attempt presumed
    dead may have finished) is returned instead; the metric counts issued ones on commit."""
    cert = sign(body, runtime.signing_key)
    try:
        with session.begin_nested():
            session.add(CertificateRow(id=cert.id, model_id=model_id,
                                       model_sha256=cert.model_sha256,
                                       threshold=cert.threshold, upper=cert.upper,
                                       passed=cert.passed, body=cert.model_dump(mode="json"),
                                       issued_at=cert.issued_at))
    except IntegrityError:
        first = session.get(CertificateRow, cert.id)
        if first is None:
            raise
        return Certificate.model_validate(first.body)
    if runtime.metrics is not None:
        after_commit(session, runtime.metrics.certificates.inc)
    return cert


def stored(session: Session, certificate_id: str) -> Certificate:
    """The certificate stored under `certificate_id`, as issued; NotFound when none is."""
    row = session.get(CertificateRow, certificate_id)
    if row is None:
        raise NotFound(f"no certificate with id {certificate_id}")
    return Certificate.model_validate(row.body)


def find_certificate(runtime: Runtime, certificate_id: str) -> Certificate:
    """`stored` in a read-only transaction (GET /certificates/{id})."""
    with transaction(runtime.read_sessions) as s:
        return stored(s, certificate_id)


# ---- verification -----------------------------------------------------------------------------


def verify_certificate(cert: Certificate | dict[str, Any],
                       public_key: Ed25519PublicKey | str | bytes) -> VerifyResult:
    """Check the signature over every field, then that `passed` is what the kind's rule gives
    on the signed figures (a certificate signed with the right key but a verdict its own
    numbers contradict is invalid). Never raises on bad input: says why instead."""
    try:
        pub = public_key if isinstance(public_key, Ed25519PublicKey) else load_public_key(
            public_key)
    except SigningKeyError as exc:
        return VerifyResult(valid=False, reason=str(exc))
    try:
        parsed = cert if isinstance(cert, Certificate) else Certificate.model_validate(cert)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "certificate"
        return VerifyResult(valid=False, reason=f"malformed certificate: {where}: {first['msg']}")
    kind = kind_of(parsed)
    try:
        sig = base64.b64decode(parsed.signature, validate=True)
    except (binascii.Error, ValueError):
        return VerifyResult(valid=False, kind=kind, reason="signature is not valid base64")
    try:
        pub.verify(sig, canonical_bytes(parsed))
    except InvalidSignature:
        return VerifyResult(valid=False, kind=kind, reason="signature does not match the "
                            "certificate's fields (altered certificate or wrong key)")
    try:
        expected = verdict(parsed)
    except ValueError as exc:
        return VerifyResult(valid=False, kind=kind, reason=f"malformed {kind} certificate: "
                            f"{exc}")
    if expected != parsed.passed:
        return VerifyResult(valid=False, kind=kind, reason=(
            f"the certificate says passed={parsed.passed}, but the {kind} rule ("
            f"{RULE_TEXT[kind]}) gives passed={expected} on its own signed figures"))
    return VerifyResult(valid=True, kind=kind, passed=parsed.passed,
                        reason=f"signature valid; passed={parsed.passed} follows from the "
                        f"{kind} rule ({RULE_TEXT[kind]})")


# ---- keys ---------------------------------------------------------------------------------


def public_key_pem(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return pub.public_bytes(serialization.Encoding.PEM,
                            serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def load_public_key(pem: str | bytes) -> Ed25519PublicKey:
    data = pem.encode() if isinstance(pem, str) else pem
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(f"not a PEM public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise SigningKeyError("not an Ed25519 public key")
    return key
