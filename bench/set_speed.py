"""Deciding a set of inputs at a radius (`lsa robustness --inputs --labels --radius`) faster:
the baseline (one process, every step of `at_radius.decide`) against `--workers N` (N forked
processes) and `--no-sweep` (no radius sweep on the inputs the affine walks and the attack
leave undecided), in one run on the same inputs: seconds, speed-up, and whether every verdict
matches the baseline's (workers: all must; no-sweep: all but the sweep's, which become
unknown). The classifiers of bench/local_models.py, labels their own predictions.
Writes bench/out/set_speed.json and .png.

    .venv/bin/python bench/set_speed.py [--kinds mlp tf1 tf2] [--inputs 20] [--workers 2]
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

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.certified_accuracy import RADII  # noqa: E402
from bench.local_models import build, center, export  # noqa: E402
from lsa_models.engine.routes.at_radius import SetReport  # noqa: E402
from lsa_models.onnx import load_onnx  # noqa: E402
from service.robustness.set_pool import decide_all  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def _statuses(rep: SetReport) -> list[str]:
    return [v.status for v in rep.verdicts]


def run_case(om: Any, xs: np.ndarray, ys: np.ndarray, norm: str, radius: float,
             workers: int) -> dict[str, Any]:
    runs: dict[str, SetReport] = {}
    seconds: dict[str, float] = {}
    for name, kw in (("baseline", {}), (f"workers={workers}", {"workers": workers}),
                     ("no-sweep", {"sweep": False})):
        t0 = time.monotonic()
        runs[name] = decide_all(om, xs, ys, norm, radius, **kw)
        seconds[name] = time.monotonic() - t0
    base = runs["baseline"]
    swept = [v.certified_by == "sweep" for v in base.verdicts]
    fast = runs["no-sweep"]
    return {
        "norm": norm, "radius": radius, "n": len(ys),
        "statuses": {s: base.count(s) for s in ("certified", "attacked", "unknown",
                                                "misclassified")},
        "certified_by_sweep": int(sum(swept)),
        "seconds": {k: round(t, 3) for k, t in seconds.items()},
        "speedup": {k: round(seconds["baseline"] / t, 3) for k, t in seconds.items()},
        "workers_same": _statuses(runs[f"workers={workers}"]) == _statuses(base),
        "no_sweep_same_but_sweep": all(
            b == ("unknown" if s else a)
            for a, b, s in zip(_statuses(base), _statuses(fast), swept, strict=True)),
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows[0]["seconds"])
    labels = [f"{r['kind']} {r['norm']} {r['radius']:g}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        ax.bar(np.arange(len(rows)) + k * width, [r["seconds"][name] for r in rows], width,
               label=name)
    ax.set_xticks(np.arange(len(rows)) + 0.4 - width / 2, labels, rotation=45, ha="right",
                  fontsize=7)
    ax.set_ylabel(f"seconds for {rows[0]['n']} inputs")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=["mlp", "tf1", "tf2"])
    ap.add_argument("--inputs", type=int, default=20)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds:
            net = build(kind, seed=0)
            om = load_onnx(export(net, Path(tmp) / f"{kind}.onnx").read_bytes())
            xs = np.stack([center(s).numpy()[0] for s in range(1, args.inputs + 1)]
                          ).astype(np.float64)
            f64 = om.module.with_dtype(torch.float64)
            with torch.no_grad():
                ys = np.array([int(f64(torch.from_numpy(x[None])).argmax()) for x in xs])
            for norm, radius in [(n, r) for n, rs in RADII[kind].items() for r in rs]:
                row = {"kind": kind, **run_case(om, xs, ys, norm, radius, args.workers)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    result = {"workers": args.workers, "cpus": os.cpu_count(), "rows": rows}
    (OUT / "set_speed.json").write_text(json.dumps(result, indent=2))
    plot(rows, OUT / "set_speed.png")


if __name__ == "__main__":
    main()
