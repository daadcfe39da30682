"""SQLAlchemy 2.0 typed tables (ORM classes). The migrations in `migrations/versions` build
exactly this schema (tests compare the two). Every `*_at` column is a UTC timestamp."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
ACTIVE_JOB_STATUSES = ("queued", "running")
KEY_SCOPES = ("read", "write")


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return str(uuid.uuid4())


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC in and out; SQLite stores naive text, so re-attach UTC on read."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: store UTC-aware timestamps only")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON()}


class Artifact(Base):
    """A file in the content-addressed store (upload, trained weights, plot)."""

    __tablename__ = "artifacts"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class UploadedModel(Base):
    """An uploaded (or trained) model: its bytes are the artifact `sha256`."""

    __tablename__ = "models"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    sha256: Mapped[str] = mapped_column(ForeignKey("artifacts.sha256"), unique=True)
    format: Mapped[str] = mapped_column(String(16))
    filename: Mapped[str] = mapped_column(String(255))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    parameters: Mapped[int | None] = mapped_column(BigInteger)
    d_model: Mapped[int | None] = mapped_column(Integer)
    # The N used when a request names none, and the N a graph model is fixed to (if any).
    default_seq_len: Mapped[int] = mapped_column(Integer)
    fixed_seq_len: Mapped[int | None] = mapped_column(Integer)
    summary: Mapped[dict[str, Any]] = mapped_column(JSON)
    # When onnxruntime agreed with the torch evaluation of this ONNX upload (None: native, or
    # stored before this was recorded): later loads of the same bytes skip the comparison.
    ort_verified_at: Mapped[datetime | None] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Corpus(Base):
    """An uploaded UTF-8 text for training requests; its bytes live in the artifact store."""

    __tablename__ = "corpora"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    sha256: Mapped[str] = mapped_column(ForeignKey("artifacts.sha256"), unique=True)
    filename: Mapped[str] = mapped_column(String(255))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    chars: Mapped[int] = mapped_column(BigInteger)
    vocab_size: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class BoundResultRow(Base):
    """One stored bound report; `request_key` makes identical requests hit the same row."""

    __tablename__ = "bound_results"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"),
                                          index=True)
    request_key: Mapped[str] = mapped_column(String(64), unique=True)
    norm: Mapped[str] = mapped_column(String(8))
    seq_len: Mapped[int] = mapped_column(Integer)
    radius: Mapped[float | None] = mapped_column(Float)
    empirical: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    verdict: Mapped[str] = mapped_column(String(16))
    upper: Mapped[float | None] = mapped_column(Float)
    lower: Mapped[float | None] = mapped_column(Float)
    report: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class RobustnessResultRow(Base):
    """The radii of one (model, centre, label, norm): `request_key` hashes those four, so a
    certificate for another min_radius is signed from this row without recomputing."""

    __tablename__ = "robustness_results"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"),
                                          index=True)
    request_key: Mapped[str] = mapped_column(String(64), unique=True)
    norm: Mapped[str] = mapped_column(String(8))
    label: Mapped[int] = mapped_column(Integer)
    center_sha256: Mapped[str] = mapped_column(String(64))
    certified_radius: Mapped[float] = mapped_column(Float)
    # service.robustness.verdicts.robustness_of's object (what `lsa robustness --json` prints)
    result: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class RobustnessSetResultRow(Base):
    """The verdicts of one (model, inputs and labels, norm, radius): `request_key` hashes
    those, so a certified-accuracy certificate for another threshold is signed from this row
    without deciding the inputs again."""

    __tablename__ = "robustness_set_results"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"),
                                          index=True)
    request_key: Mapped[str] = mapped_column(String(64), unique=True)
    norm: Mapped[str] = mapped_column(String(8))
    radius: Mapped[float] = mapped_column(Float)
    n: Mapped[int] = mapped_column(Integer)
    inputs_sha256: Mapped[str] = mapped_column(String(64))
    certified_accuracy: Mapped[float] = mapped_column(Float)
    # service.robustness.verdicts.set_json's object (what `lsa robustness --inputs --json` prints)
    result: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class CertificateRow(Base):
    __tablename__ = "certificates"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"),
                                          index=True)
    model_sha256: Mapped[str] = mapped_column(String(64), index=True)
    threshold: Mapped[float] = mapped_column(Float)
    upper: Mapped[float | None] = mapped_column(Float)
    passed: Mapped[bool] = mapped_column(Boolean)
    # The signed certificate exactly as issued (the signature covers its fields).
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    issued_at: Mapped[datetime] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Job(Base):
    """The source of truth of a job: workers read their input here and write progress here."""

    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint("status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')",
                        name="status"),
        CheckConstraint("progress >= 0 AND progress <= 1", name="progress"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    kind: Mapped[str] = mapped_column(String(32))
    queue: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16), index=True, default="queued")
    progress: Mapped[float] = mapped_column(Float, default=0.0)
    stage: Mapped[str | None] = mapped_column(String(200))
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    request_key: Mapped[str | None] = mapped_column(String(64), index=True)
    model_id: Mapped[str | None] = mapped_column(ForeignKey("models.id", ondelete="SET NULL"))
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    # Incremented on every claim; a worker only writes while its attempt is current, so a
    # job re-run after a crash can never be finished twice.
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # When its message was last sent to the broker: a queued job whose message sat longer
    # than LSA_JOB_STALE_AFTER_S (held by a dead worker) is sent again.
    enqueued_at: Mapped[datetime | None] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column()
    heartbeat_at: Mapped[datetime | None] = mapped_column()
    finished_at: Mapped[datetime | None] = mapped_column()


class ApiKey(Base):
    __tablename__ = "api_keys"
    __table_args__ = (CheckConstraint("scope IN ('read', 'write')", name="scope"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    scope: Mapped[str] = mapped_column(String(8))
    name: Mapped[str | None] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column()
    revoked_at: Mapped[datetime | None] = mapped_column()
