"""`lsa db upgrade|downgrade|current`: the database schema (Alembic migrations)."""

from __future__ import annotations

from typing import Annotated

import typer
from pydantic import ValidationError

from service.db import current_revision, downgrade, head_revision, make_engine, upgrade
from service.settings import Settings

from ..kit.console import fail, settings_error
from .common import app

db_app = typer.Typer(help="Database schema migrations (LSA_DATABASE_URL).",
                     no_args_is_help=True)
app.add_typer(db_app, name="db")


def _url() -> str:
    try:
        return Settings().database_url
    except ValidationError as exc:
        fail(settings_error(exc))


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument(help="Target revision")] = "head") -> None:
    """Migrate the database up to REVISION (default: the latest)."""
    url = _url()
    try:
        upgrade(url, revision)
    except Exception as exc:
        fail(f"upgrade failed: {exc}")
    typer.echo(f"lsa: database at {revision}")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument(
        help="Target revision, e.g. -1 or base (drops everything)")]) -> None:
    """Migrate the database down to REVISION."""
    url = _url()
    try:
        downgrade(url, revision)
    except Exception as exc:
        fail(f"downgrade failed: {exc}")
    typer.echo(f"lsa: database at {revision}")


@db_app.command("current")
def db_current() -> None:
    """Print the database's revision and the latest one."""
    engine = make_engine(_url())
    try:
        current = current_revision(engine)
    except Exception as exc:
        fail(f"cannot read the database: {exc}")
    finally:
        engine.dispose()
    head = head_revision()
    state = "up to date" if current == head else "run `lsa db upgrade`"
    typer.echo(f"current: {current or '(empty)'}  head: {head}  ({state})")
