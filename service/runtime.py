"""What the server and the workers share: settings, database, artifact store, job queue,
loaded models, the compute pool and (in the server) the request metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from .artifacts import ArtifactStore
from .broker import JobQueue
from .compute import ComputePool
from .db import make_engine, make_read_session_factory, make_session_factory
from .metrics import Metrics
from .model_cache import LRU, ModelCache
from .settings import Settings
from .signing_key import load_or_create_signing_key

# Entries, not bytes: a model snapshot is a few hundred bytes, a report a few kilobytes.
MODEL_REF_CACHE_SIZE = 4096
REPORT_CACHE_SIZE = 4096


@dataclass
class Runtime:
    settings: Settings
    # Request-side Prometheus counters (the app's); None in workers and the CLI.
    metrics: Metrics | None = None
    engine: Engine = field(init=False)
    sessions: sessionmaker[Session] = field(init=False)
    # Transactions that only read: on SQLite they never take the write lock.
    read_sessions: sessionmaker[Session] = field(init=False)
    artifacts: ArtifactStore = field(init=False)
    models: ModelCache = field(init=False)
    # Rows and rendered reports never change once stored: model snapshots by id, report JSON
    # by request key.
    model_refs: LRU = field(init=False)
    reports: LRU = field(init=False)

    def __post_init__(self) -> None:
        self.engine = make_engine(self.settings.database_url,
                                  pool_size=self.settings.db_pool_size)
        self.sessions = make_session_factory(self.engine)
        self.read_sessions = make_read_session_factory(self.engine)
        self.artifacts = ArtifactStore(self.settings.artifact_dir)
        self.models = ModelCache(self.settings.model_cache_size)
        self.model_refs = LRU(MODEL_REF_CACHE_SIZE)
        self.reports = LRU(REPORT_CACHE_SIZE)
        if self.metrics is not None:
            self.metrics.watch_store(self.read_sessions)

    @cached_property
    def queue(self) -> JobQueue:
        return JobQueue(self.settings)

    @cached_property
    def compute(self) -> ComputePool:
        return ComputePool(self.settings.compute_threads, self.settings.compute_queue_limit)

    @cached_property
    def signing_key(self) -> Ed25519PrivateKey:
        return load_or_create_signing_key(self.settings.signing_key_path)

    def close(self) -> None:
        # A later start (another lifespan on the same app) builds a fresh queue and pool.
        if "queue" in self.__dict__:
            self.queue.close()
            del self.__dict__["queue"]
        if "compute" in self.__dict__:
            self.compute.close()
            del self.__dict__["compute"]
        self.engine.dispose()
