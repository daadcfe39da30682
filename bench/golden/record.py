"""Record the golden corpus (corpus.py) with the lsa_models on the path: every global bound,
local constant, certified radius and set verdict, each with the routes the engine ran (their
numbers and seconds, instrument.py) and a float64 bound on the other side (a Jacobian norm
below a Lipschitz constant; the attack radius above a certified radius). One process, one
thread. Writes bench/out/golden/<label>.json after every case.

    .venv/bin/python -m bench.golden.record --label head [--groups classifiers zoo ...]
        [--only tf1 ...] [--models DIR] [--out DIR] [--prepare]

To record another revision, run this file from this tree with that revision first on the path
(its models are the frozen ones under --models, so both records bound the same bytes):

    PYTHONPATH=/path/to/other/worktree:. .venv/bin/python -m bench.golden.record --label base
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from bench.golden.corpus import (  # noqa: E402
    DEFAULT_GROUPS,
    GROUPS,
    LOCAL_EPS,
    MODELS,
    OUT,
    Case,
    Frozen,
    corpus,
    materialise,
)
from bench.golden.instrument import FORCEABLE, Recorder  # noqa: E402

LOWER_RESTARTS, LOWER_STEPS = 1, 4  # the in-ball ascent of the local lower bound


def revision() -> dict[str, Any]:
    """Where lsa_models comes from: its file, the git commit of its tree, uncommitted edits."""
    import lsa_models

    src = Path(lsa_models.__file__).resolve().parent
    out: dict[str, Any] = {"lsa_models": str(src)}
    try:
        out["commit"] = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"],
                                       capture_output=True, text=True, check=True
                                       ).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "."],
                               capture_output=True, text=True, check=True).stdout
        out["uncommitted_files"] = len(dirty.splitlines())
    except (OSError, subprocess.CalledProcessError):
        out["commit"] = None
    return out


def _timed(fn: Callable[[], Any]) -> tuple[Any, str | None, float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        out, err = fn(), None
    except Exception as exc:  # a task that fails is a result: compared as a lost verdict
        out, err = None, f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
    return out, err, time.perf_counter() - t0, time.process_time() - c0


def _item(case: Case, task: str, norm: str, kind: str, **kw: Any) -> dict[str, Any]:
    return {"id": f"{case.name}/{task}/{norm}", "case": case.name, "group": case.group,
            "task": task, "norm": norm, "kind": kind, **kw}


def _routed(fn: Callable[[], Any], rec: Recorder) -> tuple[Any, str | None, float, float]:
    with rec.patched():
        return _timed(fn)


def _finite(v: Any) -> float | None:
    return float(v) if v is not None and np.isfinite(float(v)) else None


def global_item(case: Case, frozen: Frozen, om: Any, norm: str, lower: float | None
                ) -> dict[str, Any]:
    from lsa_models.onnx import analyse

    res, err, s, c = _timed(lambda: analyse(om, norm))  # type: ignore[arg-type]
    verdict = "refused" if err else res.verdict
    return _item(case, "global", norm, "upper", value=None if err else _finite(res.upper),
                 verdict=verdict, lower=lower, seq_len=None if err else res.seq_len,
                 seconds=s, cpu_seconds=c, error=err, routes=[])


def _local_lower(om: Any, x0: np.ndarray, norm: str) -> tuple[float | None, float]:
    from lsa_models.empirical.local import local_lower_bound

    t0 = time.perf_counter()
    try:
        f64 = om.module.with_dtype(torch.float64)
        lb = local_lower_bound(f64, x0 if x0.ndim == 3 else x0[None], LOCAL_EPS, norm,
                               restarts=LOWER_RESTARTS, steps=LOWER_STEPS)
        return float(lb.lower), time.perf_counter() - t0
    except (ValueError, RuntimeError, NotImplementedError):
        return None, time.perf_counter() - t0


def local_item(case: Case, frozen: Frozen, om: Any, norm: str, force: bool
               ) -> dict[str, Any]:
    from lsa_models.engine.routes.certify import certify_local

    x0 = frozen.inputs[0]
    rec = Recorder()
    res, err, s, c = _routed(lambda: certify_local(om, x0, LOCAL_EPS, norm), rec)  # type: ignore[arg-type]
    ran = {k.route for k in rec.calls}
    if force and err is None and norm == "inf":
        try:
            from lsa_models.engine.drivers.centre import check_center

            x = check_center(om, x0)
            for route in FORCEABLE:
                if route not in ran:
                    rec.force(route, om, x, LOCAL_EPS, norm)
        except (ImportError, ValueError):
            pass
    lower, lower_s = _local_lower(om, x0, norm)
    return _item(case, "local", norm, "upper", eps=LOCAL_EPS,
                 value=None if err else _finite(res.upper),
                 verdict="refused" if err else res.verdict, lower=lower, lower_seconds=lower_s,
                 method=None if err else res.method, seconds=s, cpu_seconds=c, error=err,
                 routes=[k.row() for k in rec.calls])


def radius_item(case: Case, frozen: Frozen, om: Any, norm: str) -> dict[str, Any]:
    from lsa_models.engine.routes.certify import robustness

    rec = Recorder()
    x0, label = frozen.inputs[0], frozen.labels[0]
    res, err, s, c = _routed(lambda: robustness(
        om, x0, label, norm, attack_restarts=case.attack_restarts), rec)  # type: ignore[arg-type]
    value = None if err else _finite(res.certified_radius)
    return _item(case, "radius", norm, "radius", label=label, value=value,
                 verdict="refused" if err else ("certified" if value else "zero"),
                 upper=None if err else _finite(res.attack_radius),
                 certified_by=None if err else res.certified_by, seconds=s, cpu_seconds=c,
                 certify_seconds=None if err else res.certify_seconds,
                 attack_seconds=None if err else res.attack_seconds, error=err,
                 routes=[k.row() for k in rec.calls])


def set_item(case: Case, frozen: Frozen, om: Any, norm: str) -> dict[str, Any]:
    from lsa_models.engine.routes.at_radius import decide_all

    rec = Recorder()
    radius = float(frozen.meta["set_radius"][norm])
    labels = np.asarray(frozen.labels, dtype=np.int64)
    res, err, s, c = _routed(lambda: decide_all(om, frozen.inputs, labels, norm, radius), rec)
    verdicts = [] if err else [{"status": v.status, "certified_by": v.certified_by,
                                "margin_lower": _finite(v.margin_lower),
                                "seconds": v.seconds} for v in res.verdicts]
    return _item(case, "set", norm, "set", radius=radius, labels=frozen.labels,
                 verdicts=verdicts, value=sum(v["status"] == "certified" for v in verdicts),
                 verdict="refused" if err else "decided", seconds=s, cpu_seconds=c,
                 error=err, routes=[k.row() for k in rec.calls])


def run_case(case: Case, models: Path, force: bool) -> list[dict[str, Any]]:
    from lsa_models.onnx import load_onnx

    frozen = materialise(case, models)
    om = load_onnx(frozen.onnx, "model.onnx")
    items: list[dict[str, Any]] = []
    for norm in case.norms:
        row: list[dict[str, Any]] = []
        if case.local:
            row.append(local_item(case, frozen, om, norm, force))
        lower = case.lower(norm) if case.lower is not None else \
            (row[0]["lower"] if row else None)
        row.insert(0, global_item(case, frozen, om, norm, lower))
        if case.radius:
            row.append(radius_item(case, frozen, om, norm))
        if case.set:
            row.append(set_item(case, frozen, om, norm))
        for it in row:
            it["model_sha256"] = frozen.sha256
        items += row
    return items


def _line(it: dict[str, Any]) -> str:
    v = it.get("value")
    vs = "-" if v is None else f"{v:.6g}"
    by = it.get("certified_by") or ""
    return (f"{it['id']:70s} {it['verdict'] or '':14s} {vs:>12s} {by:12s} "
            f"{it['seconds']:7.2f} s" + (f"  [{it['error'][:60]}]" if it.get("error") else ""))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="head")
    ap.add_argument("--groups", nargs="*", choices=sorted(GROUPS), default=list(DEFAULT_GROUPS))
    ap.add_argument("--only", nargs="*", default=None, help="substrings of case names")
    ap.add_argument("--models", type=Path, default=MODELS, help="the frozen models")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--prepare", action="store_true",
                    help="only build and freeze the models that are missing")
    ap.add_argument("--append", action="store_true",
                    help="add to an existing record: skip its cases, add to its seconds")
    ap.add_argument("--no-force", action="store_true",
                    help="do not run the local constant's skipped optional routes")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cases = [c for c in corpus(tuple(args.groups))
             if not args.only or any(o in c.name for o in args.only)]
    if args.prepare:
        for c in cases:
            t0 = time.perf_counter()
            materialise(c, args.models)
            print(f"{c.name}: {time.perf_counter() - t0:.1f} s", flush=True)
        return {}
    args.out.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"label": args.label, "revision": revision(),
                           "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                           "eps": LOCAL_EPS, "items": []}
    path = args.out / f"{args.label}.json"
    if args.append and path.is_file():
        doc = json.loads(path.read_text())
    done = {it["case"] for it in doc["items"]}
    wall0, cpu0 = doc.get("wall_seconds", 0.0), doc.get("cpu_seconds", 0.0)
    t0, c0 = time.perf_counter(), time.process_time()
    for case in cases:
        if case.name in done:
            continue
        t1, c1 = time.perf_counter(), time.process_time()
        materialise(case, args.models)  # frozen models: outside the corpus' seconds
        t0, c0 = t0 + time.perf_counter() - t1, c0 + time.process_time() - c1
        for it in run_case(case, args.models, not args.no_force):
            doc["items"].append(it)
            print(_line(it), flush=True)
        doc["wall_seconds"] = wall0 + time.perf_counter() - t0
        doc["cpu_seconds"] = cpu0 + time.process_time() - c0
        path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(doc['items'])} items, {doc.get('wall_seconds', 0):.1f} s wall, "
          f"{doc.get('cpu_seconds', 0):.1f} s cpu -> {path}")
    return doc


if __name__ == "__main__":
    main()
