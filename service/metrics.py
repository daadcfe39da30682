"""Prometheus metrics, on a registry per app (tests build many apps in one process)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .db import transaction
from .tables import JOB_STATUSES, Job, UploadedModel


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("lsa_http_requests", "HTTP requests by route and status",
                                ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram("lsa_http_request_duration_seconds", "HTTP request latency",
                                 ["method", "route"], registry=self.registry)
        self.bounds = Counter("lsa_bounds_computed", "Analytic bounds computed in requests",
                              registry=self.registry)
        self.certificates = Counter("lsa_certificates_issued", "Certificates signed",
                                    registry=self.registry)
        self.models_loaded = Counter("lsa_models_loaded", "Models parsed (LRU misses)",
                                     registry=self.registry)
        self.rejected = Counter("lsa_compute_rejected", "Bound requests refused with 503: "
                                "the compute queue was full", registry=self.registry)

    def watch_store(self, sessions: sessionmaker[Session]) -> None:
        """Report job and model counts, read from the database on every scrape."""
        self.registry.register(_StoreCollector(sessions))


class _StoreCollector(Collector):
    """Job counts by status and the number of models, read from the database on scrape."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def collect(self) -> Iterator[GaugeMetricFamily]:
        jobs = GaugeMetricFamily("lsa_jobs", "Jobs by status", labels=["status"])
        models = GaugeMetricFamily("lsa_models", "Models stored")
        try:
            with transaction(self.sessions) as s:
                counts = {status: int(n) for status, n in s.execute(
                    select(Job.status, func.count()).group_by(Job.status))}
                n_models = s.scalar(select(func.count()).select_from(UploadedModel)) or 0
        except Exception:
            return
        for status in JOB_STATUSES:
            jobs.add_metric([status], counts.get(status, 0))
        models.add_metric([], n_models)
        yield jobs
        yield models


class MetricsMiddleware:
    """Counts requests by route template (not raw path: ids would explode the label set)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route: Any = scope.get("route")
            label = getattr(route, "path", None) or "<unmatched>"
            self.metrics.requests.labels(scope["method"], label, str(status)).inc()
            self.metrics.latency.labels(scope["method"], label).observe(
                time.perf_counter() - start)
