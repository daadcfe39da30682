"""Depth stability of character-level LMs under a fixed learning rate (docs/theory.md,
"The language-modelling experiment"): DP vs tied L2 vs Contractive-L2 at several depths.

Every configuration trains with plain Adam (AdamW, weight decay 0) at one fixed learning rate:
no warmup, no decay, no gradient clipping, the same seed, batches and token budget. Reported
per configuration: final and best validation bits per character, divergence events (a
non-finite loss, or a jump of more than 1 nat above the best smoothed loss), whether the run
diverged, throughput. DP is the baseline: each row carries its bpc minus DP's at that depth.

Default budget: about 30 minutes on one CPU thread of this machine (D = 32, 600 steps of
16 x 64 characters per configuration). `--scale K` multiplies the steps by K and the width
by round(sqrt(K)) for a GPU.

    python bench/depth_stability.py                       # PTB, ~30 min on one CPU thread
    python bench/depth_stability.py --depths 2 8 --steps 100    # a quick look
    python bench/depth_stability.py --scale 16 --device cuda    # GPU

Writes bench/out/depth_stability.json and bench/out/depth_stability.png; prints the JSON.
"""

from __future__ import annotations

import os

# One BLAS thread: the certified bounds call LAPACK on small matrices every step, and a
# multi-threaded OpenBLAS on a shared 2-core machine makes that 20x slower. Must precede numpy.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from lsa_models.config import ATTENTION_NAMES  # noqa: E402
from lsa_models.data import CharCorpus, ptb_corpus, text_corpus  # noqa: E402
from lsa_models.lm import LMConfig  # noqa: E402
from lsa_models.training import LN2, TrainConfig, evaluate_bpc, train_lm  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"


