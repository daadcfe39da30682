"""The API under concurrent load, over loopback: throughput, p50 and p99 of `POST /bound` at
concurrency 1, 50 and 200, cached (the stored answer) and uncached (distinct requests, each a
computation), on SQLite and on PostgreSQL, with `GET /healthz` measured in the same run as the
baseline (the server's floor: routing, JSON, the event loop, no database).

Each database gets a real `lsa serve` process (uvicorn, in-process worker) on 127.0.0.1;
requests come from an asyncio httpx client in this process with `concurrency` connections.
On a small machine that client competes with the server for the cores, and at 200
connections its own cost dominates (2 cores: GET /models/{id} at c=200 78 rps
through httpx, 395 rps through a raw asyncio HTTP/1.1 keep-alive client; c=20 312 vs 503):
read the cells against the same run's /healthz cells, which carry the same client cost.
Bounded: `--requests` per cached/healthz cell, uncached cells use exactly `concurrency`
distinct requests (1, 50, 200; plus 60 at once), every request has a timeout, and
the whole run stops at `--max-seconds`. Also reports every status code seen (the claim under
test: all 200, no 5xx, no dropped connection) and that the server is healthy after.

    .venv/bin/python bench/api_load.py [--postgres URL] [--requests 400]

PostgreSQL: `--postgres` or LSA_TEST_POSTGRES_URL (a fresh schema, dropped after); skipped
when neither is set. Prints one JSON object; writes bench/out/api_load.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import torch
from sqlalchemy import create_engine, text

from lsa_models import Transformer, TransformerConfig, to_bytes

OUT = Path(__file__).resolve().parent / "out"
LSA = str(Path(sys.executable).parent / "lsa")
CONCURRENCY = (1, 50, 200)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def model_bytes(seed: int) -> bytes:
    torch.manual_seed(seed)
    return to_bytes(Transformer(TransformerConfig(d_model=16, n_heads=2, n_layers=2, d_ff=32)))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def fire(base: str, requests: list[tuple[str, str, Any]], concurrency: int,
               timeout_s: float) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    statuses: Counter[str] = Counter()
    latencies: list[float] = []
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout_s) as client:

        async def one(method: str, path: str, body: Any) -> None:
            async with gate:
                start = time.perf_counter()
                try:
                    r = await client.request(method, path, json=body)
                except httpx.HTTPError as exc:
                    statuses[f"error:{type(exc).__name__}"] += 1
                    return
                latencies.append(time.perf_counter() - start)
                statuses[str(r.status_code)] += 1

        start = time.perf_counter()
        await asyncio.gather(*(one(*r) for r in requests))
        wall = time.perf_counter() - start
    return {"concurrency": concurrency, "requests": len(requests), "wall_s": round(wall, 4),
            "throughput_rps": round(len(requests) / wall, 1),
            "p50_ms": round(1000 * statistics.median(latencies), 2) if latencies else None,
            "p99_ms": round(1000 * percentile(latencies, 0.99), 2) if latencies else None,
            "statuses": dict(statuses)}


class Server:
    def __init__(self, database_url: str, workdir: Path,
                 settings: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("LSA_")}
        env.update(LSA_DATABASE_URL=database_url, LSA_ARTIFACT_DIR=str(workdir / "artifacts"),
                   LSA_SIGNING_KEY_PATH=str(workdir / "key.pem"), LSA_MIGRATE_ON_START="true",
                   OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        env.update(settings or {})  # more LSA_* settings
        self.log = workdir / "serve.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [LSA, "serve", "--port", str(self.port), "--log-level", "warning"], env=env,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lsa serve exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.base}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("lsa serve did not start")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)


def run_database(name: str, url: str, args: argparse.Namespace, workdir: Path,
                 deadline: float) -> dict[str, Any]:
    server = Server(url, workdir)
    try:
        http = httpx.Client(base_url=server.base, timeout=60)
        models = [http.post("/models", files={"file": (f"m{i}.safetensors", model_bytes(i))})
                  .json()["id"] for i in range(10)]
        cached = {"model_id": models[0], "norm": "2", "seq_len": 16}
        assert http.post("/bound", json=cached).status_code == 200
        # Distinct requests: model x norm x N, never asked before (a fresh server database).
        fresh = iter({"model_id": m, "norm": norm, "seq_len": n} for n in range(2, 100)
                     for m in models for norm in ("2", "inf"))
        cells: list[dict[str, Any]] = []
        for concurrency in (*CONCURRENCY, 60):
            if time.monotonic() > deadline:
                break
            kinds: list[tuple[str, list[tuple[str, str, Any]]]] = [
                ("uncached", [("POST", "/bound", next(fresh)) for _ in range(concurrency)])]
            if concurrency in CONCURRENCY:
                kinds = [("healthz", [("GET", "/healthz", None)] * args.requests),
                         ("cached", [("POST", "/bound", cached)] * args.requests), *kinds]
            for kind, requests in kinds:
                cell = asyncio.run(fire(server.base, requests, concurrency, args.timeout))
                cells.append({"database": name, "kind": kind, **cell})
                print(json.dumps(cells[-1]), file=sys.stderr)
        healthy = (http.get("/healthz").status_code == 200
                   and http.get("/readyz").status_code == 200)
        http.close()
        return {"database": name, "cells": cells, "healthy_after": healthy,
                "server_log_errors": server.log.read_text().count("Traceback")}
    finally:
        server.close()


def new_pg_schema(base: str) -> tuple[str, str]:
    name = f"lsa_bench_{uuid.uuid4().hex[:10]}"
    engine = create_engine(base, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{name}"'))
    engine.dispose()
    sep = "&" if "?" in base else "?"
    return name, f"{base}{sep}options=-csearch_path%3D{name}"


def drop_pg_schema(base: str, name: str) -> None:
    engine = create_engine(base, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
    engine.dispose()


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"healthz": ":", "cached": "-", "uncached": "--"}
    markers = {"healthz": "x", "cached": "o", "uncached": "s"}
    colors = {"sqlite": "tab:blue", "postgresql": "tab:red"}
    for run in result["runs"]:
        for kind, style in styles.items():
            cells = [c for c in run["cells"] if c["kind"] == kind
                     and c["concurrency"] in CONCURRENCY]
            if not cells:
                continue
            xs = [c["concurrency"] for c in cells]
            label = f"{run['database']} {kind}"
            look = {"linestyle": style, "marker": markers[kind],
                    "color": colors.get(run["database"], "k"), "label": label}
            axes[0].plot(xs, [c["throughput_rps"] for c in cells], **look)
            axes[1].plot(xs, [c["p99_ms"] for c in cells], **look)
    for ax, title in zip(axes, ("throughput (req/s)", "p99 latency (ms)"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.legend(fontsize=7)
    axes[1].set_yscale("log")
    fig.suptitle("lsa API over loopback: POST /bound vs GET /healthz (same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400,
                        help="requests per cached / healthz cell")
    parser.add_argument("--postgres", default=os.environ.get("LSA_TEST_POSTGRES_URL"))
    parser.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    parser.add_argument("--max-seconds", type=float, default=900.0, help="whole run")
    args = parser.parse_args()
    deadline = time.monotonic() + args.max_seconds
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "sqlite").mkdir()
        runs.append(run_database("sqlite", f"sqlite:///{work / 'sqlite' / 'lsa.db'}", args,
                                 work / "sqlite", deadline))
        if args.postgres:
            schema, url = new_pg_schema(args.postgres)
            (work / "pg").mkdir()
            try:
                runs.append(run_database("postgresql", url, args, work / "pg", deadline))
            finally:
                drop_pg_schema(args.postgres, schema)
    summary = {}
    for run in runs:
        by = {(c["kind"], c["concurrency"]): c for c in run["cells"]}
        health, cached = by.get(("healthz", 50)), by.get(("cached", 50))
        if health and cached:
            summary[run["database"]] = {
                "cached_over_healthz_at_50": round(
                    cached["throughput_rps"] / health["throughput_rps"], 3),
                "all_200": all(set(c["statuses"]) == {"200"} for c in run["cells"])}
    result = {"bench": "api_load", "cpus": os.cpu_count(), "requests": args.requests,
              "runs": runs, "summary": summary}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "api_load.json").write_text(json.dumps(result, indent=2))
    plot(result, OUT / "api_load.png")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
