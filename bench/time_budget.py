"""Certified accuracy and seconds per input at one radius with the default time budget
(api_schemas.requests.DEFAULT_DECIDE_BUDGET_S per input) and without one, on the first K test
images of the digits models of bench/trained/ (the 2-layer ViTs by default), each input
decided by lsa_models.engine.routes.at_radius.decide in this process, one thread. Also the radius
search (local.robustness) under its default budget (DEFAULT_RADIUS_BUDGET_S) on the first
images. The unbudgeted verdicts take minutes each on these models: --k-none decides only the
first few images without a budget, and on those the bench checks that a budgeted verdict is
the unbudgeted one or unknown (a stopped search is a prefix of the unbudgeted one).

Writes bench/out/time_budget/time_budget.json and time_budget.png: per model the counts,
certified accuracy, median and largest seconds per input (wall and this process's CPU: the
machine may be shared), the most an input ran past its budget, the steps the budget stopped
before, the projected wall time of a 100-image set on 2 workers, and the machine's load
average while it ran (the budget is wall-clock time: a loaded machine completes fewer steps
in it). Trains the models first (python -m bench.trained.train) where they are missing.

    .venv/bin/python bench/time_budget.py [--models timm_vit ...] [--k 20] [--k-none 3]
                                          [--norm inf] [--radius 0.01] [--search 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api_schemas.requests import DEFAULT_DECIDE_BUDGET_S, DEFAULT_RADIUS_BUDGET_S  # noqa: E402
from bench.trained.models import digits  # noqa: E402
from bench.trained.train import OUT as TRAINED  # noqa: E402

OUT = Path(__file__).resolve().parent / "out" / "time_budget"
VITS = ("timm_vit", "xt_vit", "lsa_l2_vit", "paper_l2_vit")  # the 2-layer D = 32 ViTs
SET_SIZE, SET_WORKERS = 100, 2  # the projection: a 100-image set on 2 cores


def load(name: str) -> Any:
    """The model's ONNX graph as the CLI reads it (training it first where it is missing)."""
    from lsa_models.analysis import load_model_bytes

    path = TRAINED / f"{name}.onnx"
    if not path.is_file():
        from bench.trained.train import main as train

        train(["--only", name])
    return load_model_bytes(path.read_bytes(), path.name)


def verdicts(loaded: Any, images: np.ndarray, labels: np.ndarray, norm: str, radius: float,
             budget: float | None) -> list[dict[str, Any]]:
    """One decide per image (the image cut into the patches the graph reads)."""
    from lsa_models.engine.routes.at_radius import decide
    from service.bounds.local import model_input
    from service.robustness.verdicts import verdict_json

    out = []
    for i, (img, y) in enumerate(zip(images, labels, strict=True)):
        x0 = model_input(loaded, img[None], field="image")
        c0 = time.process_time()  # this process's CPU seconds: the machine may be shared
        v = verdict_json(decide(loaded, x0, int(y), norm, radius, time_budget=budget))
        out.append({"index": i, **v, "cpu_s": time.process_time() - c0})
        print(f"  budget {budget}: image {i} {v['status']} ({v['certified_by'] or v['reason']})"
              f" {v['seconds']:.1f} s wall, {out[-1]['cpu_s']:.1f} s CPU", flush=True)
    return out


def summary(rows: list[dict[str, Any]], budget: float | None = None) -> dict[str, Any]:
    secs = [r["seconds"] for r in rows]
    cpu = [r["cpu_s"] for r in rows]
    counts = Counter(r["status"] for r in rows)
    return {"n": len(rows), "counts": dict(counts),
            "median_cpu_s": statistics.median(cpu) if cpu else None,
            "max_cpu_s": max(cpu) if cpu else None, "total_cpu_s": sum(cpu),
            # the most wall seconds an input ran past its budget (0: none did)
            "max_overrun_s": max(0.0, max(secs) - budget) if secs and budget else None,
            "certified_accuracy": counts["certified"] / max(1, len(rows)),
            "attack_accuracy": (len(rows) - counts["attacked"] - counts["misclassified"])
            / max(1, len(rows)),
            "median_s": statistics.median(secs) if secs else None,
            "max_s": max(secs) if secs else None, "total_s": sum(secs),
            "stopped_by_budget": sum(bool(r["stopped_by_budget"]) for r in rows),
            "certified_by": dict(Counter(r["certified_by"] for r in rows if r["certified_by"])),
            "stopped_before": dict(Counter(_stage(r["reason"]) for r in rows
                                           if r["stopped_by_budget"])),
            "set_of_100_on_2_workers_s": SET_SIZE * statistics.mean(secs) / SET_WORKERS
            if secs else None}


