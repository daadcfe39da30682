"""Certified spectral norms of GPT-2-small-sized weights: time and tightness against the SVD.

Weights: per layer four 768x768, one 768x3072 and one 3072x768 matrices (Xavier-uniform,
float32 values, as a checkpoint holds them), `--layers` layers (12 by default: 72 matrices).
Methods, each over every matrix, on one thread, in the same run:
- `svd`: numpy's singular values (the reference value; not certified);
- `eigvalsh`: the certified bound with LAPACK's symmetric eigensolver on the Gram matrix
  (what `spectral_norm_upper` does for Gram sizes below 256);
- `cholesky`: the certified bound `spectral_norm_upper` uses from Gram size 256 up: a Lanczos
  estimate certified by one Cholesky factorisation (docs/certification.md).
For each certified method: total seconds, and the largest and smallest relative excess over
the SVD value (the smallest must be >= 0: a certified bound is never below the truth).
Prints one JSON object and writes it to bench/out/spectral_norm_speed.json; `--plot PATH` also
draws the times (PNG).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402


def _weights(layers: int, d: int) -> list[np.ndarray]:
    torch.manual_seed(0)
    shapes = [(d, d)] * 4 + [(4 * d, d), (d, 4 * d)]
    out = []
    for _ in range(layers):
        for shape in shapes:
            w = torch.empty(shape)
            torch.nn.init.xavier_uniform_(w)
            out.append(w.double().numpy())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from lsa_models.bounds import numerics

    weights = _weights(args.layers, args.d_model)
    t0 = time.perf_counter()
    exact = [float(np.linalg.svd(w, compute_uv=False)[0]) for w in weights]
    times = {"svd": time.perf_counter() - t0}
    excess: dict[str, list[float]] = {}
    default_min = numerics._CHOLESKY_MIN
    for method, cholesky_min in (("eigvalsh", 10**9), ("cholesky", default_min)):
        numerics._CHOLESKY_MIN = cholesky_min
        try:
            t0 = time.perf_counter()
            bounds = [numerics.spectral_norm_upper(w) for w in weights]
            times[method] = time.perf_counter() - t0
        finally:
            numerics._CHOLESKY_MIN = default_min
        excess[method] = [(b - s) / s for b, s in zip(bounds, exact, strict=True)]
    out = {
        "benchmark": "spectral_norm_speed",
        "threads": torch.get_num_threads(),
        "matrices": len(weights),
        **{f"{m}_s": round(t, 3) for m, t in times.items()},
        **{f"{m}_max_rel_excess": max(e) for m, e in excess.items()},
        **{f"{m}_min_rel_excess": min(e) for m, e in excess.items()},
        "never_below_svd": all(min(e) >= 0 for e in excess.values()),
        "cholesky_speedup_over_eigvalsh": round(times["eigvalsh"] / times["cholesky"], 2),
        "cholesky_speedup_over_svd": round(times["svd"] / times["cholesky"], 2),
    }
    out_dir = Path(__file__).resolve().parent / "out"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "spectral_norm_speed.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 2.5))
        ax.barh(list(times), list(times.values()))
        ax.set_xlabel(f"seconds for {len(weights)} matrices (1 thread)")
        fig.tight_layout()
        fig.savefig(args.plot)


if __name__ == "__main__":
    main()
