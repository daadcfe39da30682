"""Forward+backward time of L2MHA (efficient), L2MHA (reference) and nn.MultiheadAttention.

Measured in one run, one CPU thread, same shapes; prints JSON with the ratios to
nn.MultiheadAttention and writes it (and a bar plot) under bench/out/.

    python bench/attention_speed.py [--batch 16 --seq-len 256 --d-model 256 --heads 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from lsa_models import L2MHA

OUT = Path(__file__).resolve().parent / "out"


def time_fwd_bwd(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, repeats: int,
                 warmup: int = 1) -> list[float]:
    times = []
    for i in range(warmup + repeats):
        xi = x.detach().requires_grad_(True)
        t0 = time.perf_counter()
        fn(xi).sum().backward()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--reference-repeats", type=int, default=2,
                    help="the reference form is ~30x slower; fewer repeats keep the run short")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    x = torch.randn(args.batch, args.seq_len, args.d_model)  # (B, N, D)
    l2 = L2MHA(args.d_model, args.heads)
    mha = nn.MultiheadAttention(args.d_model, args.heads, batch_first=True)

    def run_mha(z: torch.Tensor) -> torch.Tensor:
        return mha(z, z, z, need_weights=False)[0]

    results: dict[str, list[float]] = {}
    # Interleave the variants' repeats so drifting machine load affects them alike.
    for _ in range(args.repeats):
        results.setdefault("nn.MultiheadAttention", []).extend(time_fwd_bwd(run_mha, x, 1))
        results.setdefault("L2MHA (efficient)", []).extend(time_fwd_bwd(l2, x, 1))
    results["L2MHA (reference)"] = time_fwd_bwd(l2.forward_reference, x,
                                                args.reference_repeats)
    med = {k: statistics.median(v) for k, v in results.items()}
    base = med["nn.MultiheadAttention"]
    report = {
        "benchmark": "attention_speed",
        "shape": {"B": args.batch, "N": args.seq_len, "D": args.d_model, "H": args.heads},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "median_s": med,
        "all_s": results,
        "ratio_to_nn_mha": {k: v / base for k, v in med.items()},
        "target": "L2MHA (efficient) <= 1.1x nn.MultiheadAttention",
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "attention_speed.json").write_text(json.dumps(report, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3))
        names = list(med)
        ax.barh(names, [med[n] for n in names])
        ax.set_xscale("log")
        ax.set_xlabel("forward+backward seconds (median, 1 thread)")
        fig.tight_layout()
        fig.savefig(OUT / "attention_speed.png", dpi=120)
    except ImportError:
        pass
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
