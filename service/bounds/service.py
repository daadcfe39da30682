"""Bounds as the service computes and stores them: request keys, the size limits, the one
report computation, idempotent storage (identical requests are answered from the stored
result), and the Lipschitz certificate of a report.

- `get_or_compute_report` / `report_json`: the stored report of a request, or compute and
  store it (in the server: on the compute pool, off the request threads).
- `issue_certificate`: a Lipschitz certificate of a report, issued by
  `service.certificates.service.issue` (which holds every kind's pass rule).
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api_schemas import BoundReport
from api_schemas.bounds import Norm
from api_schemas.certificates import Certificate

from ..certificates.service import issue, lipschitz_body
from ..compute import ComputeBusy
from ..db import transaction
from ..errors import InvalidModel, InvalidRequest, ModelTooLarge
from ..model_cache import load_bytes
from ..models.service import ModelRef
from ..runtime import Runtime
from ..tables import BoundResultRow

if TYPE_CHECKING:
    from lsa_models.loaded import LoadedModel


def resolve_seq_len(model: ModelRef, seq_len: int | None) -> int:
    if seq_len is None:
        return model.default_seq_len
    from lsa_models.loaded import fixed_seq_len  # deferred: torch loads with the library

    try:
        return fixed_seq_len(seq_len, model.fixed_seq_len, model.seq_len_choices)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def request_key(model_sha256: str, norm: str, seq_len: int, radius: float | None,
                empirical: dict[str, Any] | None, ball: dict[str, Any] | None = None) -> str:
    """The key identical requests share. `ball` ({center_sha256, eps}) keys a local bound;
    absent, the key is the one global requests always had."""
    fields: dict[str, Any] = {"model": model_sha256, "norm": norm, "seq_len": seq_len,
                              "radius": None if radius is None else float(radius),
                              "empirical": empirical}
    if ball is not None:
        fields["ball"] = ball
    canon = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def find_result(session: Session, key: str) -> BoundResultRow | None:
    return session.scalar(select(BoundResultRow).where(BoundResultRow.request_key == key))


def check_sync_size(runtime: Runtime, model: ModelRef) -> None:
    limit = runtime.settings.max_sync_parameters
    if model.parameters is not None and model.parameters > limit:
        raise ModelTooLarge(
            f"model {model.id} has {model.parameters} parameters, above the synchronous limit "
            f"LSA_MAX_SYNC_PARAMETERS={limit}: request it with an `empirical` section to run "
            "as a job, or raise the limit")


def check_empirical_size(runtime: Runtime, model: ModelRef, seq_len: int) -> None:
    limit = runtime.settings.max_empirical_elements
    width = model.d_model or 1
    if seq_len * width > limit:
        raise InvalidRequest(
            f"an empirical search over N x D = {seq_len} x {width} inputs exceeds "
            f"LSA_MAX_EMPIRICAL_ELEMENTS={limit}: lower seq_len")


def load_model(runtime: Runtime, model: ModelRef) -> LoadedModel:
    """The parsed model, from the LRU when it is there. An ONNX upload whose onnxruntime
    comparison passed at upload is not compared again."""

    def load() -> LoadedModel:
        if runtime.metrics is not None:
            runtime.metrics.models_loaded.inc()
        data = runtime.artifacts.read_bytes(model.sha256)
        return load_bytes(data, model.filename, check_ort=not model.ort_verified)

    return runtime.models.get(model.sha256, load)


def analytic_report(runtime: Runtime, model: ModelRef, norm: str, seq_len: int,
                    radius: float | None, loaded: LoadedModel | None = None) -> BoundReport:
    """The one computation of a certified bound report (the bound engine extends it)."""
    # Deferred: service.reports imports lsa_models, hence torch (seconds at start-up).
    from ..reports import bound_report

    loaded = loaded or load_model(runtime, model)
    try:
        result = loaded.certify(cast(Norm, norm), seq_len, radius)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    return bound_report(result, model.sha256)


def store_result(session: Session, model: ModelRef, key: str, report: BoundReport,
                 empirical: dict[str, Any] | None) -> BoundResultRow:
    """Insert once; a concurrent identical request that stored first wins and is returned."""
    row = BoundResultRow(model_id=model.id, request_key=key, norm=report.norm,
                         seq_len=report.seq_len, radius=report.radius, empirical=empirical,
                         verdict=report.verdict, upper=report.upper, lower=report.lower,
                         report=report.model_dump(mode="json"))
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        existing = find_result(session, key)
        if existing is None:
            raise
        return existing
    return row


def best_lower(session: Session, model: ModelRef, norm: str, seq_len: int,
               radius: float | None) -> float | None:
    """The largest empirical lower bound stored for this exact domain, if any."""
    q = select(BoundResultRow.lower).where(
        BoundResultRow.model_id == model.id, BoundResultRow.norm == norm,
        BoundResultRow.seq_len == seq_len, BoundResultRow.lower.is_not(None))
    q = q.where(BoundResultRow.radius.is_(None) if radius is None
                else BoundResultRow.radius == float(radius))
    values = [v for v in session.scalars(q) if v is not None]
    return max(values) if values else None


def model_load_error(filename: str, exc: Exception) -> InvalidModel:
    return InvalidModel(f"{filename}: {exc}")


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


def issue_certificate(runtime: Runtime, model: ModelRef, report: BoundReport,
                      threshold: float) -> Certificate:
    """The Lipschitz certificate of `report` against `threshold`, with the best empirical
    lower bound stored for its domain, issued in one short write transaction."""
    with transaction(runtime.sessions) as s:
        lower = best_lower(s, model, report.norm, report.seq_len, report.radius)
        return issue(s, runtime, model.id, lipschitz_body(report, threshold, lower=lower))
