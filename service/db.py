"""Engine and session factory, and Alembic run programmatically from the settings.

The migration scripts live in the top-level `migrations/` directory; their path is resolved
from this package, so `lsa db upgrade` works from any working directory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


class NotMigratedError(RuntimeError):
    """The database schema is not at the latest migration."""


# Execution option marking a connection whose transactions only read (see `read_only`).
READ_ONLY = "lsa_read_only"


def make_engine(url: str, *, pool_size: int = 5, null_pool: bool = False) -> Engine:
    """`pool_size`: the threads that may hold a connection at once (request threads, compute
    threads, job threads): none of them ever waits for the pool."""
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if null_pool:
        kwargs["poolclass"] = NullPool
    else:
        # The overflow covers short-lived extras (readiness probes, metrics scrapes).
        kwargs.update(pool_size=pool_size, max_overflow=max(4, pool_size // 4), pool_timeout=60)
    if url.startswith("sqlite"):
        db_path = make_url(url).database
        if db_path and db_path != ":memory:":
            Path(db_path).parent.mkdir(parents=True, exist_ok=True)
        # Worker threads share the engine; busy_timeout makes writers wait rather than fail.
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
    engine = create_engine(url, **kwargs)
    if url.startswith("sqlite"):
        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            # SQLAlchemy emits BEGIN itself (below), not the driver: savepoints work, and
            # transactions take the write lock up front.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Any) -> None:
            # IMMEDIATE for transactions that may write: a deferred transaction that reads and
            # then writes fails at once ("database is locked", no busy wait) when another
            # connection wrote in between; an immediate one waits its turn (busy_timeout).
            # Read-only transactions are DEFERRED: in WAL mode they read a snapshot and never
            # take (or wait for) the write lock.
            read_only = conn.get_execution_options().get(READ_ONLY, False)
            conn.exec_driver_sql("BEGIN DEFERRED" if read_only else "BEGIN IMMEDIATE")
    return engine


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def make_read_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions for transactions that only read (SQLite: no write lock). The option engine
    shares `engine`'s pool."""
    return sessionmaker(engine.execution_options(**{READ_ONLY: True}), expire_on_commit=False)


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """One unit of work: commit on success, roll back on any error."""
    with factory() as session, session.begin():
        yield session


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolation would eat '%' in passwords.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def ensure_migrated(engine: Engine) -> None:
    """Refuse to run on a schema that is not at head, and say how to fix it."""
    current, head = current_revision(engine), head_revision()
    if current != head:
        state = "empty (never migrated)" if current is None else f"at revision {current}"
        raise NotMigratedError(
            f"the database {engine.url.render_as_string(hide_password=True)} is {state}, "
            f"not at the latest revision {head}: run `lsa db upgrade` (with the same "
            "LSA_DATABASE_URL) first")


def after_commit(session: Session, callback: Callable[[], None]) -> None:
    """Run `callback` once the session's current transaction has committed (never on
    rollback): jobs are enqueued only when their row is visible to workers."""
    session.info.setdefault("after_commit", []).append(callback)


def _run_after_commit(session: Session) -> None:
    callbacks = session.info.pop("after_commit", [])
    for cb in callbacks:
        cb()


def _drop_after_commit(session: Session) -> None:
    session.info.pop("after_commit", None)


event.listen(Session, "after_commit", _run_after_commit)
event.listen(Session, "after_soft_rollback", lambda session, _tx: _drop_after_commit(session))
