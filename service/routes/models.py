"""POST /models (upload), GET /models, GET /models/{id}, GET /models/{id}/file."""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any

from fastapi import APIRouter, File, Query, Response, UploadFile
from fastapi.responses import FileResponse
from sqlalchemy import func, select

from api_schemas.models import ModelList, ModelOut

from ..bounding import get_model, load_bytes
from ..deps import ReadAccess, RuntimeDep, SessionDep, WriteAccess
from ..errors import InvalidModel, NotFound, responses
from ..models import Model
from .uploads import stage_upload, store_once

log = logging.getLogger("lsa.service")
router = APIRouter(tags=["models"])


def model_out(m: Model) -> ModelOut:
    return ModelOut(id=m.id, sha256=m.sha256, format=m.format, filename=m.filename,
                    size_bytes=m.size_bytes, parameters=m.parameters,
                    default_seq_len=m.default_seq_len, fixed_seq_len=m.fixed_seq_len,
                    summary=m.summary, created_at=m.created_at)


@router.post(
    "/models", status_code=201, response_model=ModelOut, dependencies=[WriteAccess],
    summary="Upload a model (.onnx, .zip of .onnx + external data, or native .safetensors)",
    responses={200: {"model": ModelOut, "description": "These bytes were uploaded before: "
                     "the stored model (same id)"}, **responses(413)},
)
def upload_model(
    file: Annotated[UploadFile, File(description="The model file; its format is detected "
                                                 "from the content, not the name")],
    runtime: RuntimeDep, session: SessionDep, response: Response,
) -> ModelOut:
    filename, staged = stage_upload(runtime, file, runtime.settings.max_upload_bytes,
                                    "LSA_MAX_UPLOAD_BYTES")
    try:
        existing = session.scalar(select(Model).where(Model.sha256 == staged.sha256))
        if existing is not None:
            response.status_code = 200
            return model_out(existing)
        if staged.size == 0:
            raise InvalidModel(f"{filename} is empty: upload a model file")
        data = staged.path.read_bytes()
        try:
            loaded = load_bytes(data, filename)
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
        model = Model(sha256=staged.sha256, format=loaded.format, filename=filename,
                      size_bytes=staged.size, parameters=params, d_model=loaded.d_model,
                      default_seq_len=default_seq_len, fixed_seq_len=loaded.seq_len,
                      summary=summary)
        stored, created = store_once(
            session, runtime, staged, "model", model,
            lambda: session.scalar(select(Model).where(Model.sha256 == staged.sha256)))
        if not created:
            response.status_code = 200
        return model_out(stored)
    finally:
        staged.discard()


@router.get("/models", response_model=ModelList, dependencies=[ReadAccess],
            summary="List uploaded models, newest first", responses=responses())
def list_models(
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**31)] = 0,
) -> ModelList:
    total = session.scalar(select(func.count()).select_from(Model)) or 0
    rows = session.scalars(select(Model).order_by(Model.created_at.desc(), Model.id)
                           .limit(limit).offset(offset))
    return ModelList(items=[model_out(m) for m in rows], total=total)


@router.get("/models/{model_id}", response_model=ModelOut, dependencies=[ReadAccess],
            summary="One model's metadata", responses=responses(404))
def read_model(model_id: str, session: SessionDep) -> ModelOut:
    return model_out(get_model(session, model_id))


@router.get(
    "/models/{model_id}/file", response_class=FileResponse, dependencies=[ReadAccess],
    summary="Download the uploaded bytes",
    responses={200: {"content": {"application/octet-stream": {
        "schema": {"type": "string", "format": "binary"}}},
        "description": "The file exactly as uploaded"}, **responses(404)},
)
def download_model(model_id: str, session: SessionDep, runtime: RuntimeDep) -> FileResponse:
    model = get_model(session, model_id)
    path = runtime.artifacts.path_for(model.sha256)
    if not path.is_file():
        raise NotFound(f"the file of model {model_id} is missing from LSA_ARTIFACT_DIR "
                       f"({runtime.settings.artifact_dir}): the server and its workers must "
                       "share that directory")
    return FileResponse(path,
                        media_type="application/octet-stream", filename=model.filename)
