"""A real uvicorn server on a loopback port, in a thread of the test process (real sockets,
real concurrency), and a concurrent HTTP client."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(app: FastAPI, *, backlog: int = 2048) -> Iterator[str]:
    """Run `app` on 127.0.0.1; yields its base URL."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            backlog=backlog, timeout_keep_alive=30)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@dataclass
class Outcome:
    """What `fire` saw: status codes (0 for a dropped or failed connection) and latencies."""

    statuses: list[int] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    retry_after: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def count(self, status: int) -> int:
        return sum(1 for s in self.statuses if s == status)


async def _fire(base: str, requests: list[tuple[str, str, Any]], concurrency: int,
                timeout_s: float) -> Outcome:
    out = Outcome()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout_s) as client:

        async def one(method: str, path: str, body: Any) -> None:
            async with gate:
                start = time.perf_counter()
                try:
                    r = await client.request(method, path, json=body)
                except httpx.HTTPError as exc:
                    out.statuses.append(0)
                    out.errors.append(f"{type(exc).__name__}: {exc}")
                    return
                out.latencies_s.append(time.perf_counter() - start)
                out.statuses.append(r.status_code)
                if r.status_code >= 500:
                    out.errors.append(r.text[:300])
                if "retry-after" in r.headers:
                    out.retry_after.append(r.headers["retry-after"])

        start = time.perf_counter()
        await asyncio.gather(*(one(m, p, b) for m, p, b in requests))
        out.wall_s = time.perf_counter() - start
    return out


def fire(base: str, requests: list[tuple[str, str, Any]], concurrency: int,
         timeout_s: float = 120.0) -> Outcome:
    """Send `requests` with at most `concurrency` in flight (one connection each)."""
    return asyncio.run(_fire(base, requests, concurrency, timeout_s))
