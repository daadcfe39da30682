"""API keys: created by `lsa keys create`, stored hashed, read/write scopes enforced."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from typer.testing import CliRunner

from service.app import create_app
from service.auth import create_key, hash_key
from service.cli import app as cli_app
from service.db import transaction
from service.settings import Settings
from service.tables import ApiKey

from .conftest import tiny_model_bytes


@pytest.fixture
def auth_client(db_url: str, make_settings: Callable[..., Settings]) -> Iterator[TestClient]:
    app = create_app(make_settings(db_url, auth_required=True))
    with TestClient(app) as c:
        yield c


def _key(c: TestClient, scope: str) -> str:
    rt = c.app.state.runtime  # type: ignore[attr-defined]
    with transaction(rt.sessions) as s:
        return create_key(s, scope, "test")[1]


def test_auth_scopes_enforced(auth_client: TestClient) -> None:
    c = auth_client
    read, write = _key(c, "read"), _key(c, "write")
    data = tiny_model_bytes(seed=11)
    files = {"file": ("m.safetensors", data)}
    r = c.post("/models", files=files)
    assert r.status_code == 401 and "lsa keys create --scope write" in r.json()["detail"]
    assert r.headers["www-authenticate"] == "Bearer"
    assert c.get("/models").status_code == 401
    r = c.post("/models", files=files, headers={"Authorization": f"Bearer {read}"})
    assert r.status_code == 403 and r.json()["error"] == "forbidden"
    r = c.post("/models", files=files, headers={"Authorization": f"Bearer {write}"})
    assert r.status_code == 201
    mid = r.json()["id"]
    assert c.get(f"/models/{mid}", headers={"X-API-Key": read}).status_code == 200
    assert c.get(f"/models/{mid}", headers={"X-API-Key": write}).status_code == 200
    bad = c.get(f"/models/{mid}", headers={"Authorization": f"Bearer {read}x"})
    assert bad.status_code == 401
    # Liveness and offline verification stay public.
    assert c.get("/healthz").status_code == 200
    assert c.get("/certificates/public-key").status_code == 200


def test_keys_stored_hashed_and_revocable(auth_client: TestClient) -> None:
    c = auth_client
    key = _key(c, "read")
    rt = c.app.state.runtime  # type: ignore[attr-defined]
    with rt.sessions() as s:
        rows = s.scalars(select(ApiKey)).all()
        assert all(key not in (r.key_hash, r.prefix) for r in rows)
        row = next(r for r in rows if r.key_hash == hash_key(key))
        prefix = row.prefix
    assert c.get("/models", headers={"X-API-Key": key}).status_code == 200
    with transaction(rt.sessions) as s:
        from service.auth import revoke_key

        assert revoke_key(s, prefix)
    assert c.get("/models", headers={"X-API-Key": key}).status_code == 401


def test_cli_keys_create_works_with_the_server(tmp_path: object, monkeypatch: pytest.MonkeyPatch,
                                               sqlite_migrated: str,
                                               make_settings: Callable[..., Settings]) -> None:
    monkeypatch.setenv("LSA_DATABASE_URL", sqlite_migrated)
    runner = CliRunner()
    r = runner.invoke(cli_app, ["keys", "create", "--scope", "write", "--name", "ci"])
    assert r.exit_code == 0, r.output
    key = r.stdout.strip().splitlines()[0]
    assert key.startswith("lsa_")
    bad = runner.invoke(cli_app, ["keys", "create", "--scope", "admin"])
    assert bad.exit_code == 2
    listed = runner.invoke(cli_app, ["keys", "list"])
    assert key.split("_")[1] in listed.stdout and key not in listed.stdout
    app = create_app(make_settings(sqlite_migrated, auth_required=True))
    with TestClient(app) as c:
        files = {"file": ("m.safetensors", tiny_model_bytes(seed=12))}
        assert c.post("/models", files=files,
                      headers={"Authorization": f"Bearer {key}"}).status_code in (200, 201)
