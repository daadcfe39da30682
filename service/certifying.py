"""The certifying service: what routes, jobs and the CLI do with models, bounds and
certificates. Routes parse, call one of these, and shape the response.

- `register_model`: store an upload once (parse outside any write transaction; onnxruntime
  agreement recorded so later loads skip it).
- `get_or_compute_report` / `report_json`: the stored report of a request, or compute and
  store it (in the server: on the compute pool, off the request threads).
- `issue_certificate` / `sign_report`: the signed verdict, with the one `passed` rule.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from api_schemas import BoundReport
from api_schemas.certificates import Certificate

from .artifacts import Staged, store_once
from .bounding import (
    ModelRef,
    analytic_report,
    best_lower,
    check_sync_size,
    find_result,
    request_key,
    store_result,
)
from .certificates import new_certificate_body, sign_certificate
from .compute import ComputeBusy
from .db import transaction
from .errors import InvalidModel, NotFound
from .model_cache import load_bytes
from .runtime import Runtime
from .tables import CertificateRow, UploadedModel, utcnow

log = logging.getLogger("lsa.service")


def passed(upper: float | None, threshold: float) -> bool:
    """The one pass rule of every certificate: a certified upper bound exists, is finite and
    is <= the threshold. `upper` is None when the bound is not certified."""
    return upper is not None and math.isfinite(upper) and upper <= threshold


def robust(certified_radius: float, min_radius: float) -> bool:
    """The one pass rule of robustness certificates: the certified radius is finite, positive
    (0 means nothing was certified, e.g. the label is not the prediction) and at least the
    requested one."""
    return (math.isfinite(certified_radius) and certified_radius > 0
            and certified_radius >= min_radius)


def find_model(runtime: Runtime, model_id: str) -> ModelRef:
    """The model `model_id` (404 when there is none), from memory when seen before."""
    cached = runtime.model_refs.get(model_id)
    if isinstance(cached, ModelRef):
        return cached
    with transaction(runtime.read_sessions) as s:
        row = s.get(UploadedModel, model_id)
        if row is None:
            raise NotFound(f"no model with id {model_id}; upload one with POST /models "
                           "(GET /models lists them)")
        ref = ModelRef.of(row)
    runtime.model_refs.put(model_id, ref)
    return ref


def stored_report_json(runtime: Runtime, key: str) -> bytes | None:
    """The stored report of request `key` as JSON bytes, or None (read-only transaction)."""
    cached = runtime.reports.get(key)
    if isinstance(cached, bytes):
        return cached
    with transaction(runtime.read_sessions) as s:
        row = find_result(s, key)
        report = None if row is None else dict(row.report)
    if report is None:
        return None
    return _remember(runtime, key, BoundReport.model_validate(report))


def _remember(runtime: Runtime, key: str, report: BoundReport) -> bytes:
    body = report.model_dump_json().encode()
    runtime.reports.put(key, body)
    return body


def compute_and_store(runtime: Runtime, model: ModelRef, norm: str, seq_len: int,
                      radius: float | None) -> BoundReport:
    """Compute the analytic report (no transaction open meanwhile), then store it in one
    short write transaction. An identical request that stored first wins."""
    key = request_key(model.sha256, norm, seq_len, radius, None)
    report = analytic_report(runtime, model, norm, seq_len, radius)
    with transaction(runtime.sessions) as s:
        row = store_result(s, model, key, report, None)
        stored = BoundReport.model_validate(row.report)
    if runtime.metrics is not None:
        runtime.metrics.bounds.inc()
    _remember(runtime, key, stored)
    return stored


def get_or_compute_report(runtime: Runtime, model: ModelRef, norm: str, seq_len: int,
                          radius: float | None) -> BoundReport:
    """The certified bound report of this request: stored, or computed here and stored."""
    key = request_key(model.sha256, norm, seq_len, radius, None)
    stored = stored_report_json(runtime, key)
    if stored is not None:
        return BoundReport.model_validate_json(stored)
    check_sync_size(runtime, model)
    return compute_and_store(runtime, model, norm, seq_len, radius)


async def report_json(runtime: Runtime, model: ModelRef, norm: str, seq_len: int,
                      radius: float | None) -> bytes:
    """`get_or_compute_report` for the server, as JSON bytes: the stored report from memory
    or a read-only transaction, else computed on the compute pool (a bounded queue: 503 with
    Retry-After when it is full). Request threads never wait for a computation."""
    key = request_key(model.sha256, norm, seq_len, radius, None)
    cached = runtime.reports.get(key)
    if isinstance(cached, bytes):
        return cached
    stored = await run_in_threadpool(stored_report_json, runtime, key)
    if stored is not None:
        return stored
    check_sync_size(runtime, model)
    try:
        report = await runtime.compute.run(
            key, lambda: compute_and_store(runtime, model, norm, seq_len, radius))
    except ComputeBusy:
        if runtime.metrics is not None:
            runtime.metrics.rejected.inc()
        raise
    assert isinstance(report, BoundReport)
    return _remember(runtime, key, report)


def sign_report(report: BoundReport, threshold: float, key: Ed25519PrivateKey,
                lower: float | None = None, **fields: Any) -> Certificate:
    """The signed certificate of `report` against `threshold` (the server's and the CLI's
    local mode's): an upper bound is stated only when it is certified."""
    from lsa_models import __version__  # deferred: imports torch

    upper = report.upper if report.verdict == "certified" else None
    body = new_certificate_body(
        model_sha256=report.model_sha256, norm=report.norm, seq_len=report.seq_len,
        radius=report.radius, threshold=threshold, upper=upper,
        lower=report.lower if lower is None else lower, passed=passed(upper, threshold),
        method=report.method, lsa_version=fields.pop("lsa_version", None) or __version__,
        **fields)
    return sign_certificate(body, key)


def issue_certificate(runtime: Runtime, model: ModelRef, report: BoundReport,
                      threshold: float) -> Certificate:
    """Sign the verdict of `report` against `threshold` and store it (one short write)."""
    with transaction(runtime.sessions) as s:
        lower = best_lower(s, model, report.norm, report.seq_len, report.radius)
        cert = sign_report(report, threshold, runtime.signing_key, lower=lower)
        s.add(CertificateRow(id=cert.id, model_id=model.id, model_sha256=model.sha256,
                             threshold=cert.threshold, upper=cert.upper, passed=cert.passed,
                             body=cert.model_dump(mode="json"), issued_at=cert.issued_at))
    if runtime.metrics is not None:
        runtime.metrics.certificates.inc()
    return cert


def register_model(runtime: Runtime, staged: Staged, filename: str) -> tuple[UploadedModel, bool]:
    """Store an upload once: (row, True) when new, (the stored row, False) for bytes seen
    before. The model is parsed outside any transaction (no write lock held meanwhile); the
    parsed model goes into the LRU, and an ONNX graph's onnxruntime agreement is recorded."""

    def existing() -> UploadedModel | None:
        with transaction(runtime.read_sessions) as s:
            return s.scalar(select(UploadedModel).where(UploadedModel.sha256 == staged.sha256))

    found = existing()
    if found is not None:
        return found, False
    if staged.size == 0:
        raise InvalidModel(f"{filename} is empty: upload a model file")
    try:
        loaded = load_bytes(staged.path.read_bytes(), filename)
        default_seq_len = loaded.resolve_seq_len(None)
    except ValueError as exc:
        raise InvalidModel(f"{filename}: {exc}") from None
    except Exception as exc:  # a loader bug must still read as bad input, not a 500
        log.warning("loading %s failed unexpectedly", filename, exc_info=True)
        raise InvalidModel(f"{filename}: could not be read as a model "
                           f"({type(exc).__name__}: {exc})") from None
    summary: dict[str, Any] = json.loads(json.dumps(loaded.summary, default=str))
    params = summary.get("parameters")
    if params is None:
        params = sum(int(p.numel()) for p in loaded.module.parameters()) or None
    # load_bytes compared an ONNX graph with onnxruntime (it raises on disagreement).
    verified = utcnow() if loaded.format.startswith("onnx") else None
    row = UploadedModel(sha256=staged.sha256, format=loaded.format, filename=filename,
                        size_bytes=staged.size, parameters=params, d_model=loaded.d_model,
                        default_seq_len=default_seq_len, fixed_seq_len=loaded.seq_len,
                        summary=summary, ort_verified_at=verified)
    with transaction(runtime.sessions) as s:
        stored, created = store_once(s, runtime.artifacts, staged, "model", row,
                                     lambda: s.scalar(select(UploadedModel).where(
                                         UploadedModel.sha256 == staged.sha256)))
    runtime.models.put(staged.sha256, loaded)
    return stored, created
