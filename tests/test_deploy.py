"""docker-compose.yml, Dockerfile, .env.example: structural checks (no Docker engine runs in
CI), plus `docker compose config` where the compose plugin exists."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from service.cli import app
from service.jobs import QUEUES
from service.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
ENV_EXAMPLE = ROOT / ".env.example"
DOCKERIGNORE = ROOT / ".dockerignore"

LSA_SERVICES = ("api", "worker", "worker-gpu")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def env_example(include_commented: bool = False) -> dict[str, str]:
    """NAME=value lines; commented `# LSA_NAME=value` lines too when asked."""
    out: dict[str, str] = {}
    pattern = r"^\s*(?:#\s*)?([A-Z][A-Z0-9_]*)=(.*)$" if include_commented \
        else r"^([A-Z][A-Z0-9_]*)=(.*)$"
    for line in ENV_EXAMPLE.read_text().splitlines():
        m = re.match(pattern, line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's interpolation: ${VAR}, ${VAR:-default} (nested), ${VAR-default}, $$."""
    out: list[str] = []
    i = 0
    while i < len(value):
        if value.startswith("$$", i):
            out.append("$")
            i += 2
        elif value.startswith("${", i):
            depth, j = 1, i + 2
            while depth:
                if value.startswith("${", j):
                    depth, j = depth + 1, j + 2
                    continue
                depth -= value[j] == "}"
                j += 1
            expr = value[i + 2:j - 1]
            m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)(?:(:?-|:?\?)(.*))?$", expr, re.S)
            assert m, f"cannot parse ${{{expr}}}"
            name, op, rest = m.groups()
            current = env.get(name)
            if op in (":-", "-"):
                unset = current is None or (op == ":-" and current == "")
                out.append(interpolate(rest, env) if unset else str(current))
            elif op in (":?", "?"):
                assert current, f"{name} is required: {rest}"
                out.append(current)
            else:
                out.append(current or "")
            i = j
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def variables(value: Any) -> set[str]:
    text = yaml.safe_dump(value)
    return set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", text.replace("$$", "")))


def resolved_env(compose: dict[str, Any], service: str, env: dict[str, str]) -> dict[str, str]:
    raw = compose["services"][service]["environment"]
    assert isinstance(raw, dict), "environment as a mapping"
    return {k: interpolate(str(v), env) for k, v in raw.items()}


def argv(command: Any) -> list[list[str]]:
    """The lsa command lines a service runs (`sh -c "a && exec b"` gives two)."""
    cmd = command if isinstance(command, list) else shlex.split(command)
    if cmd[:2] == ["sh", "-c"]:
        lines = [shlex.split(part) for part in cmd[2].split("&&")]
        return [line[1:] if line[0] == "exec" else line for line in lines]
    return [cmd]


def settings_fields() -> set[str]:
    return {"LSA_" + name.upper() for name in Settings.model_fields}


