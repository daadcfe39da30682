"""The OpenAPI UIs work with no internet: headless Chromium (Debian's `chromium`; `.ci/run`
installs it) opens /docs and /redoc with every host but the loopback unresolvable, and finds
the operations rendered. A screenshot of /docs goes to var/screenshots/docs.png."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.settings import Settings

from .serving import serve

REPO = Path(__file__).resolve().parents[2]
SCREENSHOT = REPO / "var" / "screenshots" / "docs.png"
# No name resolves except the loopback: a page that needs a CDN stays blank here.
OFFLINE = "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no headless browser: install Chromium (`apt-get install -y chromium`; "
                ".ci/run does) to check that /docs renders offline")


def browse(url: str, tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-dev-shm-usage", f"--user-data-dir={tmp / 'profile'}", OFFLINE,
         "--virtual-time-budget=15000", "--window-size=1280,1800", *extra, url],
        capture_output=True, text=True, timeout=120, check=False)


def test_docs_browser_renders_operations_offline(
        sqlite_migrated: str, make_settings: Callable[..., Settings], tmp_path: Path) -> None:
    app = create_app(make_settings(sqlite_migrated))
    with TestClient(app), serve(app) as base:
        swagger = browse(f"{base}/docs", tmp_path, "--dump-dom")
        assert swagger.returncode == 0, swagger.stderr[-2000:]
        dom = swagger.stdout
        # Swagger UI draws one "opblock" per operation, with its path.
        assert dom.count('class="opblock opblock-') >= 10, dom[-2000:]
        for path in ("/models", "/bound", "/certify", "/jobs/{job_id}"):
            assert f'data-path="{path}"' in dom, path
        redoc = browse(f"{base}/redoc", tmp_path, "--dump-dom")
        assert redoc.returncode == 0, redoc.stderr[-2000:]
        assert "A bound of one" in redoc.stdout  # POST /bound's summary
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shot = browse(f"{base}/docs", tmp_path, f"--screenshot={SCREENSHOT}")
        assert shot.returncode == 0 and SCREENSHOT.stat().st_size > 10_000, shot.stderr[-2000:]


def test_docs_browser_serves_assets_from_the_app(
        sqlite_migrated: str, make_settings: Callable[..., Settings]) -> None:
    app = create_app(make_settings(sqlite_migrated))
    with TestClient(app) as c:
        page = c.get("/docs").text
        assert "cdn" not in page.lower() and "/docs-static/swagger-ui-bundle.js" in page
        assert "fonts.googleapis" not in c.get("/redoc").text
        for asset in ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js"):
            r = c.get(f"/docs-static/{asset}")
            assert r.status_code == 200 and len(r.content) > 100_000, asset
