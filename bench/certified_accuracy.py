"""Certified accuracy at a radius on a set of inputs: lsa (`lsa_models.engine.routes.at_radius`,
what `lsa robustness --inputs --labels --radius` runs) against auto_LiRPA's CROWN (and
alpha-CROWN where it runs: its LayerNorm relaxation asserts on the Transformers) on the same
classifiers (bench/local_models.py: the MLP and the 1- and 2-layer pre-norm Transformers),
inputs and radii, one thread, in one run.

Per (model, norm, radius): how many inputs each tool certifies, how many lsa's PGD flips
(an upper bound on the robust ones), the inputs one tool certifies and the other does not,
and seconds (lsa's split by verdict, and on the inputs the baseline verified: the time to the
same answer). An input certified by either tool and flipped by the attack would be a
soundness failure (`unsound`, must be 0). Labels are the models' own predictions at the
centres (clean accuracy 1). Writes bench/out/certified_accuracy.json and .png.

    .venv/bin/python bench/certified_accuracy.py [--inputs 20] [--kinds mlp tf1 tf2]
        [--alirpa-src /work/.mirror/Verified-Intelligence+auto_LiRPA/repo | --no-alirpa]
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

from bench.local_models import build, center, export  # noqa: E402
from bench.local_vs_autolirpa import ALIRPA, ensure_alirpa  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"

# two radii per model and norm: about CROWN's certified radius at the models' centre and
# about lsa's (bench/local_vs_autolirpa.py: MLP 0.039 / 0.071 inf, 0.37 / 0.66 2-ball; tf1
# 0.043 / 0.068, 0.15 / 0.34; tf2 0.029 / 0.049, 0.11 / 0.24)
RADII: dict[str, dict[str, list[float]]] = {
    "mlp": {"inf": [0.03, 0.06], "2": [0.3, 0.6]},
    "tf1": {"inf": [0.03, 0.06], "2": [0.15, 0.3]},
    "tf2": {"inf": [0.02, 0.04], "2": [0.1, 0.2]},
}
ALPHA_KINDS = ("mlp",)  # alpha-CROWN's LayerNorm relaxation asserts on the Transformers


def _runner(python: Path, kind: str, xs: Path, ys: Path, norm: str, method: str,
            radii: list[float]) -> dict[str, Any]:
    runner = Path(__file__).resolve().parent / "alirpa_runner.py"
    try:
        res = subprocess.run([str(python), str(runner), "--verified", kind, "0", str(xs),
                              str(ys), norm, method, *map(str, radii)], capture_output=True,
                             text=True, timeout=3600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 3600 s"}
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        return {"error": (res.stderr or res.stdout).strip()[-300:]}
    out: dict[str, Any] = json.loads(lines[-1])
    return out


def run_kind(kind: str, n: int, tmp: Path, python: Path | None) -> list[dict[str, Any]]:
    from lsa_models.engine.routes.at_radius import decide_all
    from lsa_models.onnx import load_onnx

    om = load_onnx(export(build(kind, 0), tmp / f"{kind}.onnx").read_bytes())
    xs = np.stack([center(s).numpy().astype(np.float64) for s in range(1, n + 1)])
    f64 = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        ys = np.array([int(f64(torch.from_numpy(x)).argmax()) for x in xs])
    xs_path, ys_path = tmp / f"{kind}_xs.npy", tmp / f"{kind}_ys.npy"
    np.save(xs_path, xs)
    np.save(ys_path, ys)
    rows = []
    for norm, radii in RADII[kind].items():
        base: dict[str, dict[str, Any]] = {}
        if python is not None:
            methods = ["CROWN", *(["alpha-CROWN"] if kind in ALPHA_KINDS else [])]
            base = {m: _runner(python, kind, xs_path, ys_path, norm, m, radii)
                    for m in methods}
        for r in radii:
            rep = decide_all(om, xs, ys, norm, r)
            status = [v.status for v in rep.verdicts]
            row: dict[str, Any] = {
                "kind": kind, "norm": norm, "radius": r, "n": n,
                "lsa": {"certified": rep.count("certified"), "attacked": rep.count("attacked"),
                        "unknown": rep.count("unknown"),
                        "certified_accuracy": rep.certified_accuracy,
                        "attack_accuracy": rep.attack_accuracy, "seconds": rep.seconds,
                        "seconds_by_status": {
                            st: sum(v.seconds for v in rep.verdicts if v.status == st)
                            for st in ("certified", "attacked", "unknown")},
                        "by": {b: sum(v.certified_by == b for v in rep.verdicts)
                               for b in sorted({v.certified_by for v in rep.verdicts
                                                if v.certified_by})}},
            }
            unsound = 0
            for m, res in base.items():
                got = res.get("radii", {}).get(str(r))
                if got is None:
                    row[m] = {"error": res.get("error", "no result")}
                    continue
                ver = got["verified"]
                unsound += sum(v and s == "attacked" for v, s in zip(ver, status, strict=True))
                row[m] = {"verified": int(sum(ver)), "verified_accuracy": sum(ver) / n,
                          "seconds": got["seconds"],
                          "only_it": sum(v and s != "certified"
                                         for v, s in zip(ver, status, strict=True)),
                          "only_lsa": sum(s == "certified" and not v
                                          for v, s in zip(ver, status, strict=True)),
                          # lsa's seconds on the inputs this tool verified (the same answer)
                          "lsa_seconds_on_these": sum(
                              w.seconds for w, v in zip(rep.verdicts, ver, strict=True) if v),
                          "errors": len(res.get("errors", []))}
            row["unsound"] = unsound
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4.5))
    x = np.arange(len(rows))
    names = [f"{r['kind']} {r['norm']}\n{r['radius']:g}" for r in rows]
    ax.bar(x - 0.3, [r["lsa"]["attack_accuracy"] for r in rows], 0.2, color="0.8",
           label="not attacked (upper bound)")
    ax.bar(x - 0.1, [r["lsa"]["certified_accuracy"] for r in rows], 0.2, color="C2",
           label="lsa certified")
    ax.bar(x + 0.1, [r.get("CROWN", {}).get("verified_accuracy") or 0 for r in rows], 0.2,
           color="C0", label="CROWN verified")
    ax.bar(x + 0.3, [r.get("alpha-CROWN", {}).get("verified_accuracy") or 0 for r in rows],
           0.2, color="C1", label="alpha-CROWN verified (MLP)")
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("fraction of inputs")
    ax.set_title("certified accuracy at a radius (labels: the model's predictions)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", nargs="+", default=["mlp", "tf1", "tf2"])
    ap.add_argument("--inputs", type=int, default=20)
    ap.add_argument("--alirpa-src", type=Path,
                    default=Path("/work/.mirror/Verified-Intelligence+auto_LiRPA/repo"))
    ap.add_argument("--no-alirpa", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    python, why = (None, "skipped (--no-alirpa)") if args.no_alirpa else \
        ensure_alirpa(args.alirpa_src, ALIRPA / "venv")
    print(f"auto_LiRPA: {why}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds:
            rows += run_kind(kind, args.inputs, Path(tmp), python)
    out = {"inputs": args.inputs, "threads": 1, "auto_lirpa_setup": why, "rows": rows,
           "seconds": time.monotonic() - t0}
    (OUT / "certified_accuracy.json").write_text(json.dumps(out, indent=1))
    plot(rows, OUT / "certified_accuracy.png")
    print(json.dumps({"unsound": sum(r["unsound"] for r in rows),
                      "seconds": out["seconds"]}))


if __name__ == "__main__":
    main()
