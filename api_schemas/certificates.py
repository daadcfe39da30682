"""Certificates: a signed statement that a model's certified bound is (not) below a threshold."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .bounds import Norm

# What a certificate states, told by the section it carries (none: lipschitz); each kind has
# one pass rule (service.certificates).
CertificateKind = Literal["lipschitz", "robustness", "certified_accuracy", "training"]

CERTIFICATE_EXAMPLE: dict[str, Any] = {
    "id": "c0ffee00-0000-4000-8000-000000000001",
    "model_sha256": "9f2c" + "0" * 60,
    "norm": "2",
    "seq_len": 128,
    "radius": None,
    "threshold": 1000.0,
    "upper": 412.7,
    "lower": None,
    "passed": True,
    "method": "analytic: Theorem 3.2 ...",
    "lsa_version": "0.1.0",
    "issued_at": "2026-12-02T12:00:00Z",
}


class CertificateBody(BaseModel):
    """Every signed field. The signature covers `canonical_bytes(body)`."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [CERTIFICATE_EXAMPLE]})

    id: str
    model_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    norm: Norm
    seq_len: int
    radius: float | None = None
    threshold: float
    upper: float | None = Field(description="Certified upper bound; null if none exists")
    lower: float | None = Field(default=None, description="Empirical lower bound, if measured")
    passed: bool = Field(description="The kind's pass rule on the signed figures: upper is "
                         "finite and <= threshold (lipschitz); certified_radius > 0 and >= "
                         "threshold (robustness); certified_accuracy >= threshold "
                         "(certified_accuracy); invertible, threshold c < 1 and upper <= c "
                         "(training)")
    method: str
    lsa_version: str
    issued_at: datetime
    training: dict[str, Any] | None = Field(
        # Omitted when empty: other certificates keep the shape and signed bytes they had.
        default=None, exclude_if=lambda v: v is None,
        description="Certificates of trained models (POST /certify with training): "
        "per-branch constants <= c < 1, the trunk's certified bound, the reconstruction "
        "error on held-out sequences, test bits per character, artifacts")
    robustness: dict[str, Any] | None = Field(
        # Omitted when empty, like training: Lipschitz certificates keep their signed bytes.
        default=None, exclude_if=lambda v: v is None,
        description="Robustness certificates (POST /certify with at, label, min_radius): "
        "label, predicted, certified_radius, attack_radius, min_radius, margins, "
        "pair_constants, center_sha256; threshold is min_radius, upper is null, and passed "
        "iff certified_radius >= min_radius > 0",
        examples=[{"label": 1, "predicted": 1, "min_radius": 0.01, "certified_radius": 0.034,
                   "attack_radius": 0.41, "center_sha256": "5e1a" + "0" * 60,
                   "margins": {"0": 1.2}, "pair_constants": {"0": 30.1}}])


    robustness_set: dict[str, Any] | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="Certified-accuracy certificates (POST /certify with inputs, labels, "
        "min_radius, min_certified_accuracy): radius, n, counts (certified, attacked, "
        "unknown, misclassified), certified_accuracy, attack_accuracy, inputs_sha256, "
        "labels, statuses; threshold is min_certified_accuracy, upper is null, and passed "
        "iff certified_accuracy >= min_certified_accuracy",
        examples=[{"radius": 0.01, "n": 2, "certified_accuracy": 0.5,
                   "attack_accuracy": 1.0, "min_certified_accuracy": 0.5,
                   "counts": {"certified": 1, "attacked": 0, "unknown": 1,
                              "misclassified": 0},
                   "inputs_sha256": "77ab" + "0" * 60, "labels": [1, 0],
                   "statuses": ["certified", "unknown"]}])


class Counterexample(BaseModel):
    """A label flip PGD found inside the ball of one input of a certified-accuracy set."""

    index: int = Field(ge=0, description="Which input of the set (its position)")
    label: int = Field(ge=0)
    flip_class: int = Field(ge=0, description="The class whose output exceeds the label's "
                            "at the point")
    distance: float = Field(ge=0, description="The point's distance from the input in the "
                            "norm (<= radius)")
    input: list[Any] = Field(description="The point, float64, in the input's layout: the "
                             "shape it was sent in, or on a pixel upload the image (1, C, H, "
                             "W)")


class Counterexamples(BaseModel):
    """The counterexamples behind a certified-accuracy certificate: one per `attacked`
    status (unsigned: each is checked by evaluating the model at it)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "certificate_id": "c0ffee00-0000-4000-8000-000000000001", "norm": "inf",
        "radius": 0.01, "counterexamples": [{"index": 1, "label": 0, "flip_class": 2,
                                             "distance": 0.0093, "input": [[0.1, -0.2]]}]}]})

    certificate_id: str
    norm: Norm
    radius: float
    counterexamples: list[Counterexample]


class Certificate(CertificateBody):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{**CERTIFICATE_EXAMPLE, "signature": "base64..."}]},
    )

    signature: str = Field(description="Ed25519 signature (base64) of the canonical body")


def canonical_bytes(body: CertificateBody | dict[str, Any]) -> bytes:
    """Deterministic bytes of the signed fields: compact JSON, sorted keys, UTC 'Z' times.

    Parsing through the model first means equal certificates serialise identically whatever
    form (dict, JSON text, model) they arrived in.
    """
    if isinstance(body, dict):
        fields = {k: v for k, v in body.items() if k != "signature"}
        body = CertificateBody.model_validate(fields)
    fields = body.model_dump(exclude={"signature"})
    data = CertificateBody.model_validate(fields).model_dump(mode="json")
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


class VerifyResult(BaseModel):
    valid: bool = Field(description="The signature matches every field and `passed` is what "
                        "the kind's pass rule gives on the signed figures")
    reason: str = Field(description="Why the certificate is (in)valid")
    kind: CertificateKind | None = Field(
        default=None, description="The certificate's kind (null when it could not be read)")
    passed: bool | None = Field(default=None, description="The certificate's verdict, when "
                                "it is valid")
