"""Tightness of lsa's local engine on the three classifiers of
bench/local_models.py (an MLP, 1- and 2-layer
pre-norm Transformers, D=16, N=8, exported to ONNX): for both norms and eps in {1e-3, 1e-2,
1e-1}, the certified local constant, the in-ball float64 lower bound (projected Jacobian
ascent), their ratio and the seconds; and the certified robustness radius against the PGD
attack radius. One run, one thread; writes bench/out/local_tightness.json and .png and prints
the table.

    .venv/bin/python bench/local_tightness.py [--kinds mlp tf1 tf2] [--no-radii] [--tag NAME]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.local_models import KINDS, build, center, export  # noqa: E402
from bench.local_vs_autolirpa import lsa_rows  # noqa: E402
from lsa_models.engine.routes.certify import robustness  # noqa: E402
from lsa_models.onnx import load_onnx  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
EPS = (1e-3, 1e-2, 1e-1)


def run_kind(kind: str, seed: int, tmp: Path, radii: bool) -> dict[str, Any]:
    om = load_onnx(export(build(kind, seed), tmp / f"{kind}.onnx").read_bytes())
    x0 = center(seed + 1).numpy().astype(np.float64)
    f64 = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        label = int(f64(torch.from_numpy(x0)).argmax())
    rows = lsa_rows(om, f64, x0, seed, kind)
    out: dict[str, Any] = {"kind": kind, "label": label, "local": rows}
    if radii:
        out["radii"] = {}
        for norm in ("2", "inf"):
            r = robustness(om, x0, label, norm)  # type: ignore[arg-type]
            out["radii"][norm] = {
                "certified": r.certified_radius, "attack": r.attack_radius,
                "ratio": (r.certified_radius / r.attack_radius) if r.attack_radius else None,
                "certify_seconds": r.certify_seconds, "attack_seconds": r.attack_seconds}
            print(json.dumps({"kind": kind, "norm": norm, **out["radii"][norm]}),
                  file=sys.stderr, flush=True)
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| model | norm | eps | upper | lower | ratio | s |", "|---|---|---|---|---|---|---|"]
    for r in results:
        for x in r["local"]:
            up = "-" if x["upper"] is None else f"{x['upper']:.4g}"
            ratio = "-" if x["ratio"] is None else f"{x['ratio']:.3g}"
            lines.append(f"| {r['kind']} | {x['norm']} | {x['eps']:g} | {up} | "
                         f"{x['lower']:.4g} | {ratio} | {x['upper_seconds']:.1f} |")
    if any("radii" in r for r in results):
        lines += ["", "| model | norm | certified | attack | ratio | s |",
                  "|---|---|---|---|---|---|"]
        for r in results:
            for norm, x in r.get("radii", {}).items():
                ratio = "-" if x["ratio"] is None else f"{x['ratio']:.3g}"
                lines.append(f"| {r['kind']} | {norm} | {x['certified']:.4g} | "
                             f"{x['attack']} | {ratio} | {x['certify_seconds']:.1f} |")
    return "\n".join(lines)


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
        ax.axhline(10, ls=":", c="grey")
        ax.set(xscale="log", yscale="log", xlabel="eps", ylabel="upper / lower",
               title=f"lsa local constant, {norm}-norm ball")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", nargs="+", default=list(KINDS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-radii", action="store_true")
    ap.add_argument("--tag", default="local_tightness")
    args = ap.parse_args()
    torch.set_num_threads(1)
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_kind(k, args.seed, Path(tmp), not args.no_radii) for k in args.kinds]
    doc = {"models": results, "eps": list(EPS), "table": table(results)}
    (OUT / f"{args.tag}.json").write_text(json.dumps(doc, indent=1))
    plot(results, OUT / f"{args.tag}.png")
    print(doc["table"])


if __name__ == "__main__":
    main()