def _stage(reason: str) -> str:
    """The step a budget stopped before, from its reason (the predicted seconds dropped)."""
    for key in (" ran out before ", " would run out in "):
        if key in reason:
            return reason.split(key)[-1].split(" (predicted")[0]
    return reason


def prefix_ok(budgeted: list[dict[str, Any]], free: list[dict[str, Any]]) -> bool:
    """Every budgeted verdict is the unbudgeted one, or unknown because the budget ran out."""
    return all(b["status"] == f["status"] or (b["status"] == "unknown" and b["stopped_by_budget"])
               for b, f in zip(budgeted, free, strict=False))


def searches(loaded: Any, images: np.ndarray, labels: np.ndarray, norm: str
             ) -> list[dict[str, Any]]:
    """The radius search under its default budget."""
    from lsa_models.engine.routes.certify import robustness
    from service.bounds.local import model_input

    out = []
    for i, (img, y) in enumerate(zip(images, labels, strict=True)):
        t = time.monotonic()
        r = robustness(loaded, model_input(loaded, img[None], field="image"), int(y),
                       norm,  # type: ignore[arg-type]
                       time_budget=DEFAULT_RADIUS_BUDGET_S)
        row = {"index": i, "certified_radius": r.certified_radius,
               "attack_radius": r.attack_radius, "certified_by": r.certified_by,
               "stopped_by_budget": r.stopped_by_budget, "stopped_before": r.stopped_before,
               "seconds": time.monotonic() - t}
        out.append(row)
        print(f"  radius search: image {i} {row}", flush=True)
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["models"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(len(names))
    for k, (arm, label) in enumerate((("default", f"{results['budget_s']:g} s budget"),
                                      ("none", "no budget"))):
        acc = [results["models"][n][arm]["certified_accuracy"]
               if results["models"][n].get(arm) else np.nan for n in names]
        med = [results["models"][n][arm]["median_s"]
               if results["models"][n].get(arm) else np.nan for n in names]
        a1.bar(x + 0.4 * k, acc, 0.4, label=label)
        a2.bar(x + 0.4 * k, med, 0.4, label=label)
    for ax, ylabel in ((a1, "certified accuracy"), (a2, "median seconds per input")):
        ax.set_xticks(x + 0.2, names, rotation=20, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    a1.set_ylim(0, 1)
    a2.set_yscale("log")
    fig.suptitle(f"L{results['norm']} radius {results['radius']:g}: default budget vs none "
                 f"(no-budget arm on the first {results['k_none']} images)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(VITS))
    ap.add_argument("--k", type=int, default=20, help="test images with the default budget")
    ap.add_argument("--k-none", type=int, default=3, help="of those, decided without one")
    ap.add_argument("--norm", choices=("inf", "2"), default="inf")
    ap.add_argument("--radius", type=float, default=0.01)
    ap.add_argument("--search", type=int, default=2,
                    help="images whose radius search runs under its default budget")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    _, _, xte, yte = digits()
    images = xte[:args.k].numpy().astype(np.float64)
    labels = yte[:args.k].numpy()
    results: dict[str, Any] = {
        "norm": args.norm, "radius": args.radius, "k": args.k, "k_none": args.k_none,
        "budget_s": DEFAULT_DECIDE_BUDGET_S, "radius_budget_s": DEFAULT_RADIUS_BUDGET_S,
        "cpus": os.cpu_count(), "threads": 1, "models": {}}
    path = args.out / "time_budget.json"
    for name in args.models:
        print(name, flush=True)
        loaded = load(name)
        load0 = os.getloadavg()[0]
        row: dict[str, Any] = {}
        budgeted = verdicts(loaded, images, labels, args.norm, args.radius,
                            DEFAULT_DECIDE_BUDGET_S)
        row["default"] = summary(budgeted, DEFAULT_DECIDE_BUDGET_S)
        free = verdicts(loaded, images[:args.k_none], labels[:args.k_none], args.norm,
                        args.radius, None)
        row["none"] = summary(free) if free else None
        row["default_on_the_none_images"] = summary(budgeted[:args.k_none],
                                                    DEFAULT_DECIDE_BUDGET_S)
        row["budgeted_verdicts_are_prefixes"] = prefix_ok(budgeted, free)
        row["search"] = searches(loaded, images[:args.search], labels[:args.search], args.norm)
        row["load_average"] = [load0, os.getloadavg()[0]]
        row["verdicts"] = {"default": budgeted, "none": free}
        results["models"][name] = row
        path.write_text(json.dumps(results, indent=2) + "\n")  # kept after each model
        print(json.dumps({k: v for k, v in row.items() if k != "verdicts"}), flush=True)
    plot(results, args.out / "time_budget.png")
    return results


if __name__ == "__main__":
    main()
