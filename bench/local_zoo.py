"""Which zoo models (tests/zoo/cases.py: torch, HF, timm, x-transformers configs with random
weights) the local engine certifies on a ball, and why the others fall back to the global
bound on the reachable tokens. Float input layouts only (token ids and pixels are bounded on
their continuous part by the global analysis). Writes bench/out/local_zoo.json and prints a
table.

    .venv/bin/python bench/local_zoo.py [--eps 0.01] [--norm 2] [--only NAME...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lsa_models.empirical.local import local_lower_bound  # noqa: E402
from lsa_models.engine.drivers.jacobian import local_jacobian  # noqa: E402
from lsa_models.engine.routes.certify import certify_local  # noqa: E402
from lsa_models.engine.values import LocalNotCertified  # noqa: E402
from lsa_models.onnx import load_onnx  # noqa: E402
from tests.zoo.cases import CASES  # noqa: E402
from tests.zoo.harness import export  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
FLOAT_LAYOUTS = ("(1, N, D)", "(N, D)", "inputs_embeds", "patches")


def run_case(case: Any, exporter: str, eps: float, norm: str, tmp: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"case": case.key, "exporter": exporter}
    t0 = time.monotonic()
    try:
        built = case.build()
        path = export(built, exporter, tmp / f"{case.model}-{exporter}.onnx")
        om = load_onnx(path.read_bytes(), path.name)
    except Exception as exc:  # an export/load failure is this table's result for the case
        row.update(local="export/load failed", reason=f"{type(exc).__name__}: {exc}"[:200])
        return row
    x0 = built.example.numpy().astype(np.float64)
    try:
        lj = local_jacobian(om, x0, eps, norm)
        # the graph module takes a batch: (1, N, D) for a rank-2 graph too
        lb = local_lower_bound(om.module.with_dtype(torch.float64),
                               x0 if x0.ndim == 3 else x0[None], eps, norm, restarts=1, steps=8)
        row.update(local="certified", engine_upper=lj.upper(), lower=lb.lower,
                   ratio=lj.upper() / lb.lower, sound=bool(lj.upper() >= lb.lower))
    except LocalNotCertified as exc:
        row.update(local="falls back", reason=str(exc)[:200])
    except ValueError as exc:
        row.update(local="refused", reason=str(exc)[:200])
    try:
        res = certify_local(om, x0, eps, norm)  # type: ignore[arg-type]
        row["upper"] = res.upper
        row["tangent"] = "tangent graph" in res.method  # the inf-ball's tangent bound won
        row["adjoint"] = "adjoint graph" in res.method  # the inf-ball's adjoint rows won
        if res.upper is not None and "lower" in row:
            row["upper_ratio"] = res.upper / row["lower"]
            row["upper_sound"] = bool(res.upper >= row["lower"])
    except ValueError as exc:
        row["upper_error"] = str(exc)[:200]
    row["seconds"] = time.monotonic() - t0
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--eps", type=float, default=1e-2)
    ap.add_argument("--norm", default="2", choices=("2", "inf"))
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            if case.layout not in FLOAT_LAYOUTS or (args.only and not any(
                    o in case.key for o in args.only)):
                continue
            for exporter in case.exporters:
                rows.append(run_case(case, exporter, args.eps, args.norm, Path(tmp)))
                r = rows[-1]
                ratio = f"{r['ratio']:.3f}" if "ratio" in r else ""
                best = f"{r['upper_ratio']:.3f}" if "upper_ratio" in r else ""
                flag = ("T" if r.get("tangent") else "") + ("A" if r.get("adjoint") else "") + \
                    ("" if r.get("upper_sound", True) else " UNSOUND")
                print(f"{r['case']:45s} {exporter:11s} {r['local']:12s} {ratio:8s} "
                      f"{best:8s} {flag:3s} {r.get('reason', '')}", flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "local_zoo.json").write_text(json.dumps({"eps": args.eps, "norm": args.norm,
                                                    "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
