"""Migrations: empty -> head -> base -> head on both databases; the models match the migrated
schema; the server refuses an unmigrated database and names the command to run."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from fastapi.testclient import TestClient
from sqlalchemy import inspect
from typer.testing import CliRunner

from service.app import create_app
from service.cli import app as cli_app
from service.db import (
    NotMigratedError,
    current_revision,
    downgrade,
    head_revision,
    make_engine,
    upgrade,
)
from service.settings import Settings, cgroup_cpus
from service.tables import Base

from .conftest import PgSchemas

TABLES = {"alembic_version", "api_keys", "artifacts", "bound_results", "certificates",
          "corpora", "jobs", "models", "robustness_results", "robustness_set_results"}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fresh.db'}"
    schemas: PgSchemas = request.getfixturevalue("pg_schemas")
    return schemas.new()


def _drift(url: str) -> list[object]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(ctx, Base.metadata))
    finally:
        engine.dispose()


def test_migrations_up_down_up_without_drift(empty_url: str) -> None:
    engine = make_engine(empty_url)
    try:
        assert current_revision(engine) is None
        upgrade(empty_url)
        assert current_revision(engine) == head_revision()
        assert set(inspect(engine).get_table_names()) == TABLES
        assert _drift(empty_url) == []
        downgrade(empty_url, "base")
        engine.dispose()
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        assert current_revision(engine) is None
        upgrade(empty_url)
        assert current_revision(engine) == head_revision()
        assert _drift(empty_url) == []
    finally:
        engine.dispose()


def test_server_refuses_unmigrated_database(empty_url: str,
                                            make_settings: Callable[..., Settings]) -> None:
    app = create_app(make_settings(empty_url, migrate_on_start=False))
    with pytest.raises(NotMigratedError, match="lsa db upgrade"), TestClient(app):
        pass


def test_embedded_default_migrates_on_start(tmp_path: Path,
                                            make_settings: Callable[..., Settings]) -> None:
    url = f"sqlite:///{tmp_path / 'var' / 'lsa.db'}"
    app = create_app(make_settings(url, migrate_on_start=None))
    with TestClient(app) as c:
        assert c.get("/readyz").status_code == 200
    assert (tmp_path / "signing_key.pem").exists()


def test_cli_db_upgrade_current_and_serve_refusal(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("LSA_DATABASE_URL", url)
    monkeypatch.setenv("LSA_MIGRATE_ON_START", "false")
    monkeypatch.chdir(tmp_path)  # any working directory: the scripts are found from the package
    runner = CliRunner()
    refused = runner.invoke(cli_app, ["serve", "--port", "1"])
    assert refused.exit_code == 2
    assert "lsa db upgrade" in refused.output
    r = runner.invoke(cli_app, ["db", "current"])
    assert r.exit_code == 0 and "(empty)" in r.output
    r = runner.invoke(cli_app, ["db", "upgrade"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(cli_app, ["db", "current"])
    assert f"current: {head_revision()}" in r.output and "up to date" in r.output
    r = runner.invoke(cli_app, ["db", "downgrade", "base"])
    assert r.exit_code == 0
    r = runner.invoke(cli_app, ["db", "current"])
    assert "(empty)" in r.output


def test_settings_fail_fast_on_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="LSA_DATABASE_URL"):
        Settings(database_url="mysql://x")
    with pytest.raises(ValueError, match="LSA_REDIS_URL"):
        Settings(redis_url="http://x")
    with pytest.raises(ValueError):
        Settings(max_upload_bytes=0)
    with pytest.raises(ValueError, match="set_workers"):
        Settings(set_workers=0)
    # empty (docker-compose's unset variable): the CPUs this process may use
    monkeypatch.setenv("LSA_SET_WORKERS", "")
    assert Settings().set_workers is None
    assert Settings().set_processes == min(len(os.sched_getaffinity(0)), cgroup_cpus() or 4,
                                           4)
    monkeypatch.setenv("LSA_SET_WORKERS", "3")
    assert Settings().set_processes == 3
    monkeypatch.delenv("LSA_SET_WORKERS")
    monkeypatch.setenv("LSA_BOUND_TIME_LIMIT_S", "-1")
    runner = CliRunner()
    r = runner.invoke(cli_app, ["serve"])
    assert r.exit_code == 2 and "LSA_BOUND_TIME_LIMIT_S" in r.output


def test_drift_check_sees_a_schema_change(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'drift.db'}"
    upgrade(url)
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP INDEX ix_jobs_status")
    engine.dispose()
    assert _drift(url) != []


@pytest.mark.parametrize(("files", "cpus"), [
    ({"cpu.max": "200000 100000\n"}, 2),
    ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs' time: two processes
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "garbage"}, None),
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),
    ({"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
     None),
    ({}, None),
])
def test_cgroup_cpus_reads_the_quota_of_v1_and_v2(tmp_path: Path, files: dict[str, str],
                                                  cpus: int | None) -> None:
    """A container's CPU quota caps the default set workers (its affinity shows the host's
    CPUs)."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpus(tmp_path) == cpus
