"""The models service: what routes do with uploaded models. Routes parse, call one of these,
and shape the response.

- `register_model`: store an upload once (parse outside any write transaction; onnxruntime
  agreement recorded so later loads skip it).
- `find_model` / `get_model` / `models_page`: reads (the snapshot requests work on, a row, a
  page).
- `ModelRef`: that snapshot, what every domain's requests need of an uploaded model.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select

from ..artifacts import Staged, store_once
from ..db import transaction
from ..errors import InvalidModel, NotFound
from ..model_cache import load_bytes
from ..runtime import Runtime
from ..tables import UploadedModel, utcnow

log = logging.getLogger("lsa.service")


@dataclass(frozen=True)
class ModelRef:
    """What requests need of an uploaded model. Rows never change once stored (the bytes are
    content-addressed), so a snapshot may be cached."""

    id: str
    sha256: str
    format: str
    filename: str
    parameters: int | None
    d_model: int | None
    default_seq_len: int
    fixed_seq_len: int | None
    ort_verified: bool
    # The upload's input layout (summary "layout"): "pixels" means `at` is an image that is
    # cut into the patches the graph takes (service.bounds.local.model_input).
    layout: str | None = None
    # A fixed graph also answers to the tokens its attention sees (summary "seq_len_choices")
    seq_len_choices: tuple[int, ...] = ()

    @classmethod
    def of(cls, row: UploadedModel) -> ModelRef:
        return cls(id=row.id, sha256=row.sha256, format=row.format, filename=row.filename,
                   parameters=row.parameters, d_model=row.d_model,
                   default_seq_len=row.default_seq_len, fixed_seq_len=row.fixed_seq_len,
                   ort_verified=row.ort_verified_at is not None,
                   layout=(row.summary or {}).get("layout"),
                   seq_len_choices=tuple((row.summary or {}).get("seq_len_choices") or ()))


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