def test_deploy_compose_has_the_five_services(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {"api", "worker", "worker-gpu", "postgres", "redis"}


def test_deploy_api_migrates_then_serves(compose: dict[str, Any]) -> None:
    api = compose["services"]["api"]
    lines = argv(api["command"])
    assert lines[0][:3] == ["lsa", "db", "upgrade"]
    assert lines[-1][:2] == ["lsa", "serve"]
    serve = lines[-1]
    assert serve[serve.index("--host") + 1] == "0.0.0.0"
    port = serve[serve.index("--port") + 1]
    assert any(str(p).endswith(f":{port}") for p in api["ports"])
    probe = " ".join(api["healthcheck"]["test"])
    assert f"127.0.0.1:{port}/readyz" in probe


def test_deploy_worker_gpu_reserves_an_nvidia_gpu_for_training(compose: dict[str, Any]) -> None:
    gpu = compose["services"]["worker-gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    (line,) = argv(gpu["command"])
    assert line[:2] == ["lsa", "worker"]
    assert line[line.index("--queues") + 1:] == ["training"]
    variant = interpolate(str(gpu["build"]["args"]["TORCH_VARIANT"]), {})
    assert variant.startswith("cu"), "the GPU image needs CUDA torch"
    assert gpu["image"] != compose["services"]["worker"]["image"]


def test_deploy_worker_takes_the_bound_queue_without_a_gpu(compose: dict[str, Any]) -> None:
    worker = compose["services"]["worker"]
    (line,) = argv(worker["command"])
    assert line[:2] == ["lsa", "worker"]
    assert line[line.index("--queues") + 1:] == ["bound"]
    assert "deploy" not in worker
    assert set(QUEUES) == {"bound", "training"}  # every queue has a consumer


def test_deploy_service_commands_exist_in_the_cli(compose: dict[str, Any]) -> None:
    runner = CliRunner()
    for name in LSA_SERVICES:
        for line in argv(compose["services"][name]["command"]):
            assert line[0] == "lsa"
            result = runner.invoke(app, [*line[1:], "--help"])
            assert result.exit_code == 0, (name, line, result.output)


def test_deploy_postgres_and_redis_are_health_checked(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in ("postgres", "redis"):
        assert services[name]["healthcheck"]["test"], name
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    assert "ping" in services["redis"]["healthcheck"]["test"]
    api_deps = services["api"]["depends_on"]
    assert api_deps["postgres"]["condition"] == "service_healthy"
    assert api_deps["redis"]["condition"] == "service_healthy"
    # Workers start after the api has migrated the database (its health check is /readyz).
    for name in ("worker", "worker-gpu"):
        assert services[name]["depends_on"]["api"]["condition"] == "service_healthy"


def test_deploy_artifacts_volume_is_shared(compose: dict[str, Any]) -> None:
    assert "artifacts" in compose["volumes"]
    env = env_example()
    mounts = set()
    for name in LSA_SERVICES:
        (mount,) = [v for v in compose["services"][name]["volumes"]
                    if v.startswith("artifacts:")]
        mounts.add(mount)
        target = mount.split(":")[1]
        resolved = resolved_env(compose, name, env)
        for key in ("LSA_ARTIFACT_DIR", "LSA_SIGNING_KEY_PATH"):
            assert Path(resolved[key]).is_relative_to(target), (name, key)
    assert len(mounts) == 1, "api and workers must see the same artifacts and signing key"


@pytest.mark.parametrize("source", ["no .env", ".env.example"])
def test_deploy_environment_is_valid_settings_with_auth_on(
        compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    env = {} if source == "no .env" else env_example()
    for name in LSA_SERVICES:
        resolved = resolved_env(compose, name, env)
        for key in list(Settings.model_fields):
            monkeypatch.delenv("LSA_" + key.upper(), raising=False)
        for key, value in resolved.items():
            monkeypatch.setenv(key, value)
        settings = Settings()
        assert settings.auth_required is True
        assert settings.database_url.startswith("postgresql+psycopg://")
        assert "@postgres:5432/" in settings.database_url
        assert settings.redis_url == "redis://redis:6379/0"
        assert settings.should_migrate_on_start is False  # the api's command migrates
    # The database URL carries the same credentials the postgres service is created with.
    pg = {k: interpolate(str(v), env)
          for k, v in compose["services"]["postgres"]["environment"].items()}
    url = resolved_env(compose, "api", env)["LSA_DATABASE_URL"]
    assert f"{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}@" in url
    assert url.endswith("/" + pg["POSTGRES_DB"])


def test_deploy_env_example_lists_every_setting() -> None:
    listed = {k for k in env_example(include_commented=True) if k.startswith("LSA_")}
    fields = settings_fields()
    assert fields - listed == set(), "settings missing from .env.example"
    assert listed - fields == set(), ".env.example names settings that do not exist"


def test_deploy_every_setting_reaches_the_containers(compose: dict[str, Any]) -> None:
    for name in LSA_SERVICES:
        env = compose["services"][name]["environment"]
        assert set(env) == settings_fields(), name


def test_deploy_every_compose_variable_is_documented(compose: dict[str, Any]) -> None:
    documented = set(env_example(include_commented=True))
    assert variables(compose) - documented == set()


def test_deploy_dockerfile_builds_cpu_and_cuda_torch() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:", text, re.M)
    assert re.search(r"^ARG TORCH_VARIANT=cpu$", text, re.M)
    assert "whl/${TORCH_VARIANT}" in text
    torch_at = text.index('--index-url "${TORCH_INDEX_URL}"')
    deps_at = text.index('pip install ".[ptb]"')
    assert torch_at < deps_at, "torch must come from the variant's index before the deps"
    assert "pip install --no-deps -e ." in text  # migrations/ is found next to service/
    user = re.findall(r"^USER (\S+)$", text, re.M)
    assert user and user[-1] not in ("root", "0")
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        *sources, _dest = line.split()
        for src in sources:
            assert (ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist"


def test_deploy_dockerignore_keeps_local_state_out() -> None:
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for needed in (".git", ".venv", "var", ".env"):
        assert needed in patterns, needed
    for kept in ("service", "lsa_models", "api_schemas", "migrations", "pyproject.toml"):
        assert kept not in patterns, kept


def _compose_cli() -> list[str] | None:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


@pytest.mark.skipif(_compose_cli() is None, reason="no docker compose CLI on this machine")
def test_deploy_docker_compose_config_accepts_the_file(tmp_path: Path) -> None:
    cli = _compose_cli()
    assert cli is not None
    result = subprocess.run([*cli, "-f", str(COMPOSE), "--project-directory", str(ROOT),
                             "config", "--quiet"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
