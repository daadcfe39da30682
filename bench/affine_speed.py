"""Seconds per affine walk (lsa_models.engine.drivers.margins.margin_lower_bounds) on the trained
digits ViTs of bench/trained/, this tree beside a baseline revision in the same run, and the
margins' lower bounds of both compared: a faster walk must give every margin a lower bound at least
the baseline's (equal where the change only restructures the arithmetic).

The baseline is checked out with `git worktree add` (removed at the end) and each walk runs in
a child process whose imports resolve to one tree (PYTHONPATH), one thread, the centre's forward
pass shared by the walks of one image (driver.Centre, as the radius search shares it) and timed
apart. Per model: the first K correctly classified test images, at each (norm, radius) the
stages of the radius search (plain, second order; eigenvalues on the 2-ball).

Writes bench/out/affine_speed/results.json and results.png. Run bench/trained/train.py first
(`--only timm_vit torch_encoder_vit lsa_l2_vit`).

    .venv/bin/python bench/affine_speed.py [--base REV] [--models ...] [--k 2]
                                           [--inf 0.005] [--two 0.05] [--stages plain quad eig]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out" / "affine_speed"
TRAINED = ROOT / "bench" / "out" / "trained"
MODELS = ("timm_vit", "torch_encoder_vit", "lsa_l2_vit")
STAGES = {"plain": (False, False), "quad": (True, False), "eig": (True, True)}


def worker(args: argparse.Namespace) -> None:
    """In the child: walk the requested stages on one image and print one JSON line."""
    sys.path.insert(0, args.root)
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from bench.trained.models import digits
    from lsa_models.analysis import load_model_bytes
    from lsa_models.engine.drivers.centre import Centre
    from lsa_models.engine.drivers.margins import margin_lower_bounds
    from lsa_models.engine.routes.certify import centre_margins
    from service.bounds.local import model_input

    loaded = load_model_bytes((TRAINED / f"{args.model}.onnx").read_bytes(),
                              f"{args.model}.onnx")
    _, _, xt, yt = digits()
    x0 = model_input(loaded, xt[args.image:args.image + 1].numpy().astype(np.float64))
    label = int(yt[args.image])
    out: dict[str, Any] = {"label": label, "walks": []}
    om, x, _, margins, pred = centre_margins(loaded, x0, label, args.norm)
    out["predicted"] = pred
    t = time.perf_counter()
    ctr = Centre(om, x)
    out["centre_seconds"] = time.perf_counter() - t
    for stage in args.stages:
        quad, eig = STAGES[stage]
        if eig and args.norm != "2":
            continue
        t, tc = time.perf_counter(), time.process_time()
        low = margin_lower_bounds(om, x, args.radius, args.norm, label, ctr, quad=quad,
                                  eig=eig)
        out["walks"].append({"stage": stage, "seconds": time.perf_counter() - t,
                             "cpu_seconds": time.process_time() - tc,
                             "margins": None if low is None else
                             {str(j): v for j, v in sorted(low.items())}})
    print(json.dumps(out))


def run_child(root: Path, model: str, image: int, norm: str, radius: float,
              stages: list[str]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(root), OPENBLAS_NUM_THREADS="1",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--root", str(root),
           "--model", model, "--image", str(image), "--norm", norm, "--radius", str(radius),
           "--stages", *stages]
    res = subprocess.run(cmd, env=env, cwd=str(root), capture_output=True, text=True,
                         check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{root}: {model} image {image}: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def correct_images(model: str, k: int) -> list[int]:
    """The first k test images the model classifies correctly (its ONNX file, float32)."""
    import numpy as np
    import onnxruntime as ort

    sys.path.insert(0, str(ROOT))
    from bench.trained.models import digits

    _, _, xt, yt = digits()
    sess = ort.InferenceSession(str(TRAINED / f"{model}.onnx"),
                                providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    out: list[int] = []
    for i in range(len(yt)):
        y = sess.run(None, {name: xt[i:i + 1].numpy().astype(np.float32)})[0]
        if int(np.argmax(y)) == int(yt[i]):
            out.append(i)
        if len(out) == k:
            break
    return out


def compare(base: dict[str, float] | None, new: dict[str, float] | None) -> dict[str, Any]:
    """How the new walk's margins stand against the baseline's."""
    if base is None or new is None:
        return {"both": False, "new_none": new is None, "base_none": base is None}
    diffs = [new[j] - base[j] for j in base]
    return {"both": True, "identical": all(new[j] == base[j] for j in base),
            "never_looser": all(new[j] >= base[j] for j in base),
            "min_gain": min(diffs), "max_gain": max(diffs),
            "min_margin_base": min(base.values()), "min_margin_new": min(new.values())}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["model"], r["norm"], r["stage"]) for r in results["walks"]})
    base = [statistics.median(r["base_seconds"] for r in results["walks"]
                              if (r["model"], r["norm"], r["stage"]) == key) for key in keys]
    new = [statistics.median(r["new_seconds"] for r in results["walks"]
                             if (r["model"], r["norm"], r["stage"]) == key) for key in keys]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(keys)), 4.5))
    xs = list(range(len(keys)))
    ax.bar([x - 0.2 for x in xs], base, 0.4, label=f"baseline {results['base'][:10]}")
    ax.bar([x + 0.2 for x in xs], new, 0.4, label=f"this tree {results['head'][:10]}")
    ax.set_xticks(xs, [f"{m}\n{'Linf' if n == 'inf' else 'L2'} {s}" for m, n, s in keys],
                  fontsize=7)
    ax.set_ylabel("median seconds per walk (one thread)")
    ax.set_title("affine walk (margin_lower_bounds): seconds per walk")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default=None, help="baseline revision (default: the last "
                    "commit before the fast paths, BASE_REV)")
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--k", type=int, default=2, help="images per model")
    ap.add_argument("--inf", type=float, nargs="*", default=[0.005], help="L_inf radii")
    ap.add_argument("--two", type=float, nargs="*", default=[0.05], help="L2 radii")
    ap.add_argument("--stages", nargs="*", default=list(STAGES), choices=list(STAGES))
    ap.add_argument("--out", type=Path, default=OUT)
    # the child's arguments
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--image", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--norm", help=argparse.SUPPRESS)
    ap.add_argument("--radius", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    missing = [m for m in args.models if not (TRAINED / f"{m}.onnx").exists()]
    if missing:
        sys.exit(f"missing {', '.join(missing)} under {TRAINED}: run "
                 f"`python -m bench.trained.train --only {' '.join(missing)}` first")
    base_rev = args.base or BASE_REV
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    results: dict[str, Any] = {"base": base_rev, "head": head, "walks": [],
                               "note": "one thread per walk; seconds (wall) and cpu seconds "
                                       "(the process's: robust to a busy machine) exclude "
                                       "the centre's forward pass (shared by a search's "
                                       "walks)"}
    with tempfile.TemporaryDirectory() as tmp:
        base_root = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base_root), base_rev],
                       cwd=ROOT, check=True, capture_output=True)
        try:
            _run_all(args, base_root, results)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_root)],
                           cwd=ROOT, check=False, capture_output=True)
    _save(results, args.out)
    return results


def _save(results: dict[str, Any], out: Path) -> None:
    """The results so far (a long run stopped early keeps what it measured)."""
    _summarise(results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, out / "results.png")


def _run_all(args: argparse.Namespace, base_root: Path, results: dict[str, Any]) -> None:
    radii = [("inf", r) for r in args.inf] + [("2", r) for r in args.two]
    images = {model: correct_images(model, args.k) for model in args.models}
    # every model at the first radius before the next radius
    for norm, radius in radii:
        for model in args.models:
            for image in images[model]:
                stages = [s for s in args.stages if norm == "2" or s != "eig"]
                # alternate which tree runs first: the machine's load drifts
                order = [(ROOT, "new"), (base_root, "base")]
                got = {tag: run_child(root, model, image, norm, radius, stages)
                       for root, tag in (order if image % 2 == 0 else order[::-1])}
                new, base = got["new"], got["base"]
                for wb, wn in zip(base["walks"], new["walks"], strict=True):
                    row = {"model": model, "image": image, "norm": norm, "radius": radius,
                           "stage": wn["stage"], "base_seconds": wb["seconds"],
                           "new_seconds": wn["seconds"], "base_cpu": wb["cpu_seconds"],
                           "new_cpu": wn["cpu_seconds"],
                           "speedup": wb["seconds"] / max(wn["seconds"], 1e-9),
                           "base_margins": wb["margins"], "new_margins": wn["margins"],
                           **compare(wb["margins"], wn["margins"])}
                    results["walks"].append(row)
                    print(f"{model:18s} img {image:3d} {norm:>3s} {radius:<6g} "
                          f"{row['stage']:5s} base {wb['seconds']:6.2f} s  new "
                          f"{wn['seconds']:6.2f} s  x{row['speedup']:.2f} (cpu "
                          f"{wb['cpu_seconds']:.2f} / {wn['cpu_seconds']:.2f} s)  "
                          f"identical={row.get('identical')} "
                          f"never_looser={row.get('never_looser')}", flush=True)
                _save(results, args.out)


def _summarise(results: dict[str, Any]) -> None:
    rows = results["walks"]
    groups: dict[str, dict[str, Any]] = {}
    for r in rows:
        key = f"{r['model']} {r['norm']} {r['stage']}"
        g = groups.setdefault(key, {"base": [], "new": [], "base_cpu": [], "new_cpu": []})
        for k in ("base", "new"):
            g[k].append(r[f"{k}_seconds"])
            g[f"{k}_cpu"].append(r[f"{k}_cpu"])
    results["summary"] = {
        k: {"median_base_seconds": statistics.median(g["base"]),
            "median_new_seconds": statistics.median(g["new"]),
            "median_base_cpu": statistics.median(g["base_cpu"]),
            "median_new_cpu": statistics.median(g["new_cpu"]),
            "speedup": statistics.median(g["base"]) / max(statistics.median(g["new"]), 1e-9),
            "cpu_speedup": statistics.median(g["base_cpu"])
            / max(statistics.median(g["new_cpu"]), 1e-9)}
        for k, g in groups.items()}
    # a walk the baseline could not finish may give anything; one it finished must stay
    results["all_never_looser"] = all(r["never_looser"] if r["both"] else r["base_none"]
                                      for r in rows)
    results["all_identical"] = all(r.get("identical", False) for r in rows)


# the last commit before the linear and layout ops' fast paths (a baseline must have the
# engine's sub-package layout: the worker imports drivers/ and routes/)
BASE_REV = "959cc08"

if __name__ == "__main__":
    main()
