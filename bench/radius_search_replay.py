"""Replay the certified-radius search (lsa_models.engine.routes.radius_search.affine_radius: the
plain, second-order and eigenvalue stages) on recorded margin lower bounds, to tune its constants
without walking the engine: `record` walks each stage of the tf1 and tf2 classifiers
(bench/local_models.py) at a grid of radii once (minutes) and writes the margins' lower bounds;
`replay` runs the real search code with the walks replaced by interpolation on that grid
(milliseconds) and prints each stage's radius and walks. The replay reproduces the real searches'
walk counts (tf1/tf2, both norms); a choice it suggests must still be measured on real walks.

    .venv/bin/python bench/radius_search_replay.py record   # bench/out/radius_search_grid.json
    .venv/bin/python bench/radius_search_replay.py replay [--quad-step-inf 1.08] [...]
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

from bench.local_models import build, center, export  # noqa: E402
from lsa_models.engine.drivers.centre import Centre  # noqa: E402
from lsa_models.engine.drivers.margins import margin_lower_bounds  # noqa: E402
from lsa_models.engine.routes import radius_search  # noqa: E402
from lsa_models.onnx import load_onnx  # noqa: E402

GRID = Path(__file__).resolve().parent / "out" / "radius_search_grid.json"
# per (model, norm): each stage's radius range, wide enough for every radius its search tries
STAGES: dict[tuple[str, str], dict[str, tuple[float, float]]] = {
    ("tf1", "inf"): {"plain": (0.02, 0.12), "quad": (0.055, 0.085)},
    ("tf1", "2"): {"plain": (0.06, 0.30), "quad": (0.24, 0.40), "eig": (0.30, 0.40)},
    ("tf2", "inf"): {"plain": (0.01, 0.05), "quad": (0.038, 0.06)},
    ("tf2", "2"): {"plain": (0.08, 0.35), "quad": (0.17, 0.27), "eig": (0.22, 0.28)},
}
POINTS = 30


def _setup(kind: str) -> tuple[Any, np.ndarray, int, dict[int, float]]:
    om = load_onnx(export(build(kind, 0), Path(tempfile.mkdtemp()) / "m.onnx").read_bytes())
    x0 = center(1).numpy().astype(np.float64)
    with torch.no_grad():
        out = om.module.with_dtype(torch.float64)(torch.from_numpy(x0)).reshape(-1)
    label = int(out.argmax())
    margins = {j: float(out[label] - out[j]) for j in range(out.numel()) if j != label}
    return om, x0, label, margins


def record() -> None:
    grid: dict[str, Any] = {}
    for (kind, norm), stages in STAGES.items():
        om, x0, label, margins = _setup(kind)
        ctr = Centre(om, x0)
        start = radius_search._first_order_radius(om.module.with_dtype(torch.float64), x0,
                                                  label, margins, norm) \
            * radius_search.AFFINE_START
        for stage, (a, b) in stages.items():
            rs = np.geomspace(a, b, POINTS)
            vals = []
            for r in rs:
                v = margin_lower_bounds(om, x0, float(r), norm, label, ctr,
                                        quad=stage != "plain", eig=stage == "eig")
                vals.append(None if v is None else {str(j): x for j, x in v.items()})
            grid[f"{kind}/{norm}/{stage}"] = {"start": start, "r": rs.tolist(), "v": vals}
            print(kind, norm, stage, flush=True)
    GRID.parent.mkdir(parents=True, exist_ok=True)
    GRID.write_text(json.dumps(grid))


class _Replay:
    """margin_lower_bounds' stand-in: each margin interpolated on the grid of the stage its
    call asks for (plain, `quad`, `quad` and `eig`); counts each stage's walks and keeps the
    largest radius it certified."""

    def __init__(self, grid: dict[str, Any], key: str) -> None:
        self.stages: dict[str, tuple[np.ndarray, dict[int, np.ndarray]]] = {}
        for stage in ("plain", "quad", "eig"):
            entry = grid.get(f"{key}/{stage}")
            if entry is None:
                continue
            rows = entry["v"]
            if any(v is None for v in rows):
                raise ValueError(f"a recorded {stage} walk failed: narrow its range")
            self.stages[stage] = (np.array(entry["r"]),
                                  {int(j): np.array([v[j] for v in rows]) for j in rows[0]})
        self.walks = dict.fromkeys(self.stages, 0)
        self.best = dict.fromkeys(self.stages, 0.0)

    def __call__(self, *args: Any, quad: bool = False, eig: bool = False, **kwargs: Any
                 ) -> dict[int, float]:
        stage = "eig" if eig else "quad" if quad else "plain"
        rs, margins = self.stages[stage]
        r = float(args[2])
        out = {j: float(np.interp(r, rs, ys)) for j, ys in margins.items()}
        self.walks[stage] += 1
        if min(out.values()) > 0:
            self.best[stage] = max(self.best[stage], r)
        return out


class _NoCentre:
    def __init__(self, *args: Any) -> None:
        pass


def replay(args: argparse.Namespace) -> None:
    """The real `radius_search.affine_route` (the three stages) on each model's recorded margins."""
    grid = json.loads(GRID.read_text())
    step = radius_search.QUAD_STEP
    step["inf"], step["2"] = args.quad_step_inf, args.quad_step_2
    saved = radius_search.margin_lower_bounds, radius_search.Centre
    radius_search.Centre = _NoCentre  # type: ignore[misc,assignment]
    try:
        for kind, norm in STAGES:
            key = f"{kind}/{norm}"
            oracle = _Replay(grid, key)
            radius_search.margin_lower_bounds = oracle  # type: ignore[assignment]
            aff, walks = radius_search.affine_route(
                None, None, norm, 0, grid[f"{key}/plain"]["start"],  # type: ignore[arg-type]
                quad="quad" in oracle.stages)
            stages = ", ".join(f"{s} {oracle.best[s]:.5g} ({n} walks)"
                               for s, n in oracle.walks.items() if n)
            print(f"{kind} {norm:3s} radius {aff:.5g} in {walks} walks: {stages}")
    finally:
        radius_search.margin_lower_bounds, radius_search.Centre = saved  # type: ignore[misc]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["record", "replay"])
    ap.add_argument("--quad-step-inf", type=float, default=radius_search.QUAD_STEP["inf"])
    ap.add_argument("--quad-step-2", type=float, default=radius_search.QUAD_STEP["2"])
    args = ap.parse_args()
    if args.mode == "record":
        record()
    else:
        replay(args)


if __name__ == "__main__":
    main()
