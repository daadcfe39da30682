"""The certifying service: what routes, jobs and the CLI do with models, bounds and
certificates. Routes parse, call one of these, and shape the response.

- `register_model`: store an upload once (parse outside any write transaction; onnxruntime
  agreement recorded so later loads skip it).
- `get_or_compute_report` / `report_json`: the stored report of a request, or compute and
  store it (in the server: on the compute pool, off the request threads).
- `issue_certificate`: a Lipschitz certificate of a report, issued by
  `service.certificates.issue` (which holds every kind's pass rule).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from sqlalchemy import func, select
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
from .certificates import issue, lipschitz_body
from .compute import ComputeBusy
from .db import transaction
from .errors import InvalidModel, NotFound
from .model_cache import load_bytes
from .runtime import Runtime
from .tables import UploadedModel, utcnow

log = logging.getLogger("lsa.service")


def find_model(runtime: Runtime, model_id: str) -> ModelRef:
    """The model `model_id` (404 when there is none), from memory when seen before."""
    cached = runtime.model_refs.get(model_id)
    if isinstance(cached, ModelRef):
        return cached
    ref = ModelRef.of(get_model(runtime, model_id))
    runtime.model_refs.put(model_id, ref)
    return ref


def get_model(runtime: Runtime, model_id: str) -> UploadedModel:
    """The stored model row (a read-only transaction); NotFound when there is none."""
    with transaction(runtime.read_sessions) as s:
        row = s.get(UploadedModel, model_id)
        if row is None:
            raise NotFound(f"no model with id {model_id}; upload one with POST /models "
                           "(GET /models lists them)")
        return row


def models_page(runtime: Runtime, limit: int, offset: int) -> tuple[list[UploadedModel], int]:
    """A page of the stored models, newest first, and how many there are (one read-only
    transaction)."""
    with transaction(runtime.read_sessions) as s:
        total = s.scalar(select(func.count()).select_from(UploadedModel)) or 0
        rows = list(s.scalars(select(UploadedModel)
                              .order_by(UploadedModel.created_at.desc(), UploadedModel.id)
                              .limit(limit).offset(offset)))
        return rows, int(total)


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
