"""What every upload endpoint shares: size-capped staging."""

from __future__ import annotations

from pathlib import PurePath

from fastapi import UploadFile

from ..artifacts import Staged, TooLarge
from ..errors import PayloadTooLarge
from ..runtime import Runtime


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
