"""POST /models (upload), GET /models, GET /models/{id}, GET /models/{id}/file."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Query, Response, UploadFile
from fastapi.responses import FileResponse

from api_schemas.uploads import ModelList, ModelOut

from ..deps import ReadAccess, RuntimeDep, WriteAccess, in_thread
from ..errors import NotFound, responses
from ..routes.uploads import stage_upload
from ..tables import UploadedModel
from .service import get_model, models_page, register_model

router = APIRouter(tags=["models"])


def model_out(m: UploadedModel) -> ModelOut:
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
    runtime: RuntimeDep, response: Response,
) -> ModelOut:
    filename, staged = stage_upload(runtime, file, runtime.settings.max_upload_bytes,
                                    "LSA_MAX_UPLOAD_BYTES")
    try:
        stored, created = register_model(runtime, staged, filename)
    finally:
        staged.discard()
    if not created:
        response.status_code = 200
    return model_out(stored)


@router.get("/models", response_model=ModelList, dependencies=[ReadAccess],
            summary="List uploaded models, newest first", responses=responses())
@in_thread
def list_models(
    runtime: RuntimeDep,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**31)] = 0,
) -> ModelList:
    rows, total = models_page(runtime, limit, offset)
    return ModelList(items=[model_out(m) for m in rows], total=total)


@router.get("/models/{model_id}", response_model=ModelOut, dependencies=[ReadAccess],
            summary="One model's metadata", responses=responses(404))
@in_thread
def read_model(model_id: str, runtime: RuntimeDep) -> ModelOut:
    return model_out(get_model(runtime, model_id))


@router.get(
    "/models/{model_id}/file", response_class=FileResponse, dependencies=[ReadAccess],
    summary="Download the uploaded bytes",
    responses={200: {"content": {"application/octet-stream": {
        "schema": {"type": "string", "format": "binary"}}},
        "description": "The file exactly as uploaded"}, **responses(404)},
)
@in_thread
def download_model(model_id: str, runtime: RuntimeDep) -> FileResponse:
    model = get_model(runtime, model_id)
    path = runtime.artifacts.path_for(model.sha256)
    if not path.is_file():
        raise NotFound(f"the file of model {model_id} is missing from LSA_ARTIFACT_DIR "
                       f"({runtime.settings.artifact_dir}): the server and its workers must "
                       "share that directory")
    return FileResponse(path,
                        media_type="application/octet-stream", filename=model.filename)
