"""`lsa keys create|list|revoke`: API keys (needed when LSA_AUTH_REQUIRED=true)."""

from __future__ import annotations

from typing import Annotated

import typer
from pydantic import ValidationError
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from service.auth import api_keys, new_api_key, revoke_api_key
from service.db import NotMigratedError, ensure_migrated, make_engine, make_session_factory
from service.settings import Settings

from ..kit.console import fail, settings_error
from .common import app

keys_app = typer.Typer(help="API keys for the REST API.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")


def _runtime() -> tuple[Engine, sessionmaker[Session]]:
    try:
        settings = Settings()
    except ValidationError as exc:
        fail(settings_error(exc))
    engine = make_engine(settings.database_url)
    try:
        ensure_migrated(engine)
    except NotMigratedError as exc:
        fail(str(exc))
    return engine, make_session_factory(engine)


@keys_app.command("create")
def keys_create(
    scope: Annotated[str, typer.Option("--scope", help="read (GET endpoints) or write (all)")],
    name: Annotated[str | None, typer.Option("--name", help="A label for the key")] = None,
) -> None:
    """Create a key; it is printed once and stored only as a hash."""
    if scope not in ("read", "write"):
        fail(f"--scope must be read or write, got {scope!r}")
    engine, sessions = _runtime()
    prefix, key = new_api_key(sessions, scope, name)
    engine.dispose()
    typer.echo(key)
    typer.echo(f"lsa: created {scope} key {prefix}; it is not shown again", err=True)


@keys_app.command("list")
def keys_list() -> None:
    """List keys (prefix, scope, name, state); never the keys themselves."""
    engine, sessions = _runtime()
    for prefix, scope, revoked, name in api_keys(sessions):
        state = "revoked" if revoked else "active"
        typer.echo(f"{prefix}  {scope:5}  {state:7}  {name or ''}")
    engine.dispose()


@keys_app.command("revoke")
def keys_revoke(prefix: Annotated[str, typer.Argument(help="The key's prefix (lsa keys list)")]
                ) -> None:
    """Revoke a key by its prefix."""
    engine, sessions = _runtime()
    done = revoke_api_key(sessions, prefix)
    engine.dispose()
    if not done:
        fail(f"no active key with prefix {prefix!r}")
    typer.echo(f"lsa: revoked {prefix}")
