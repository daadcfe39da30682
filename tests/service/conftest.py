"""Service fixtures. Databases are built BY RUNNING THE MIGRATIONS: SQLite in a temp dir and
the real PostgreSQL from LSA_TEST_POSTGRES_URL (a fresh schema per test session, dropped
after). Redis comes from LSA_TEST_REDIS_URL. A backend's tests are skipped only when its
variable is unset."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from lsa_models import Transformer, TransformerConfig, to_bytes
from service.app import create_app
from service.db import upgrade
from service.settings import Settings

PG_ENV = "LSA_TEST_POSTGRES_URL"
REDIS_ENV = "LSA_TEST_REDIS_URL"


def tiny_model_bytes(seed: int = 0, d_model: int = 8, n_layers: int = 1) -> bytes:
    torch.manual_seed(seed)
    model = Transformer(TransformerConfig(d_model=d_model, n_heads=2, n_layers=n_layers,
                                          d_ff=2 * d_model))
    return to_bytes(model)


def with_search_path(url: str, schema: str) -> str:
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}options=-csearch_path%3D{schema}"


class PgSchemas:
    """Creates fresh schemas in the shared `test` database and drops them all at the end."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.engine = create_engine(base_url, isolation_level="AUTOCOMMIT")
        self.names: list[str] = []

    def new(self) -> str:
        name = f"lsa_test_{uuid.uuid4().hex[:12]}"
        with self.engine.connect() as conn:
            conn.execute(text(f'CREATE SCHEMA "{name}"'))
        self.names.append(name)
        return with_search_path(self.base_url, name)

    def drop_all(self) -> None:
        with self.engine.connect() as conn:
            for name in self.names:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
        self.engine.dispose()


@pytest.fixture(scope="session")
def pg_schemas() -> Iterator[PgSchemas]:
    base = os.environ.get(PG_ENV)
    if not base:
        pytest.skip(f"{PG_ENV} is not set")
    schemas = PgSchemas(base)
    yield schemas
    schemas.drop_all()


@pytest.fixture(scope="session")
def redis_url() -> str:
    url = os.environ.get(REDIS_ENV)
    if not url:
        pytest.skip(f"{REDIS_ENV} is not set")
    return url


@pytest.fixture(scope="session")
def sqlite_migrated(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("db") / "lsa.db"
    url = f"sqlite:///{path}"
    upgrade(url)
    return url


@pytest.fixture(scope="session")
def pg_migrated(pg_schemas: PgSchemas) -> str:
    url = pg_schemas.new()
    upgrade(url)
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    """A migrated database shared by the session: tests use fresh random models and ids."""
    name = "sqlite_migrated" if request.param == "sqlite" else "pg_migrated"
    return str(request.getfixturevalue(name))


@pytest.fixture
def make_settings(tmp_path: Path) -> Callable[..., Settings]:
    def make(database_url: str, **overrides: Any) -> Settings:
        fields: dict[str, Any] = {
            "database_url": database_url,
            "artifact_dir": tmp_path / "artifacts",
            "signing_key_path": tmp_path / "signing_key.pem",
            "migrate_on_start": False,
            "redis_url": None,
        }
        fields.update(overrides)
        return Settings(**fields)

    return make


@pytest.fixture
def client(db_url: str, make_settings: Callable[..., Settings]) -> Iterator[TestClient]:
    app = create_app(make_settings(db_url))
    with TestClient(app) as c:
        yield c


@pytest.fixture
def model_bytes() -> bytes:
    return tiny_model_bytes(seed=uuid.uuid4().int % 2**31)


def upload(c: TestClient, data: bytes, name: str = "m.safetensors") -> dict[str, Any]:
    r = c.post("/models", files={"file": (name, data, "application/octet-stream")})
    assert r.status_code in (200, 201), r.text
    return dict(r.json())


def rows_of(db_url: str, table: Any, model_id: str) -> int:
    """How many rows of `table` (a table with a model_id column) the database holds for the
    model."""
    from sqlalchemy import func, select

    from service.db import make_engine

    engine = make_engine(db_url)
    with engine.connect() as conn:
        rows = conn.scalar(select(func.count()).select_from(table).where(
            table.model_id == model_id))
    engine.dispose()
    return int(rows or 0)
