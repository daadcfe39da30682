"""POST /corpora (upload a UTF-8 text for training), GET /corpora/{id}, and
GET /artifacts/{sha256} (download a stored output: ONNX export, training plot, ...)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Response, UploadFile
from fastapi.responses import FileResponse

from api_schemas.training import CorpusOut

from ..deps import ReadAccess, RuntimeDep, WriteAccess, in_thread
from ..errors import responses
from ..routes.uploads import stage_upload
from ..tables import Corpus
from .service import find_artifact, find_corpus, store_corpus

router = APIRouter(tags=["training"])

MEDIA_TYPES = {"plot": "image/png", "corpus": "text/plain; charset=utf-8"}
SUFFIXES = {"plot": ".png", "onnx": ".onnx", "model": ".safetensors", "corpus": ".txt"}


def corpus_out(c: Corpus) -> CorpusOut:
    return CorpusOut(id=c.id, sha256=c.sha256, filename=c.filename, size_bytes=c.size_bytes,
                     chars=c.chars, vocab_size=c.vocab_size, created_at=c.created_at)


@router.post(
    "/corpora", status_code=201, response_model=CorpusOut, dependencies=[WriteAccess],
    summary="Upload a UTF-8 text to train on (name its id as training.corpus in POST /certify)",
    responses={200: {"model": CorpusOut, "description": "This text was uploaded before: the "
                     "stored corpus (same id)"}, **responses(413)},
)
@in_thread
def upload_corpus(
    file: Annotated[UploadFile, File(description="A UTF-8 text file (at most "
                                                 "LSA_MAX_CORPUS_BYTES)")],
    runtime: RuntimeDep, response: Response,
) -> CorpusOut:
    filename, staged = stage_upload(runtime, file, runtime.settings.max_corpus_bytes,
                                    "LSA_MAX_CORPUS_BYTES")
    try:
        stored, created = store_corpus(runtime, staged, filename)
    finally:
        staged.discard()
    if not created:
        response.status_code = 200
    return corpus_out(stored)


@router.get("/corpora/{corpus_id}", response_model=CorpusOut, dependencies=[ReadAccess],
            summary="One uploaded corpus", responses=responses(404))
@in_thread
def read_corpus(corpus_id: str, runtime: RuntimeDep) -> CorpusOut:
    return corpus_out(find_corpus(runtime, corpus_id))


@router.get(
    "/artifacts/{sha256}", response_class=FileResponse, dependencies=[ReadAccess],
    summary="Download a stored file by its sha256 (trained model outputs: ONNX, plot)",
    responses={200: {"content": {"application/octet-stream": {
        "schema": {"type": "string", "format": "binary"}},
        "image/png": {"schema": {"type": "string", "format": "binary"}}},
        "description": "The stored bytes"}, **responses(404)},
)
@in_thread
def download_artifact(sha256: str, runtime: RuntimeDep) -> FileResponse:
    row = find_artifact(runtime, sha256)
    return FileResponse(runtime.artifacts.path_for(row.sha256),
                        media_type=MEDIA_TYPES.get(row.kind, "application/octet-stream"),
                        filename=f"{row.kind}-{sha256[:12]}{SUFFIXES.get(row.kind, '')}")
