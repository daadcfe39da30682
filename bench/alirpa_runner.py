"""auto_LiRPA's side of bench/local_vs_autolirpa.py; runs ONLY in the separate auto_LiRPA venv
(a benchmark baseline, never a dependency of lsa):

    /work/alirpa-venv/bin/python bench/alirpa_runner.py KIND SEED X0.npy LABEL

Builds the same classifier (bench/local_models.py, same seed) and prints one JSON object:
CROWN's certified L_inf robustness radius (largest eps whose margins' CROWN lower bounds stay
positive, by bisection) and seconds.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.local_models import CLASSES, build  # noqa: E402


def main() -> None:
    from auto_LiRPA import BoundedModule, BoundedTensor, PerturbationLpNorm

    kind, seed, x0_path, label = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    torch.set_num_threads(1)
    model = build(kind, seed)
    x0 = torch.from_numpy(np.load(x0_path, allow_pickle=False)).float()
    out: dict[str, object] = {"kind": kind}
    t0 = time.monotonic()
    try:
        bm = BoundedModule(model, torch.zeros_like(x0), device="cpu")
        others = [j for j in range(CLASSES) if j != label]
        c = torch.zeros(1, len(others), CLASSES)
        for i, j in enumerate(others):
            c[0, i, label], c[0, i, j] = 1.0, -1.0

        def certified(eps: float) -> bool:
            bx = BoundedTensor(x0, PerturbationLpNorm(norm=np.inf, eps=eps))
            lb, _ = bm.compute_bounds(x=(bx,), C=c, method="CROWN")
            return bool((lb > 0).all())

        lo, hi = 0.0, 1e-3
        while certified(hi) and hi < 10:
            lo, hi = hi, hi * 2
        for _ in range(14):
            mid = 0.5 * (lo + hi)
            if certified(mid):
                lo = mid
            else:
                hi = mid
        out["crown_linf_radius"] = lo
    except Exception as exc:  # the baseline's own failure is a result, reported as such
        out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    out["seconds"] = time.monotonic() - t0
    print(json.dumps(out))


if __name__ == "__main__":
    main()
