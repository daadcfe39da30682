"""Bounds as the service computes and stores them: request keys, the synchronous size limit,
and idempotent storage (identical requests are answered from the stored result)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api_schemas import BoundReport

from .errors import InvalidModel, InvalidRequest, ModelTooLarge, NotFound
from .models import BoundResultRow, Model

if TYPE_CHECKING:
    from lsa_models.analysis import LoadedModel

    from .runtime import Runtime

_threads_lock = threading.Lock()
_threads_set = False


def _one_thread() -> None:
    global _threads_set
    with _threads_lock:
        if not _threads_set:
            import torch

            # Request threads and workers share few cores; one thread each is fastest.
            torch.set_num_threads(1)
            _threads_set = True


def load_bytes(data: bytes, filename: str) -> LoadedModel:
    """lsa_models' format sniffing, with every loader registered (the ONNX one registers on
    import of lsa_models.onnx)."""
    import importlib

    from lsa_models.analysis import load_model_bytes

    _one_thread()
    with contextlib.suppress(ModuleNotFoundError):
        importlib.import_module("lsa_models.onnx")
    return load_model_bytes(data, filename)


def get_model(session: Session, model_id: str) -> Model:
    model = session.get(Model, model_id)
    if model is None:
        raise NotFound(f"no model with id {model_id}; upload one with POST /models "
                       "(GET /models lists them)")
    return model


def resolve_seq_len(model: Model, seq_len: int | None) -> int:
    if seq_len is None:
        return model.default_seq_len
    if model.fixed_seq_len is not None and seq_len != model.fixed_seq_len:
        raise InvalidRequest(f"seq_len={seq_len} differs from the model's fixed sequence length "
                             f"{model.fixed_seq_len}: omit seq_len or set it to "
                             f"{model.fixed_seq_len}")
    return seq_len


def request_key(model_sha256: str, norm: str, seq_len: int, radius: float | None,
                empirical: dict[str, Any] | None) -> str:
    canon = json.dumps({"model": model_sha256, "norm": norm, "seq_len": seq_len,
                        "radius": None if radius is None else float(radius),
                        "empirical": empirical}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def find_result(session: Session, key: str) -> BoundResultRow | None:
    return session.scalar(select(BoundResultRow).where(BoundResultRow.request_key == key))


def check_sync_size(runtime: Runtime, model: Model) -> None:
    limit = runtime.settings.max_sync_parameters
    if model.parameters is not None and model.parameters > limit:
        raise ModelTooLarge(
            f"model {model.id} has {model.parameters} parameters, above the synchronous limit "
            f"LSA_MAX_SYNC_PARAMETERS={limit}: request it with an `empirical` section to run "
            "as a job, or raise the limit")


def check_empirical_size(runtime: Runtime, model: Model, seq_len: int) -> None:
    limit = runtime.settings.max_empirical_elements
    width = model.d_model or 1
    if seq_len * width > limit:
        raise InvalidRequest(
            f"an empirical search over N x D = {seq_len} x {width} inputs exceeds "
            f"LSA_MAX_EMPIRICAL_ELEMENTS={limit}: lower seq_len")


def load_model(runtime: Runtime, model: Model) -> LoadedModel:
    return load_bytes(runtime.artifacts.read_bytes(model.sha256), model.filename)


def analytic_report(runtime: Runtime, model: Model, norm: str, seq_len: int,
                    radius: float | None, loaded: LoadedModel | None = None) -> BoundReport:
    from .reports import bound_report

    loaded = loaded or load_model(runtime, model)
    try:
        result = loaded.certify(norm, seq_len, radius)  # type: ignore[arg-type]
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    return bound_report(result, model.sha256)


def store_result(session: Session, model: Model, key: str, report: BoundReport,
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


def best_lower(session: Session, model: Model, norm: str, seq_len: int,
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
