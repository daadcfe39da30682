"""POST /corpora (upload a UTF-8 text for training), GET /corpora/{id}, and
GET /artifacts/{sha256} (download a stored output: ONNX export, training plot, ...)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Response, UploadFile
from fastapi.responses import FileResponse
from sqlalchemy import select

from api_schemas.training import CorpusOut

from ..artifacts import store_once
from ..deps import ReadAccess, ReadSessionDep, RuntimeDep, SessionDep, WriteAccess, in_thread
from ..errors import NotFound, Unprocessable, responses
from ..tables import Artifact, Corpus
from .uploads import stage_upload

router = APIRouter(tags=["training"])

MEDIA_TYPES = {"plot": "image/png", "corpus": "text/plain; charset=utf-8"}
SUFFIXES = {"plot": ".png", "onnx": ".onnx", "model": ".safetensors", "corpus": ".txt"}


class InvalidCorpus(Unprocessable):
    error = "invalid_corpus"


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
    runtime: RuntimeDep, session: SessionDep, response: Response,
) -> CorpusOut:
    filename, staged = stage_upload(runtime, file, runtime.settings.max_corpus_bytes,
                                    "LSA_MAX_CORPUS_BYTES")
    try:
        existing = session.scalar(select(Corpus).where(Corpus.sha256 == staged.sha256))
        if existing is not None:
            response.status_code = 200
            return corpus_out(existing)
        try:
            text = staged.path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidCorpus(f"{filename} is not valid UTF-8 (byte {exc.start}: "
                                f"{exc.reason}): upload a UTF-8 encoded text file") from None
        if not text:
            raise InvalidCorpus(f"{filename} is empty: upload a text to train on")
        corpus = Corpus(sha256=staged.sha256, filename=filename, size_bytes=staged.size,
                        chars=len(text), vocab_size=len(set(text)))
        stored, created = store_once(
            session, runtime.artifacts, staged, "corpus", corpus,
            lambda: session.scalar(select(Corpus).where(Corpus.sha256 == staged.sha256)))
        if not created:
            response.status_code = 200
        return corpus_out(stored)
    finally:
        staged.discard()


@router.get("/corpora/{corpus_id}", response_model=CorpusOut, dependencies=[ReadAccess],
            summary="One uploaded corpus", responses=responses(404))
@in_thread
def read_corpus(corpus_id: str, session: ReadSessionDep) -> CorpusOut:
    corpus = session.get(Corpus, corpus_id)
    if corpus is None:
        raise NotFound(f"no corpus with id {corpus_id}; upload a text with POST /corpora")
    return corpus_out(corpus)


@router.get(
    "/artifacts/{sha256}", response_class=FileResponse, dependencies=[ReadAccess],
    summary="Download a stored file by its sha256 (trained model outputs: ONNX, plot)",
    responses={200: {"content": {"application/octet-stream": {
        "schema": {"type": "string", "format": "binary"}},
        "image/png": {"schema": {"type": "string", "format": "binary"}}},
        "description": "The stored bytes"}, **responses(404)},
)
@in_thread
def download_artifact(sha256: str, session: ReadSessionDep, runtime: RuntimeDep) -> FileResponse:
    row = session.get(Artifact, sha256)
    if row is None:
        raise NotFound(f"no artifact with sha256 {sha256}")
    path = runtime.artifacts.path_for(row.sha256)
    if not path.is_file():
        raise NotFound(f"artifact {sha256} is missing from LSA_ARTIFACT_DIR "
                       f"({runtime.settings.artifact_dir}): the server and its workers must "
                       "share that directory")
    return FileResponse(path, media_type=MEDIA_TYPES.get(row.kind, "application/octet-stream"),
                        filename=f"{row.kind}-{sha256[:12]}{SUFFIXES.get(row.kind, '')}")
