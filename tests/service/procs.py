"""Helpers to run `lsa serve` / `lsa worker` as real processes (killed like a crash)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

LSA = str(Path(sys.executable).parent / "lsa")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(args: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    full_env = {**os.environ, **env}
    with open(log, "ab") as out:
        return subprocess.Popen([LSA, *args], env=full_env, cwd=cwd, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL: no shutdown hooks run, as when a machine dies."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            kill(proc)


def wait_http(base: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"server did not start: {log.read_text()[-2000:]}")


def poll_job(get: Any, job_id: str, pred: Any, timeout: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        last = dict(get(f"/jobs/{job_id}").json())
        if pred(last):
            return last
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} never reached the state: {last}")
