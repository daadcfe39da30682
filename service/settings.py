"""The service's one settings class. Every field reads `LSA_<NAME>` from the environment.

Bad values fail at start-up with the variable named, never later in a request.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1024 * 1024
PositiveInt = Annotated[int, Field(gt=0)]
PositiveSeconds = Annotated[float, Field(gt=0)]
# a set job's processes by default: each holds the model and the engine's working memory
# (gigabytes on a 12-layer D=768 encoder), so not one per CPU of a large machine unasked
DEFAULT_SET_WORKERS = 4


def cgroup_cpus(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The CPU quota of this process's cgroup, rounded up (a container run with `--cpus 2`
    sees every CPU of its host in its affinity mask but gets two CPUs' time); None when
    there is no quota or it cannot be read. cgroup v2 `cpu.max` ("200000 100000"), else v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`."""
    try:
        v2 = root / "cpu.max"
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]
        else:
            v1 = next((root / d for d in ("cpu", "cpu,cpuacct") if (root / d).is_dir()), None)
            if v1 is None:
                return None
            quota = (v1 / "cpu.cfs_quota_us").read_text().strip()
            period = (v1 / "cpu.cfs_period_us").read_text().strip()
        if quota in ("max", "-1"):
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, ZeroDivisionError):
        return None


def default_set_workers() -> int:
    """Processes deciding a set's inputs unless told: the CPUs this process may use (its
    affinity mask and its cgroup's quota), at most DEFAULT_SET_WORKERS (the server's
    LSA_SET_WORKERS, `lsa robustness --inputs`'s --workers)."""
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    quota = cgroup_cpus()
    return min(cpus, quota or cpus, DEFAULT_SET_WORKERS)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LSA_", extra="ignore", frozen=True)

    database_url: str = Field(
        default="sqlite:///./var/lsa.db",
        description="SQLAlchemy URL: sqlite:///PATH or postgresql+psycopg://USER@HOST/DB")
    redis_url: str | None = Field(
        default=None,
        description="redis://HOST:PORT/DB; unset: jobs run on a worker thread in the server")
    redis_namespace: str = Field(default="lsa", min_length=1,
                                 description="Key prefix of the job queues in Redis")
    artifact_dir: Path = Field(default=Path("./var/artifacts"),
                               description="Content-addressed store of uploads and outputs")
    max_upload_bytes: PositiveInt = Field(default=512 * MiB,
                                          description="Largest accepted upload (413 above)")
    max_sync_parameters: PositiveInt = Field(
        default=20_000_000,
        description="Largest model (parameter count) bounded inside a request; 422 above")
    max_json_bytes: PositiveInt = Field(
        default=16 * MiB, description="Largest JSON request body, e.g. an input `at` of "
        "POST /bound or /certify (413 above)")
    max_at_elements: PositiveInt = Field(
        default=1_048_576, description="Most numbers an input `at` (N x D) may hold (413 "
        "above)")
    max_empirical_elements: PositiveInt = Field(
        default=4_194_304,
        description="Largest input N x D an empirical (job) search may use; 422 above")
    max_corpus_bytes: PositiveInt = Field(
        default=64 * MiB, description="Largest accepted text corpus upload (413 above)")
    max_training_steps: PositiveInt = Field(
        default=200_000, description="Most optimizer steps a training request may ask for")
    max_training_elements: PositiveInt = Field(
        default=2**31,
        description="Largest training step: batch_size x n_layers x seq_len x (d_model + d_ff"
                    " + n_heads x seq_len), a proxy for the activations kept for backward")
    auth_required: bool = Field(default=False,
                                description="Require API keys (read scope for GET, write else)")
    signing_key_path: Path = Field(default=Path("./var/signing_key.pem"),
                                   description="Ed25519 PEM key; created on first start")
    migrate_on_start: bool | None = Field(
        default=None,
        description="Run migrations at start; unset: only for the embedded SQLite database")
    bound_time_limit_s: PositiveSeconds = Field(default=3600.0,
                                                description="Hard limit of a job on 'bound'")
    training_time_limit_s: PositiveSeconds = Field(
        default=48 * 3600.0, description="Hard limit of a job on 'training'")
    worker_threads: PositiveInt = Field(default=1, description="Jobs run at once per worker")
    request_threads: PositiveInt = Field(
        default=40, description="Threads serving blocking request work (database, uploads); "
                                "the connection pool is sized to them")
    compute_threads: PositiveInt = Field(
        default=2, description="Synchronous bound computations run at once (off the request "
                               "threads)")
    compute_queue_limit: PositiveInt = Field(
        default=256, description="Bound computations running or waiting; past it 503 with "
                                 "Retry-After")
    set_workers: PositiveInt | None = Field(
        default=None, description="Processes deciding the inputs of one certified-accuracy "
        "set (POST /certify with inputs) at once, one torch thread each, each holding the "
        "model; unset: the CPUs this process may use (affinity, cgroup quota), at most 4")
    model_cache_size: PositiveInt = Field(
        default=16, description="Loaded models kept in memory (LRU by sha256)")
    job_stale_after_s: PositiveSeconds = Field(
        default=60.0, description="A running job silent this long is taken to have crashed")

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: str) -> str:
        if not value.startswith(("sqlite://", "postgresql")):
            raise ValueError("LSA_DATABASE_URL must start with sqlite:// or postgresql "
                             f"(e.g. postgresql+psycopg://user@host/db), got {value!r}")
        if value.startswith("postgresql://"):
            # psycopg 3 is the installed driver; plain postgresql:// would ask for psycopg2.
            value = "postgresql+psycopg://" + value.removeprefix("postgresql://")
        return value

    @field_validator("set_workers", mode="before")
    @classmethod
    def _blank_set_workers(cls, value: object) -> object:
        # LSA_SET_WORKERS= (empty, as docker-compose passes an unset variable): the default
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str | None) -> str | None:
        if value in (None, ""):
            return None
        assert value is not None
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"LSA_REDIS_URL must start with redis:// or rediss://, got {value!r}")
        return value

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.startswith("sqlite")

    @property
    def should_migrate_on_start(self) -> bool:
        if self.migrate_on_start is not None:
            return self.migrate_on_start
        return self.is_sqlite

    @property
    def db_pool_size(self) -> int:
        """Every thread that may hold a connection at once, plus the reaper and heartbeats."""
        return self.request_threads + self.compute_threads + 2 * self.worker_threads + 2

    @property
    def set_processes(self) -> int:
        """LSA_SET_WORKERS, or the CPUs this process may use, at most DEFAULT_SET_WORKERS."""
        return default_set_workers() if self.set_workers is None else self.set_workers

    def time_limit_s(self, queue: str) -> float:
        limits = {"bound": self.bound_time_limit_s, "training": self.training_time_limit_s}
        return limits[queue]
