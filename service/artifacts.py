"""Content-addressed file store: every file lives at `<root>/<sha[:2]>/<sha>`.

Writes go to a temp file in the same directory tree and are renamed into place, so a reader
never sees half a file and equal content is stored once.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from .tables import Artifact

CHUNK = 1024 * 1024


class TooLarge(ValueError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"larger than {limit} bytes")
        self.limit = limit


@dataclass(frozen=True)
class Staged:
    """A file hashed and written to a temp path, not yet in the store."""

    path: Path
    sha256: str
    size: int

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


class ArtifactStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._tmp = self.root / "tmp"
        self._tmp.mkdir(parents=True, exist_ok=True)

    def path_for(self, sha256: str) -> Path:
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256!r}")
        return self.root / sha256[:2] / sha256

    def exists(self, sha256: str) -> bool:
        return self.path_for(sha256).is_file()

    def stage(self, src: BinaryIO, max_bytes: int) -> Staged:
        """Copy a stream to a temp file, hashing as it goes; TooLarge past `max_bytes`."""
        digest = hashlib.sha256()
        size = 0
        fd, name = tempfile.mkstemp(dir=self._tmp, prefix="upload-")
        path = Path(name)
        try:
            with os.fdopen(fd, "wb") as out:
                while chunk := src.read(CHUNK):
                    size += len(chunk)
                    if size > max_bytes:
                        raise TooLarge(max_bytes)
                    digest.update(chunk)
                    out.write(chunk)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return Staged(path, digest.hexdigest(), size)

    def commit(self, staged: Staged) -> Path:
        dest = self.path_for(staged.sha256)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():
            staged.discard()
        else:
            os.replace(staged.path, dest)
        return dest

    def put_bytes(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        dest = self.path_for(sha)
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(dir=self._tmp)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(name, dest)
        return sha

    def read_bytes(self, sha256: str) -> bytes:
        return self.path_for(sha256).read_bytes()


def store_artifact(session: Session, store: ArtifactStore, data: bytes, kind: str) -> str:
    """Store bytes (trained weights, a plot, ...) and record their metadata; returns the
    sha256. Idempotent: equal bytes are one file and one row."""
    sha = store.put_bytes(data)
    if session.get(Artifact, sha) is None:
        session.add(Artifact(sha256=sha, size_bytes=len(data), kind=kind))
        session.flush()
    return sha


Row = TypeVar("Row")


def store_once(session: Session, store: ArtifactStore, staged: Staged, kind: str, row: Row,
               find_existing: Callable[[], Row | None]) -> tuple[Row, bool]:
    """Commit the staged bytes and insert their row; (row, True) when new. When the same
    bytes were stored concurrently first, (that row, False)."""
    store.commit(staged)
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
