"""auto_LiRPA's side of bench/local_vs_autolirpa.py; runs ONLY in the separate auto_LiRPA venv
(a benchmark baseline, never a dependency of lsa):

    bench/out/alirpa/venv/bin/python bench/alirpa_runner.py KIND SEED X0.npy LABEL EPS...

Builds the same classifier (bench/local_models.py, same seed) and prints one JSON object:
  - `crown_linf`, `crown_l2`: CROWN's certified robustness radius in the L_inf and the L2
    ball (the Frobenius norm of the whole input, as lsa's 2-ball): the largest eps at which
    the CROWN lower bounds of every margin f_label - f_j stay positive (doubling from 1e-3,
    then 14 bisection steps), and its seconds;
  - `jacobian`: per eps, auto_LiRPA's local L_inf Lipschitz constant (its Jacobian mode,
    JacobianOP + GradNorm(1) per output, the largest over outputs: the same quantity as lsa's
    inf-norm constant, max_i sum_j |J_ij| over the ball) and seconds, or the error it raised.
auto_LiRPA's Jacobian bounds are run on the L_inf ball only (its maintainers call L2 loose).

For bench/certified_accuracy.py:

    ... alirpa_runner.py --verified KIND SEED XS.npy YS.npy NORM METHOD RADIUS...

prints, per radius, which of the inputs (stacked (S, 1, N, D)) METHOD (CROWN or alpha-CROWN)
verifies and its seconds.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.local_models import CLASSES, build  # noqa: E402


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def crown_radius(model: nn.Module, x0: torch.Tensor, label: int, norm: float
                 ) -> dict[str, Any]:
    from auto_LiRPA import BoundedModule, BoundedTensor, PerturbationLpNorm

    t0 = time.monotonic()
    try:
        bm = BoundedModule(model, torch.zeros_like(x0), device="cpu")
        others = [j for j in range(CLASSES) if j != label]
        c = torch.zeros(1, len(others), CLASSES)
        for i, j in enumerate(others):
            c[0, i, label], c[0, i, j] = 1.0, -1.0

        def certified(eps: float) -> bool:
            bx = BoundedTensor(x0, PerturbationLpNorm(norm=norm, eps=eps))
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
        return {"radius": lo, "seconds": time.monotonic() - t0}
    except Exception as exc:  # the baseline's own failure is a result, reported as such
        return {"error": _error(exc), "seconds": time.monotonic() - t0}


def jacobian_constants(model: nn.Module, x0: torch.Tensor, eps_list: list[float]
                       ) -> list[dict[str, Any]]:
    from auto_LiRPA import BoundedModule, BoundedTensor, PerturbationLpNorm
    from auto_LiRPA.jacobian import GradNorm, JacobianOP

    class LocalLipschitz(nn.Module):  # auto_LiRPA's examples/vision/jacobian.py wrapper
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.grad_norm = GradNorm(norm=1)

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            y = self.model(x).matmul(mask)  # (1, 1): one output
            return self.grad_norm(JacobianOP.apply(y, x))

    mask = torch.zeros(CLASSES, 1)
    mask[0, 0] = 1
    t0 = time.monotonic()
    try:
        bm = BoundedModule(LocalLipschitz(), (BoundedTensor(x0), mask), device="cpu")
    except Exception as exc:
        err = _error(exc)
        return [{"eps": e, "error": err, "seconds": time.monotonic() - t0} for e in eps_list]
    build_s = time.monotonic() - t0
    rows: list[dict[str, Any]] = []
    for eps in eps_list:
        t1 = time.monotonic()
        try:
            x = BoundedTensor(x0, PerturbationLpNorm(norm=np.inf, eps=eps))
            ups = []
            for i in range(CLASSES):
                mask.zero_()
                mask[i, 0] = 1
                ups.append(float(bm.compute_jacobian_bounds((x, mask), bound_lower=False)[1]
                                 .max()))
            rows.append({"eps": eps, "upper": max(ups), "seconds": time.monotonic() - t1
                         + build_s / len(eps_list)})
        except Exception as exc:
            rows.append({"eps": eps, "error": _error(exc), "seconds": time.monotonic() - t1})
    return rows


def verified(kind: str, seed: int, xs: np.ndarray, labels: np.ndarray, norm: float,
             radii: list[float], method: str) -> dict[str, Any]:
    """Per radius, which inputs `method` ("CROWN" or "alpha-CROWN") verifies (every margin's
    lower bound positive on the ball) and its seconds: one bounded model per input, built
    once and reused across the radii."""
    from auto_LiRPA import BoundedModule, BoundedTensor, PerturbationLpNorm

    model = build(kind, seed)
    out: dict[str, Any] = {"method": method,
                           "radii": {str(r): {"verified": [], "seconds": 0.0} for r in radii}}
    for x, label in zip(xs, labels, strict=True):
        x0 = torch.from_numpy(x).float().reshape(1, *x.shape[-2:])
        others = [j for j in range(CLASSES) if j != int(label)]
        c = torch.zeros(1, len(others), CLASSES)
        for i, j in enumerate(others):
            c[0, i, int(label)], c[0, i, j] = 1.0, -1.0
        bm = BoundedModule(model, torch.zeros_like(x0), device="cpu",
                           bound_opts={"verbosity": 0})
        for r in radii:
            t0 = time.monotonic()
            try:
                bx = BoundedTensor(x0, PerturbationLpNorm(norm=norm, eps=r))
                lb, _ = bm.compute_bounds(x=(bx,), C=c, method=method)
                ok = bool((lb > 0).all())
            except Exception as exc:  # the baseline's own failure is a result
                out.setdefault("errors", []).append(_error(exc))
                ok = False
            row = out["radii"][str(r)]
            row["verified"].append(ok)
            row["seconds"] += time.monotonic() - t0
    return out


def main() -> None:
    if sys.argv[1] == "--verified":
        # --verified KIND SEED XS.npy YS.npy NORM METHOD RADIUS...
        kind, seed, method = sys.argv[2], int(sys.argv[3]), sys.argv[7]
        torch.set_num_threads(1)
        xs = np.load(sys.argv[4], allow_pickle=False)
        ys = np.load(sys.argv[5], allow_pickle=False)
        norm = np.inf if sys.argv[6] == "inf" else 2.0
        print(json.dumps(verified(kind, seed, xs, ys, norm, [float(r) for r in sys.argv[8:]],
                                  method)))
        return
    kind, seed, x0_path, label = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    eps_list = [float(e) for e in sys.argv[5:]]
    torch.set_num_threads(1)
    model = build(kind, seed)
    x0 = torch.from_numpy(np.load(x0_path, allow_pickle=False)).float()  # (1, N, D)
    out: dict[str, Any] = {"kind": kind, "crown_linf": crown_radius(model, x0, label, np.inf),
                           "crown_l2": crown_radius(model, x0, label, 2.0),
                           "jacobian_linf": jacobian_constants(model, x0, eps_list)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
