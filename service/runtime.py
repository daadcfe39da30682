"""What the server and the workers share: settings, database, artifact store, job queue."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from .artifacts import ArtifactStore
from .db import make_engine, make_session_factory
from .settings import Settings

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from .jobs.queue import JobQueue
    from .metrics import Metrics


@dataclass
class Runtime:
    settings: Settings
    engine: Engine = field(init=False)
    sessions: sessionmaker[Session] = field(init=False)
    artifacts: ArtifactStore = field(init=False)
    # Set by the app (None in workers): request-side Prometheus counters.
    metrics: Metrics | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.engine = make_engine(self.settings.database_url)
        self.sessions = make_session_factory(self.engine)
        self.artifacts = ArtifactStore(self.settings.artifact_dir)

    @cached_property
    def queue(self) -> JobQueue:
        from .jobs.queue import JobQueue

        return JobQueue(self)

    @cached_property
    def signing_key(self) -> Ed25519PrivateKey:
        from .certificates import load_or_create_signing_key

        return load_or_create_signing_key(self.settings.signing_key_path)

    def close(self) -> None:
        if "queue" in self.__dict__:
            self.queue.close()
            # A later start (another lifespan on the same app) builds a fresh queue.
            del self.__dict__["queue"]
        self.engine.dispose()