def run_one(corpus: CharCorpus, kind: str, depth: int, args: argparse.Namespace,
            width: int) -> dict[str, Any]:
    mcfg = LMConfig(corpus.vocab.size, width, args.heads, depth, 4 * width, args.seq_len,
                    kind, args.c, args.activation,  # type: ignore[arg-type]
                    norm_first=not args.post_norm)
    tcfg = TrainConfig(steps=args.steps * args.scale, batch_size=args.batch_size, lr=args.lr,
                       fixed_lr=True, weight_decay=0.0, grad_clip=None,
                       eval_every=max(1, args.steps * args.scale // args.evals),
                       eval_tokens=args.eval_tokens, progress_every=50, seed=args.seed,
                       device=args.device)
    res = train_lm(mcfg, corpus, tcfg)
    h = res.history
    finite_val = [v for v in h.val_bpc if math.isfinite(v)]
    tail = [v for v in h.loss[-50:] if math.isfinite(v)]
    row: dict[str, Any] = {
        "attention": kind,
        "depth": depth,
        "d_model": width,
        "steps_done": res.steps_done,
        "tokens": res.steps_done * args.batch_size * args.seq_len,
        "final_val_bpc": h.val_bpc[-1] if h.val_bpc and not h.diverged else None,
        "best_val_bpc": min(finite_val) if finite_val else None,
        "final_train_bpc_last50": (sum(tail) / len(tail) / LN2) if tail else None,
        "divergence_events": h.divergence_events,
        "diverged": h.diverged,
        "val_curve": list(zip(h.val_step, h.val_bpc, strict=True)),
        "train_bpc_curve": [(s, v / LN2) for s, v in zip(h.step, h.loss, strict=True)
                            if s % 10 == 0 or s == h.step[-1]],
        "tokens_per_s": (sum(h.tokens_per_s) / len(h.tokens_per_s)) if h.tokens_per_s else None,
        "wall_s": res.wall_s,
        "device": res.device,
    }
    if kind == "contractive_l2" and not h.diverged:
        trunk = res.model.trunk
        consts = trunk.branch_constants()  # type: ignore[operator]
        row["max_branch_lipschitz"] = max(consts)
    if args.test and not h.diverged:
        row["test_bpc"] = evaluate_bpc(res.model, corpus.test, args.eval_tokens)
    return row


def unigram_bpc(corpus: CharCorpus) -> float:
    """Cross-entropy (bits/char) of the validation split under the training split's character
    frequencies (add-one smoothed): the level a model reaches by ignoring context."""
    counts = torch.bincount(corpus.train, minlength=corpus.vocab.size).double() + 1.0
    logp = (counts / counts.sum()).log2()
    return float(-logp[corpus.valid].mean())


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({r["attention"] for r in rows})
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    for kind in kinds:
        rs = sorted((r for r in rows if r["attention"] == kind), key=lambda r: r["depth"])
        depths = [r["depth"] for r in rs]
        bpc = [r["final_val_bpc"] if r["final_val_bpc"] is not None else float("nan")
               for r in rs]
        ax[0].plot(depths, bpc, "o-", label=kind)
        ax[1].plot(depths, [r["divergence_events"] for r in rs], "o-", label=kind)
        deepest = rs[-1]
        steps = [s for s, _ in deepest["train_bpc_curve"]]
        ax[2].plot(steps, [v for _, v in deepest["train_bpc_curve"]], lw=0.8,
                   label=f"{kind}, depth {deepest['depth']}")
    ax[0].set(xlabel="layers", ylabel="final validation bits/char", title=title)
    ax[1].set(xlabel="layers", ylabel="divergence events")
    ax[2].set(xlabel="step", ylabel="training bits/char (deepest)")
    for a in ax:
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8, 12, 16])
    ap.add_argument("--kinds", nargs="+", default=["dp", "l2", "contractive_l2"],
                    choices=list(ATTENTION_NAMES))
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=600, help="steps per configuration (x scale)")
    ap.add_argument("--lr", type=float, default=1e-3, help="the fixed Adam learning rate")
    ap.add_argument("--c", type=float, default=0.9)
    ap.add_argument("--activation", default="relu")
    ap.add_argument("--post-norm", action="store_true",
                    help="post-norm blocks for dp/l2 (default pre-norm)")
    ap.add_argument("--scale", type=int, default=1,
                    help="multiply steps by K and width by round(sqrt(K)) (GPU runs)")
    ap.add_argument("--evals", type=int, default=4, help="validation evaluations per run")
    ap.add_argument("--eval-tokens", type=int, default=32768)
    ap.add_argument("--test", action="store_true", help="also report test bpc")
    ap.add_argument("--corpus", default="ptb", help="'ptb' or a path to a UTF-8 text file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--name", default="depth_stability")
    args = ap.parse_args()
    if args.scale < 1:
        ap.error("--scale must be >= 1")
    torch.set_num_threads(args.threads)
    width = args.d_model * max(1, round(math.sqrt(args.scale)))
    if width % args.heads:
        ap.error(f"width {width} is not divisible by --heads {args.heads}")
    corpus = (ptb_corpus() if args.corpus == "ptb"
              else text_corpus(Path(args.corpus).read_text(encoding="utf-8"), args.corpus,
                               min_split_chars=args.seq_len + 1))
    t0 = time.perf_counter()
    unigram = unigram_bpc(corpus)
    rows = []
    for depth in args.depths:
        for kind in args.kinds:
            row = run_one(corpus, kind, depth, args, width)
            # Divergence events catch blow-ups; a run that never learns past the unigram
            # statistics (the post-norm DP failure mode) is caught here.
            row["failed_to_train"] = row["final_val_bpc"] is None or \
                row["final_val_bpc"] > unigram - 0.1
            rows.append(row)
            print(f"{kind:15s} depth {depth:3d}: final val bpc {row['final_val_bpc']}, "
                  f"events {row['divergence_events']}, {row['wall_s']:.0f} s", file=sys.stderr)
    # DP at the same depth is the baseline of each row.
    for r in rows:
        base = next((b for b in rows if b["attention"] == "dp" and b["depth"] == r["depth"]),
                    None)
        if base is not None and base["final_val_bpc"] is not None \
                and r["final_val_bpc"] is not None:
            r["val_bpc_minus_dp"] = r["final_val_bpc"] - base["final_val_bpc"]
    report = {
        "benchmark": "depth_stability",
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "width": width,
        "optimizer": "Adam (AdamW, weight_decay=0), fixed lr, no warmup, no clipping",
        "corpus": corpus.name,
        "vocab_size": corpus.vocab.size,
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "total_wall_s": time.perf_counter() - t0,
        "unigram_val_bpc": unigram,
        "runs": rows,
        "summary": [{k: r.get(k) for k in ("attention", "depth", "final_val_bpc",
                                           "best_val_bpc", "divergence_events", "diverged",
                                           "failed_to_train",
                                           "val_bpc_minus_dp", "tokens_per_s")}
                    for r in rows],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{args.name}.json"
    json_path.write_text(json.dumps(report, indent=1))
    plot(rows, args.out / f"{args.name}.png",
         f"fixed-lr Adam {args.lr:g}, D={width}, {corpus.name}")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
