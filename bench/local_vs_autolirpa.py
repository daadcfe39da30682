"""Local Lipschitz constants and robustness radii on the three issue-15 classifiers (an MLP,
1- and 2-layer pre-norm Transformers, D=16, N=8, exported to ONNX): lsa's local engine against
the in-ball float64 lower bound (projected Jacobian ascent), and auto_LiRPA's CROWN radius as
the baseline when its separate venv exists (skipped, saying why, otherwise). One run, one
thread; writes bench/out/local_vs_autolirpa.json and .png and prints the JSON.

    .venv/bin/python bench/local_vs_autolirpa.py [--kinds mlp tf1 tf2] [--alirpa-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.local_models import KINDS, build, center, export  # noqa: E402
from lsa_models.empirical.local import local_lower_bound  # noqa: E402
from lsa_models.engine.local import certify_local, robustness  # noqa: E402
from lsa_models.onnx import load_onnx  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
ALIRPA_PYTHON = Path("/work/alirpa-venv/bin/python")
EPS = (1e-3, 1e-2, 1e-1)


def _alirpa(python: Path, kind: str, seed: int, x0: Path, label: int) -> dict[str, Any]:
    if not python.is_file():
        return {"skipped": f"no auto_LiRPA venv at {python} (see docs/local-bounds.md, "
                           "'Benchmark'): baseline not run"}
    runner = Path(__file__).resolve().parent / "alirpa_runner.py"
    try:
        res = subprocess.run([str(python), str(runner), kind, str(seed), str(x0), str(label)],
                             capture_output=True, text=True, timeout=900,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 900 s"}
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        return {"error": (res.stderr or res.stdout).strip()[-300:]}
    out: dict[str, Any] = json.loads(lines[-1])
    out["jacobian"] = ("not run: auto_LiRPA's Jacobian mode refuses these models as written "
                       "(ReduceMean, Sqrt, Softmax, MatMul of two inputs)")
    return out


def run_kind(kind: str, seed: int, tmp: Path, alirpa_python: Path) -> dict[str, Any]:
    model = build(kind, seed)
    om = load_onnx(export(model, tmp / f"{kind}.onnx").read_bytes())
    x0 = center(seed + 1).numpy().astype(np.float64)
    f64 = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        label = int(f64(torch.from_numpy(x0)).argmax())
    rows = []
    for norm in ("2", "inf"):
        for eps in EPS:
            t0 = time.monotonic()
            res = certify_local(om, x0, eps, norm)  # type: ignore[arg-type]
            t1 = time.monotonic()
            lb = local_lower_bound(f64, x0, eps, norm, restarts=3, steps=15, seed=seed)
            up = res.upper
            rows.append({"norm": norm, "eps": eps, "upper": up, "lower": lb.lower,
                         "ratio": None if up is None else up / lb.lower,
                         "sound": up is None or up >= lb.lower,
                         "upper_seconds": t1 - t0, "lower_seconds": lb.seconds})
            print(json.dumps({"kind": kind, **rows[-1]}), file=sys.stderr)
    radii = {}
    for norm in ("2", "inf"):
        r = robustness(om, x0, label, norm)  # type: ignore[arg-type]
        radii[norm] = {"certified": r.certified_radius, "attack": r.attack_radius,
                       "ratio": (r.certified_radius / r.attack_radius) if r.attack_radius
                       else None, "certify_seconds": r.certify_seconds,
                       "attack_seconds": r.attack_seconds}
    np.save(tmp / f"{kind}_x0.npy", x0.astype(np.float32))
    base = _alirpa(alirpa_python, kind, seed, tmp / f"{kind}_x0.npy", label)
    if "crown_linf_radius" in base and radii["inf"]["attack"]:
        base["ratio_to_attack"] = base["crown_linf_radius"] / radii["inf"]["attack"]
    return {"kind": kind, "label": label, "local": rows, "radii": radii, "auto_lirpa": base}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, norm in zip(axes, ("2", "inf"), strict=True):
        for r in results:
            rows = [x for x in r["local"] if x["norm"] == norm and x["ratio"]]
            ax.plot([x["eps"] for x in rows], [x["ratio"] for x in rows], "o-", label=r["kind"])
        ax.axhline(1.5, ls="--", c="grey")
        ax.set(xscale="log", yscale="log", xlabel="eps", ylabel="upper / lower",
               title=f"lsa local constant, {norm}-norm ball")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", nargs="+", default=list(KINDS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--alirpa-python", type=Path, default=ALIRPA_PYTHON)
    args = ap.parse_args()
    torch.set_num_threads(1)
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_kind(k, args.seed, Path(tmp), args.alirpa_python) for k in args.kinds]
    doc = {"models": results, "eps": list(EPS)}
    (OUT / "local_vs_autolirpa.json").write_text(json.dumps(doc, indent=1))
    plot(results, OUT / "local_vs_autolirpa.png")
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
