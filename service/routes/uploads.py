"""What every upload endpoint shares: size-capped staging and store-once insertion."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import PurePath
from typing import TypeVar

from fastapi import UploadFile
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from ..artifacts import Staged, TooLarge
from ..errors import PayloadTooLarge
from ..models import Artifact
from ..runtime import Runtime

Row = TypeVar("Row")


def safe_name(name: str | None) -> str:
    base = PurePath((name or "").replace("\\", "/")).name
    return base[:255] or "upload"


def stage_upload(runtime: Runtime, file: UploadFile, limit: int,
                 setting: str) -> tuple[str, Staged]:
    """Hash the upload into a temp file; 413 naming `setting` past `limit` bytes."""
    filename = safe_name(file.filename)
    try:
        return filename, runtime.artifacts.stage(file.file, limit)
    except TooLarge:
        raise PayloadTooLarge(f"{filename} is larger than {setting}={limit} bytes") from None


def store_once(session: Session, runtime: Runtime, staged: Staged, kind: str, row: Row,
               find_existing: Callable[[], Row | None]) -> tuple[Row, bool]:
    """Commit the staged bytes and insert their row; (row, True) when new. When the same
    bytes were stored concurrently first, (that row, False)."""
    runtime.artifacts.commit(staged)
    try:
        with session.begin_nested():
            if session.get(Artifact, staged.sha256) is None:
                session.add(Artifact(sha256=staged.sha256, size_bytes=staged.size, kind=kind))
            session.add(row)
    except IntegrityError:
        existing = find_existing()
        if existing is None:
            raise
        return existing, False
    return row, True
