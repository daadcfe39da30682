"""A certified-accuracy set through the server (`POST /certify` with inputs: a `robustness_set`
job), in one run against its own baseline: the same set on a real `lsa serve` process (SQLite,
in-process worker) with LSA_SET_WORKERS=1 (the inputs one after another) and with
LSA_SET_WORKERS=N (worker processes from a forkserver). Per model: the job's seconds (POST to
its end, polled every 0.2 s) for a first set posted as soon as the server is ready and a second
one (radius x1.25) after it, the speed-ups, and whether the statuses are identical. The
classifiers of bench/local_models.py; a fresh server per setting.

    .venv/bin/python bench/set_job_speed.py [--kinds mlp tf1] [--inputs 12] [--workers 2]

Writes bench/out/set_job_speed.json and .png and prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.api_load import Server  # noqa: E402
from bench.local_models import build, center, export  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
CASES = {"mlp": ("inf", 0.05), "tf1": ("inf", 0.03), "tf2": ("2", 0.1)}


def run_job(base: str, model: Path, xs: np.ndarray, ys: list[int], norm: str,
            radius: float) -> dict[str, Any]:
    with httpx.Client(base_url=base, timeout=120) as http:
        r = http.post("/models", files={"file": (model.name, model.read_bytes())})
        r.raise_for_status()
        t0 = time.monotonic()
        r = http.post("/certify", json={"model_id": r.json()["id"], "norm": norm,
                                        "inputs": xs.tolist(), "labels": ys,
                                        "min_radius": radius, "min_certified_accuracy": 0.0})
        if r.status_code != 202:
            raise RuntimeError(f"POST /certify: {r.status_code} {r.text}")
        while True:
            job = http.get(r.json()["url"]).json()
            if job["status"] not in ("queued", "running"):
                break
            time.sleep(0.2)
        seconds = time.monotonic() - t0
    if job["status"] != "succeeded":
        raise RuntimeError(f"job {job['id']}: {job['status']} {job.get('error')}")
    return {"seconds": seconds, "statuses": job["result"]["robustness_set"]["statuses"]}


def plot(rows: list[dict[str, Any]], workers: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['kind']} {r['norm']} {r['radius']:g}" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(rows)), 4))
    bars = [("serial_s", "first set, LSA_SET_WORKERS=1"),
            ("workers_s", f"first set, LSA_SET_WORKERS={workers}"),
            ("second_serial_s", "second set, LSA_SET_WORKERS=1"),
            ("second_workers_s", f"second set, LSA_SET_WORKERS={workers}")]
    for k, (key, label) in enumerate(bars):
        ax.bar(x + (k - 1.5) * 0.2, [r[key] for r in rows], 0.2, label=label)
    ax.set_xticks(x, labels)
    ax.set_ylabel(f"job seconds for {rows[0]['n']} inputs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=["mlp", "tf1"], choices=sorted(CASES))
    ap.add_argument("--inputs", type=int, default=12)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for kind in args.kinds:
            net = build(kind, seed=0)
            model = export(net, root / f"{kind}.onnx")
            xs = np.stack([center(s).numpy()[0] for s in range(1, args.inputs + 1)]
                          ).astype(np.float64)
            with torch.no_grad():
                ys = [int(net.double()(torch.from_numpy(x[None])).argmax()) for x in xs]
            norm, radius = CASES[kind]
            runs = {}
            for workers in (1, args.workers):
                work = root / f"{kind}-{workers}"
                work.mkdir()
                server = Server(f"sqlite:///{work / 'lsa.db'}", work,
                                {"LSA_SET_WORKERS": str(workers)})
                try:
                    runs[workers] = run_job(server.base, model, xs, ys, norm, radius)
                    # a second set on the same server (the model loaded, the forkserver up)
                    runs[-workers] = run_job(server.base, model, xs, ys, norm, radius * 1.25)
                finally:
                    server.close()
            row = {"kind": kind, "norm": norm, "radius": radius, "n": args.inputs,
                   "serial_s": runs[1]["seconds"], "workers_s": runs[args.workers]["seconds"],
                   "speedup": runs[1]["seconds"] / runs[args.workers]["seconds"],
                   "second_serial_s": runs[-1]["seconds"],
                   "second_workers_s": runs[-args.workers]["seconds"],
                   "second_speedup": runs[-1]["seconds"] / runs[-args.workers]["seconds"],
                   "same_statuses": runs[1]["statuses"] == runs[args.workers]["statuses"]
                   and runs[-1]["statuses"] == runs[-args.workers]["statuses"],
                   "statuses": runs[1]["statuses"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    result = {"workers": args.workers, "cpus": os.cpu_count(), "rows": rows}
    (OUT / "set_job_speed.json").write_text(json.dumps(result, indent=2))
    plot(rows, args.workers, OUT / "set_job_speed.png")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
