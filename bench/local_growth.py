"""Where the local engine loses tightness: per op of one classifier of
bench/local_models.py on one ball, the
enclosure's value width (max hi - lo) against the width seen at sampled points of the ball
(corners / sphere points, an inner estimate), and its Jacobian radius (max jr) against the
largest |J(X) - jc| seen at those points (forward-mode Jacobians, float64). Ratios far above 1
name the ops that dominate the looseness. Writes bench/out/local_growth_<kind>_<norm>_<eps>.json
and prints the table.

    .venv/bin/python bench/local_growth.py [--kind tf1] [--norm inf] [--eps 0.1] [--samples 6]
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
from torch.autograd import forward_ad

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.local_models import build, center, export  # noqa: E402
from lsa_models.engine.drivers.centre import check_center  # noqa: E402
from lsa_models.engine.drivers.jacobian_walk import walk  # noqa: E402
from lsa_models.engine.remainders.telescope import Telescope  # noqa: E402
from lsa_models.engine.values import Ball, LocalValue  # noqa: E402
from lsa_models.onnx import load_onnx  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def sampled(module: Any, x0: np.ndarray, eps: float, norm: str, k: int, seed: int,
            names: list[str]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray],
                                       dict[str, np.ndarray]]:
    """Per tensor: min and max value over the sample points, and max |J(X) - J(X0)|."""
    rng = np.random.default_rng(seed)
    p = x0.size
    pts = [np.zeros_like(x0)]
    for _ in range(k):
        if norm == "inf":
            d = rng.choice([-1.0, 1.0], size=x0.shape) * eps
        else:
            d = rng.standard_normal(x0.shape)
            d *= eps / np.linalg.norm(d)
        pts.append(d)
    lo: dict[str, np.ndarray] = {}
    hi: dict[str, np.ndarray] = {}
    dev: dict[str, np.ndarray] = {}
    jac0: dict[str, np.ndarray] = {}
    for i, d in enumerate(pts):
        x = torch.from_numpy(x0 + d)
        with torch.no_grad():
            env = module.run_env(x)
        cols: dict[str, list[np.ndarray]] = {n: [] for n in names}
        for j in range(p):
            t = torch.zeros(p, dtype=torch.float64)
            t[j] = 1.0
            with forward_ad.dual_level():
                envd = module.run_env(forward_ad.make_dual(x, t.reshape(x.shape)))
                for n in names:
                    tan = forward_ad.unpack_dual(envd[n]).tangent
                    cols[n].append(np.zeros(tuple(envd[n].shape)) if tan is None
                                   else tan.detach().numpy())
        for n in names:
            v = env[n].numpy()
            jac = np.stack(cols[n], axis=-1)  # (*S, P)
            if i == 0:
                lo[n], hi[n], jac0[n], dev[n] = v.copy(), v.copy(), jac, np.zeros_like(jac)
            else:
                lo[n], hi[n] = np.minimum(lo[n], v), np.maximum(hi[n], v)
                dev[n] = np.maximum(dev[n], np.abs(jac - jac0[n]))
    return lo, hi, dev


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="tf1")
    ap.add_argument("--norm", default="inf")
    ap.add_argument("--eps", type=float, default=0.1)
    ap.add_argument("--samples", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        om = load_onnx(export(build(args.kind, args.seed), Path(tmp) / "m.onnx").read_bytes())
    x = check_center(om, center(args.seed + 1).numpy().astype(np.float64))
    module = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        env = module.run_env(torch.from_numpy(x))
    zero, _ = walk(om, module, env, Ball(x, 0.0, args.norm), None)
    tight = Telescope(om, x, zero)
    values, _ = walk(om, module, env, Ball(x, args.eps, args.norm), tight)
    producer = {o: nd for nd in module.runtime_nodes for o in nd.outputs}
    names = [n for n, v in values.items() if isinstance(v, LocalValue) and n in env]
    lo, hi, dev = sampled(module, x, args.eps, args.norm, args.samples, args.seed, names)
    rows = []
    for n in names:
        v = values[n]
        assert isinstance(v, LocalValue)
        w_enc, w_s = float((v.hi - v.lo).max()), float((hi[n] - lo[n]).max())
        # first-order width 2 eps ||row of jc||_dual: the true width to O(eps^2) (random
        # sample points see only ~||row||_2 / ||row||_1 of it in the inf-ball)
        dual = 1 if args.norm == "inf" else 2
        w_lin = float((2 * args.eps * np.linalg.norm(v.jc, ord=dual, axis=-1)).max())
        j_enc, j_s = float(v.jr.max()), float(dev[n].max())
        nd = producer.get(n)
        rows.append({"tensor": n, "op": nd.op_type if nd else "input", "width": w_enc,
                     "width_sampled": w_s, "width_ratio": w_enc / max(w_s, 1e-300),
                     "width_linear": w_lin, "width_lin_ratio": w_enc / max(w_lin, 1e-300),
                     "jr": j_enc, "jr_sampled": j_s, "jr_ratio": j_enc / max(j_s, 1e-300)})
        r = rows[-1]
        print(f"{r['op']:>20} {n[-28:]:>28}  width {w_enc:9.3g} / {w_s:9.3g} = "
              f"{r['width_ratio']:9.3g} lin {w_lin:9.3g} {r['width_lin_ratio']:7.3g}  "
              f"jr {j_enc:9.3g} / {j_s:9.3g} = {r['jr_ratio']:9.3g}")
    OUT.mkdir(exist_ok=True)
    (OUT / f"local_growth_{args.kind}_{args.norm}_{args.eps:g}.json").write_text(
        json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
