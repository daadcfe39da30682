"""Asymptotic tightness: certified inf-norm bound of L2-MHA against the best lower bound found.

As in the paper's figure (Kim et al. 2021): for each N, the Theorem 3.2 inf-norm bound and the
best `||J(X)||_inf` found by gradient ascent with random restarts, for L2-MHA with D = H = 1 and
unit weights, and for random weights (D=4, H=2; D=16, H=4); plus the lower bound found the
same way for DP-MHA (D = H = 1, unit weights), which keeps growing. Target: for
D = H = 1, upper/lower <= 1.35 for every N <= 50.

Also docs/theory.md's random-weight case (D = 8, H = 2, N = 12, weight entries of
scale 0.6) in both norms: Theorem 3.2 alone and the certified bound `l2_mha_bound` reports
(the smallest of the chained candidates, docs/certification.md), each against the best lower
bound found (`--d8-restarts` restarts, float64). Writes bench/out/tightness.json and .png and
prints the JSON. One thread.

    .venv/bin/python bench/tightness.py [--max-n 1000] [--restarts 3] [--steps 60]
                                        [--unit-restarts 3] [--series unit d4 d16 dp]
                                        [--d8-restarts 12]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lsa_models import L2MHA, DotProductMHA, certify
from lsa_models.bounds.formulas import l2_mha_bound, l2_mha_candidates
from lsa_models.empirical import lower_bound

OUT = Path(__file__).resolve().parent / "out"
NS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1000)


Attention = L2MHA | DotProductMHA


def unit_weights(model: Attention) -> Attention:
    with torch.no_grad():
        for lin in (model.q_proj, model.k_proj, model.v_proj, model.out_proj):
            if lin is not None:
                lin.weight.fill_(1.0)
        model.out_proj.bias.zero_()
    return model


SERIES = ("unit", "d4", "d16", "dp")


def models(seed: int, dtype: torch.dtype,
           keep: tuple[str, ...] = SERIES) -> list[tuple[str, str, Attention, bool]]:
    """(key, name, model, certifiable) for the series in `keep`."""
    out: list[tuple[str, str, Attention, bool]] = [
        ("unit", "L2 D=1 H=1 unit", unit_weights(L2MHA(1, 1)), True)]
    for d, h in ((4, 2), (16, 4)):
        torch.manual_seed(seed)
        out.append((f"d{d}", f"L2 D={d} H={h} random", L2MHA(d, h), True))
    out.append(("dp", "DP D=1 H=1 unit",
                unit_weights(DotProductMHA(1, 1)), False))
    out = [entry for entry in out if entry[0] in keep]
    for _, _, m, _ in out:
        m.to(dtype).eval()
        for p in m.parameters():
            p.requires_grad_(False)
    return out


def d8_case(seed: int, restarts: int, steps: int) -> dict[str, Any]:
    """D = 8, H = 2, N = 12, weight entries N(0, 0.6^2): old and new certified bounds against
    the best lower bound found, in both norms."""
    n, d_model, heads = 12, 8, 2
    torch.manual_seed(seed)
    model = L2MHA(d_model, heads).double().eval()
    with torch.no_grad():
        for lin in (model.q_proj, model.v_proj, model.out_proj):
            lin.weight.copy_(torch.randn(lin.weight.shape, dtype=torch.float64) * 0.6)
        model.out_proj.bias.zero_()
    for p in model.parameters():
        p.requires_grad_(False)
    wq, wv, wo = model.query_weights(), model.value_weights(), model.output_weight()

    def f(x: torch.Tensor) -> torch.Tensor:  # (N, D) -> (N, D)
        return model(x.unsqueeze(0)).squeeze(0)

    rows: dict[str, Any] = {}
    for norm in ("2", "inf"):
        t0 = time.perf_counter()
        candidates = l2_mha_candidates(wq, wv, wo, n, norm)
        upper = l2_mha_bound(wq, wv, wo, n, norm)
        t_bound = time.perf_counter() - t0
        res = lower_bound(f, (n, d_model), norm, restarts=restarts, steps=steps, seed=seed,
                          dtype=torch.float64)
        rows[norm] = {"upper_theorem_3_2": candidates["theorem_3_2"], "upper": upper,
                      "candidates": candidates, "lower": res.value,
                      "ratio_theorem_3_2": candidates["theorem_3_2"] / res.value,
                      "ratio": upper / res.value,
                      "bound_seconds": t_bound,
                      "search_seconds": time.perf_counter() - t0 - t_bound}
        print(json.dumps({"series": "d8 h2 n12", "norm": norm, **rows[norm]}), file=sys.stderr,
              flush=True)
    return {"n": n, "d_model": d_model, "n_heads": heads, "weight_scale": 0.6,
            "restarts": restarts, "steps": steps, "norms": rows}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.5), width_ratios=(2, 1))
    d8 = result.get("d8")
    if d8 is not None:
        labels = list(d8["norms"])
        xs = range(len(labels))
        for off, key, name in ((-0.25, "upper_theorem_3_2", "Theorem 3.2"),
                               (0.0, "upper", "certified (chained)"), (0.25, "lower", "lower")):
            bx.bar([x + off for x in xs], [d8["norms"][k][key] for k in labels], width=0.25,
                   label=name)
        bx.set_xticks(list(xs), [f"{k}-norm" for k in labels])
        bx.set_yscale("log")
        bx.set_title("D=8 H=2 N=12, weights x0.6")
        bx.legend(fontsize=7)
    colours = ["C0", "C1", "C2", "C3"]
    for colour, series in zip(colours, result["series"], strict=False):
        ns = [r["n"] for r in series["rows"]]
        lows = [r["lower"] for r in series["rows"]]
        ax.plot(ns, lows, "o-", color=colour, ms=3, label=f"{series['name']}: lower")
        if series["certifiable"]:
            ups = [r["upper"] for r in series["rows"]]
            ax.plot(ns, ups, "--", color=colour, label=f"{series['name']}: upper")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("N (sequence length)")
    ax.set_ylabel("Lipschitz bound, inf-norm")
    ax.set_title("Certified upper bound vs best lower bound found")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-n", type=int, default=1000)
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--unit-restarts", type=int, default=3,
                    help="restarts for the D=H=1 unit series (cheap; the paper used 50)")
    ap.add_argument("--series", nargs="*", choices=SERIES, default=list(SERIES))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--d8-restarts", type=int, default=12,
                    help="restarts for the D=8 H=2 N=12 case (0: skip it)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=OUT / "tightness.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    ns = [n for n in NS if n <= args.max_n]
    t_start, load_start = time.perf_counter(), list(os.getloadavg())
    series: list[dict[str, Any]] = []
    for key, name, model, certifiable in models(args.seed, dtype, tuple(args.series)):
        d = model.config.d_model
        restarts = args.unit_restarts if key == "unit" else args.restarts

        def f(x: torch.Tensor, model: nn.Module = model) -> torch.Tensor:  # (N, D) -> (N, D)
            return model(x.unsqueeze(0)).squeeze(0)

        rows: list[dict[str, Any]] = []
        for n in ns:
            t0 = time.perf_counter()
            upper = certify(model, "inf", n).upper if certifiable else None
            res = lower_bound(f, (n, d), "inf", restarts=restarts, steps=args.steps,
                              seed=args.seed, dtype=dtype)
            row = {"n": n, "upper": upper, "lower": res.value,
                   "ratio": None if upper is None else upper / res.value,
                   "witness_scale": res.scale, "rows_evaluated": res.final.rows_evaluated
                   if res.final else None, "seconds": time.perf_counter() - t0}
            print(json.dumps({"series": name, **row}), file=sys.stderr, flush=True)
            rows.append(row)
        series.append({"key": key, "name": name, "d_model": d, "certifiable": certifiable,
                       "restarts": restarts, "rows": rows})
    d8 = d8_case(args.seed, args.d8_restarts, 2 * args.steps) if args.d8_restarts else None
    unit: list[dict[str, Any]] = next(
        (s["rows"] for s in series if s["key"] == "unit"), [])
    small: list[float] = [r["ratio"] for r in unit if r["n"] <= 50]
    result: dict[str, Any] = {
        "benchmark": "tightness",
        "norm": "inf",
        "restarts": args.restarts,
        "unit_restarts": args.unit_restarts,
        "steps": args.steps,
        "seed": args.seed,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "seconds": time.perf_counter() - t_start,
        "load_average_at_start": load_start,
        "load_average_at_end": list(os.getloadavg()),
        "series": series,
        "d8": d8,
        "target": "D=H=1 unit weights: upper/lower <= 1.35 for N <= 50",
        "max_ratio_unit_n_le_50": max(small) if small else None,
        "target_met": bool(small) and max(small) <= 1.35,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png = args.out.with_suffix(".png")
    plot(result, png)
    result["plot"] = str(png)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
