"""Bound computations off the request threads: a fixed set of compute threads fed by a
bounded queue. Identical requests in flight share one computation. When the queue is full the
request gets 503 with Retry-After at once (honest back-pressure, never a dropped connection).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .errors import ServiceUnavailable


class ComputeBusy(ServiceUnavailable):
    error = "busy"


class ComputePool:
    def __init__(self, threads: int, limit: int, retry_after_s: int = 2) -> None:
        self.threads = threads
        self.limit = limit
        self.retry_after_s = retry_after_s
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="lsa-compute")
        self._lock = threading.Lock()
        self._inflight: dict[str, Future[Any]] = {}

    @property
    def pending(self) -> int:
        """Computations running or waiting."""
        with self._lock:
            return len(self._inflight)

    def submit(self, key: str, fn: Callable[[], Any]) -> Future[Any]:
        """The computation of `key`: the one in flight, or `fn` queued. Raises ComputeBusy
        when `limit` computations are already running or waiting."""
        with self._lock:
            running = self._inflight.get(key)
            if running is not None:
                return running
            if len(self._inflight) >= self.limit:
                raise ComputeBusy(
                    f"{self.limit} bound computations are running or waiting "
                    "(LSA_COMPUTE_QUEUE_LIMIT): retry after the Retry-After seconds",
                    headers={"Retry-After": str(self.retry_after_s)})
            future = self._executor.submit(fn)
            self._inflight[key] = future
        future.add_done_callback(lambda _f: self._forget(key, future))
        return future

    def _forget(self, key: str, future: Future[Any]) -> None:
        with self._lock:
            if self._inflight.get(key) is future:
                del self._inflight[key]

    async def run(self, key: str, fn: Callable[[], Any]) -> Any:
        """Await the computation of `key` without holding a thread. A client that goes away
        does not cancel it: others may be waiting for the same key."""
        return await asyncio.shield(asyncio.wrap_future(self.submit(key, fn)))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
