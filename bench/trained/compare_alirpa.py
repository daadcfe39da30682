"""lsa beside auto_LiRPA (CROWN, alpha-CROWN) on the digits classifiers of train.py, in one
run, on the same images and balls. Per model, the first K correctly classified test images;
per image and norm (L_inf radii 0.005, 0.01, 0.02; L2 radii 0.05, 0.1, 0.25; the whole ball,
not clipped to [0, 1], the set both certify):

- lsa: `lsa_models.engine.routes.at_radius.decide` (without the radius sweep, the set mode's
  faster route) at each radius, ascending, stopping at the first not certified (a larger
  ball is not certified where a smaller one is not; an attacked one is attacked); lsa's
  certified radius by a geometric bisection of decide's verdicts between the grid's largest
  certified and smallest not certified radius (to a ratio of 1 + BISECT_TOL; halving below
  the grid). `lsa_models.engine.routes.certify.robustness`'s own radius search takes minutes per
  image on these ViTs, so it is run (with --search) only within what is left of a model's
  time.
- auto_LiRPA: bench/trained/alirpa.py in its own venv (bench/out/alirpa/venv), one
  subprocess per model: CROWN and alpha-CROWN at each radius, CROWN's certified radius by
  the same bisection (the same tolerance), with conv_mode='matrix' and
  compare_crown_with_ibp=True (the tighter of CROWN and IBP at every node: the baseline at
  its best).

Each side has a time budget per model, half for each norm (images are taken in order until
it is spent), and a cap per call; the comparison is made, per norm, on the images both
sides finished. Writes
bench/out/trained/alirpa.json and .png: per model and radius the certified accuracy of lsa,
CROWN and alpha-CROWN, per image the radius ratio lsa / CROWN, and whether the targets hold
(radius >= 1.5x CROWN's on every image where CROWN certifies a radius, certified accuracy >=
alpha-CROWN's at every radius). One thread, one process at a time.

    .venv/bin/python bench/trained/compare_alirpa.py [--only ...] [--k 10]
        [--lsa-seconds 150] [--alirpa-seconds 150] [--cap 60]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.trained.models import MODELS, digits  # noqa: E402
from bench.trained.train import OUT, load_trained  # noqa: E402

RADII = {"inf": (0.005, 0.01, 0.02), "2": (0.05, 0.1, 0.25)}
METHODS = ("CROWN", "alpha-CROWN")
BISECT_TOL = 0.1
HALVINGS = 6
RATIO_TARGET = 1.5
ALIRPA_PY = OUT.parent / "alirpa" / "venv" / "bin" / "python"
RUNNER = Path(__file__).resolve().parent / "alirpa.py"
BOUND_OPTS = {"conv_mode": "matrix", "compare_crown_with_ibp": True}
# where train.py's files are looked for, in order
MODEL_DIRS = (OUT, OUT.parent / "alirpa" / "trained")


class _Cap(Exception):
    pass


def _alarm(_signum: int, _frame: Any) -> None:
    raise _Cap


def model_dir(name: str) -> Path | None:
    return next((d for d in MODEL_DIRS if (d / f"{name}.safetensors").is_file()
                 and (d / f"{name}.onnx").is_file()), None)


def first_correct(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, k: int
                  ) -> list[int]:
    with torch.no_grad():
        pred = model(x).argmax(1)
    return [int(i) for i in torch.nonzero(pred == y).flatten()[:k]]


# ---------------------------------------------------------------- lsa

class LsaImage:
    """lsa's verdicts on one image and norm under a per-call cap and a deadline."""

    def __init__(self, om: Any, x: np.ndarray, label: int, norm: str, cap: float,
                 deadline: float) -> None:
        self.om, self.x, self.label, self.norm = om, x, label, norm
        self.cap, self.deadline = cap, deadline
        self.calls: list[dict[str, Any]] = []

    def decide(self, radius: float) -> dict[str, Any]:
        from lsa_models.engine.routes.at_radius import decide

        left = self.deadline - time.monotonic()
        if left <= 1:
            return {"status": "skipped", "seconds": 0.0}
        t0 = time.monotonic()
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(max(1, math.ceil(min(self.cap, left))))
        try:
            v = decide(self.om, self.x, self.label, self.norm, radius, sweep=False)
            cell: dict[str, Any] = {"status": v.status, "certified_by": v.certified_by,
                                    "flip_distance": v.flip_distance}
        except _Cap:
            cell = {"status": "cap"}
        except Exception as exc:  # a failure is a result of the bench
            cell = {"status": "error", "message": f"{type(exc).__name__}: {exc}"[:300]}
        finally:
            signal.alarm(0)
        cell["seconds"] = time.monotonic() - t0
        self.calls.append({"radius": radius, **cell})
        return cell

    def grid(self, radii: tuple[float, ...]) -> dict[str, Any]:
        cells: dict[str, Any] = {}
        stop: str | None = None
        for r in sorted(radii):
            if stop is not None:
                cells[str(r)] = {"status": stop, "seconds": 0.0, "inferred": True}
                continue
            cells[str(r)] = c = self.decide(r)
            if c["status"] != "certified":
                stop = c["status"] if c["status"] in ("attacked", "skipped") else "unknown"
        return cells

    def radius(self, cells: dict[str, Any]) -> dict[str, Any]:
        """The largest radius decide certifies, by geometric bisection from the grid."""
        t0 = time.monotonic()
        rs = sorted(float(r) for r in cells)
        ok = [r for r in rs if cells[str(r)]["status"] == "certified"]
        no = [r for r in rs if cells[str(r)]["status"] in ("attacked", "unknown", "cap")]
        if not ok and not no:
            return {"radius": None, "outcome": "skipped", "seconds": 0.0}
        lo, hi = (max(ok) if ok else 0.0), (min(no) if no else None)
        n0 = len(self.calls)
        done = True

        def certified(eps: float) -> bool | None:
            st = self.decide(eps)["status"]
            return None if st in ("skipped", "error") else st == "certified"

        while hi is None and done:  # every grid radius certified: double
            v = certified(lo * 2)
            if v is None:
                done = False
            elif v:
                lo *= 2
            else:
                hi = lo * 2
        for _ in range(HALVINGS):
            if lo > 0 or hi is None or not done:
                break
            v = certified(hi / 2)
            if v is None:
                done = False
            elif v:
                lo = hi / 2
            else:
                hi = hi / 2
        while done and lo > 0 and hi is not None and hi / lo > 1 + BISECT_TOL:
            mid = math.sqrt(lo * hi)
            v = certified(mid)
            if v is None:
                done = False
            elif v:
                lo = mid
            else:
                hi = mid
        return {"radius": lo, "upper": hi, "outcome": "ok" if done else "partial",
                "calls": len(self.calls) - n0, "seconds": time.monotonic() - t0}


def lsa_model(name: str, d: Path, xs: np.ndarray, ys: np.ndarray, args: argparse.Namespace
              ) -> dict[str, Any]:
    """lsa on the images (K, 1, 8, 8) of one model: {"images": [...], "seconds"}."""
    from lsa_models.onnx import load_onnx
    from service.bounds.local import model_input

    t0 = time.monotonic()
    om = load_onnx((d / f"{name}.onnx").read_bytes(), f"{name}.onnx")
    load_s = time.monotonic() - t0
    by_i: dict[int, dict[str, Any]] = {}
    for norm, radii in RADII.items():
        # each norm half the model's time: images in order until it is spent
        deadline = time.monotonic() + args.lsa_seconds / len(RADII)
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            if time.monotonic() >= deadline:
                break
            # an image becomes the graph's input: its patches, or one token (a permutation)
            x0 = model_input(SimpleNamespace(onnx=om),
                             x.reshape(1, 1, 8, 8).astype(np.float64))
            img = by_i.setdefault(i, {"i": i, "label": int(y), "norms": {}})
            t1 = time.monotonic()
            li = LsaImage(om, x0, int(y), norm, args.cap, deadline)
            cells = li.grid(radii)
            c: dict[str, Any] = {"grid": cells, "radius": li.radius(cells),
                                 "seconds": time.monotonic() - t1}
            img["norms"][norm] = c
            print(f"  lsa {name} image {i} L{norm}: radius {c['radius'].get('radius')} "
                  f"{c['seconds']:.1f} s", flush=True)
    images = list(by_i.values())
    return {"images": images, "load_seconds": load_s, "seconds": time.monotonic() - t0}


# ---------------------------------------------------------------- auto_LiRPA

def alirpa_model(name: str, d: Path, xs: np.ndarray, ys: np.ndarray, tmp: Path,
                 args: argparse.Namespace) -> dict[str, Any]:
    """The runner in the auto_LiRPA venv on one model (its JSON, partial when killed)."""
    if not ALIRPA_PY.is_file():
        return {"skipped": f"no auto_LiRPA venv at {ALIRPA_PY} (docs: this file's header)"}
    np.save(tmp / f"{name}_x.npy", xs.astype(np.float32))
    np.save(tmp / f"{name}_y.npy", ys.astype(np.int64))
    spec = {"name": name, "weights": str(d / f"{name}.safetensors"),
            "images": str(tmp / f"{name}_x.npy"), "labels": str(tmp / f"{name}_y.npy"),
            "radii": {k: list(v) for k, v in RADII.items()}, "methods": list(METHODS),
            "bisect": True, "bisect_tol": BISECT_TOL, "cap_seconds": args.cap,
            "model_seconds": args.alirpa_seconds,
            "memory_gb": args.memory_gb, "bound_opts": BOUND_OPTS}
    (tmp / f"{name}_spec.json").write_text(json.dumps(spec))
    out = tmp / f"{name}_alirpa.json"
    t0 = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.Popen([str(ALIRPA_PY), str(RUNNER), str(tmp / f"{name}_spec.json"),
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    killed = False
    try:
        _, err = proc.communicate(timeout=args.alirpa_seconds + 240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this call started, and only it
        _, err = proc.communicate()
        killed = True
    doc: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {}
    doc["wall_seconds"] = time.monotonic() - t0
    doc["returncode"] = proc.returncode
    if killed:
        doc["killed"] = "past the model's time budget"
    if proc.returncode not in (0, None) and not doc.get("images"):
        doc["stderr_tail"] = [ln for ln in err.splitlines() if "arn" not in ln][-5:]
    for line in err.splitlines():
        if f"{name} image" in line:
            print("  auto_LiRPA " + line, flush=True)
    return doc


# ---------------------------------------------------------------- the comparison

def _alirpa_ok(cell: dict[str, Any] | None) -> bool | None:
    """A runner cell: True verified, False not verified, None no answer."""
    if cell is None:
        return None
    o = cell.get("outcome")
    if o in ("verified", "verified (CROWN)"):
        return True
    return False if o == "not verified" else None


def _finished(img: dict[str, Any], norm: str, key: str | None) -> bool:
    """The image's cells in `norm` are all there and none was skipped (key "status": an
    lsa cell; None: a runner cell, one per method)."""
    grid = img.get("norms", {}).get(norm, {}).get("grid")
    if not grid:
        return False
    cells = grid.values() if key else [c for row in grid.values() for c in row.values()]
    return all(c.get(key or "outcome") != "skipped" for c in cells)


def compare(lsa: dict[str, Any], base: dict[str, Any], bab: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    """The comparison of one model: per norm, on the images both sides finished, the
    certified accuracy of lsa, CROWN and alpha-CROWN at each radius (a method's "no
    answer" (cap, OOM, error) counts as not certified; `answered` says how many it
    answered), the per-image radii and their ratio lsa / CROWN (where both bisections
    finished), and the targets; with `bab` (bench/trained/abcrown.py's rows of this model)
    also alpha-beta-CROWN's certified accuracy where it ran on the same images."""
    limgs = {im["i"]: im for im in lsa.get("images", [])}
    bimgs = {im["i"]: im for im in base.get("images", [])}
    out: dict[str, Any] = {"images_lsa": len(limgs), "images_alirpa": len(bimgs),
                           "norms": {}}
    if base.get("build", {}).get("outcome") not in (None, "ok"):
        out["alirpa_build"] = base["build"]
    for norm, radii in RADII.items():
        # the images both sides finished in this norm (no call skipped for want of time)
        common = [i for i in sorted(set(limgs) & set(bimgs))
                  if _finished(limgs[i], norm, "status")
                  and _finished(bimgs[i], norm, None)]
        acc: dict[str, Any] = {}
        for r in radii:
            row: dict[str, Any] = {}
            lsa_ok = [limgs[i]["norms"][norm]["grid"][str(r)]["status"] == "certified"
                      for i in common]
            row["lsa"] = sum(lsa_ok) / len(common) if common else None
            for m in METHODS:
                got = [_alirpa_ok(bimgs[i]["norms"].get(norm, {}).get("grid", {})
                                  .get(str(r), {}).get(m)) for i in common]
                row[m] = sum(bool(g) for g in got) / len(common) if common else None
                row[f"{m}_answered"] = sum(g is not None for g in got)
            run = (bab or {}).get(norm, {}).get(str(r))
            if run is not None and sorted(run.get("images", [])) == common and common:
                if run.get("status"):  # it answered (a summary), else it failed or ran out
                    row["alpha-beta-CROWN"] = len(set(run["verified"]) & set(common)) \
                        / len(common)
                else:
                    row["alpha-beta-CROWN_no_answer"] = run.get("killed") or "failed"
            acc[str(r)] = row
        per_image = []
        for i in common:
            lrad = limgs[i]["norms"][norm]["radius"]
            lr = lrad.get("radius")
            cr = bimgs[i]["norms"].get(norm, {}).get("crown_radius", {}) or {}
            c = cr.get("radius")
            both = lrad.get("outcome") == "ok" and cr.get("outcome") == "ok"
            per_image.append({"i": i, "lsa_radius": lr, "crown_radius": c,
                              "lsa_outcome": lrad.get("outcome"),
                              "crown_outcome": cr.get("outcome"),
                              "ratio": lr / c if both and lr is not None and c else None})
        ratios = [p["ratio"] for p in per_image if p["ratio"] is not None]
        # CROWN certified a radius and both bisections finished
        answered = [p for p in per_image if p["crown_radius"] and p["ratio"] is not None]
        out["norms"][norm] = {
            "images_common": len(common), "certified_accuracy": acc, "images": per_image,
            "median_ratio": float(np.median(ratios)) if ratios else None,
            "min_ratio": min(ratios) if ratios else None,
            "crown_answered": len(answered),
            "ratio_target_met": (all(p["ratio"] is not None and p["ratio"] >= RATIO_TARGET
                                     for p in answered) if answered else None),
            "accuracy_target_met": (all(a["lsa"] >= a["alpha-CROWN"] for a in acc.values())
                                    if common else None),
            "accuracy_target_met_bab": (all(a["lsa"] >= a["alpha-beta-CROWN"]
                                            for a in acc.values() if "alpha-beta-CROWN" in a)
                                        if any("alpha-beta-CROWN" in a for a in acc.values())
                                        else None),
        }
    return out


def table(results: dict[str, Any]) -> str:
    head = ("| model | norm | images | lsa / CROWN / alpha-CROWN / BaB cert. acc. per radius "
            "| median (min) radius ratio lsa/CROWN | CROWN radii "
            "| targets (ratio, acc., acc. BaB) |")
    lines = [head, "|---|---|---|---|---|---|---|"]
    for name, m in results["models"].items():
        cmp = m.get("compare")
        if cmp is None:
            continue
        for norm, s in cmp["norms"].items():
            cells = []
            for r, a in s["certified_accuracy"].items():
                f = ["-" if a.get(k) is None else f"{a[k]:.1f}"
                     for k in ("lsa", *METHODS, "alpha-beta-CROWN")]
                cells.append(f"{r}: {'/'.join(f)}")
            med = "-" if s["median_ratio"] is None else \
                f"{s['median_ratio']:.2f} ({s['min_ratio']:.2f})"
            lines.append(f"| {name} | {norm} | {s['images_common']} | {'; '.join(cells)} | "
                         f"{med} | {s['crown_answered']} | {s['ratio_target_met']}, "
                         f"{s['accuracy_target_met']}, {s['accuracy_target_met_bab']} |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, m in results["models"].items() if m.get("compare")]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9), squeeze=False)
    for col, norm in enumerate(RADII):
        ax, sc = axes[0][col], axes[1][col]
        w = 0.8 / max(len(names), 1)
        for j, name in enumerate(names):
            acc = results["models"][name]["compare"]["norms"][norm]["certified_accuracy"]
            for k, (meth, hatch) in enumerate((("lsa", ""), ("CROWN", "//"),
                                                ("alpha-CROWN", ".."),
                                                ("alpha-beta-CROWN", "xx"))):
                xs = np.arange(len(acc)) * 4.5 + k + j * w - 0.4
                ax.bar(xs, [a.get(meth) or 0 for a in acc.values()], w, color=f"C{j % 10}",
                       hatch=hatch, label=name if k == 0 else None, edgecolor="k", lw=0.3)
        ax.set_xticks([i * 4.5 + 1.5 for i in range(len(RADII[norm]))],
                      [f"r={r}\nlsa | CROWN (//) | a-CROWN (..) | BaB (xx)"
                       for r in RADII[norm]], fontsize=7)
        ax.set(title=f"L{norm}: certified accuracy on the same images", ylim=(0, 1.05))
        ax.legend(fontsize=6)
        for j, name in enumerate(names):
            imgs = results["models"][name]["compare"]["norms"][norm]["images"]
            pts = [(p["crown_radius"], p["lsa_radius"]) for p in imgs
                   if p["crown_radius"] and p["lsa_radius"] is not None]
            if pts:
                sc.scatter(*zip(*pts, strict=True), color=f"C{j % 10}", s=16, label=name)
        lo, lim = RADII[norm][0] / 4, RADII[norm][-1] * 4
        sc.plot([lo, lim], [lo, lim], "k:", lw=0.8)
        sc.plot([lo, lim], [1.5 * lo, 1.5 * lim], "r--", lw=0.8, label="1.5x")
        sc.set(xscale="log", yscale="log", xlabel="CROWN certified radius",
               ylabel="lsa certified radius", title=f"L{norm}: radius per image")
        sc.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def recompare(path: Path) -> dict[str, Any]:
    results: dict[str, Any] = json.loads(path.read_text())
    bab_path = path.with_name("abcrown.json")
    bab = json.loads(bab_path.read_text())["models"] if bab_path.is_file() else {}
    for name, m in results["models"].items():
        if name in bab:
            m["abcrown"] = bab[name]
        m["compare"] = compare(m["lsa"], m["auto_lirpa"], m.get("abcrown"))
    path.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, path.with_suffix(".png"))
    print(table(results))
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", choices=sorted(MODELS), default=None)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--lsa-seconds", type=float, default=150.0, help="lsa's time per model")
    ap.add_argument("--alirpa-seconds", type=float, default=150.0,
                    help="auto_LiRPA's time per model (the runner's budget)")
    ap.add_argument("--cap", type=float, default=60.0, help="seconds per bound call")
    ap.add_argument("--memory-gb", type=float, default=6.0, help="auto_LiRPA's address space")
    ap.add_argument("--out", type=Path, default=OUT / "alirpa.json")
    ap.add_argument("--recompare", action="store_true", help="nothing is run: the comparison, "
                    "table and PNG again from --out, with abcrown.json's rows beside it")
    args = ap.parse_args(argv)
    if args.recompare:
        return recompare(args.out)
    torch.set_num_threads(1)
    _, _, x_te, y_te = digits()
    results: dict[str, Any] = {
        "k": args.k, "radii": RADII, "methods": list(METHODS), "cap_seconds": args.cap,
        "lsa_seconds_per_model": args.lsa_seconds,
        "alirpa_seconds_per_model": args.alirpa_seconds, "memory_gb": args.memory_gb,
        "bound_opts": BOUND_OPTS, "bisect_tol": BISECT_TOL, "torch_threads": 1,
        "cpu_count": os.cpu_count(), "models": {}}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or list(MODELS):
            d = model_dir(name)
            if d is None:
                print(f"{name}: not trained (run train.py)", flush=True)
                continue
            idx = first_correct(load_trained(name, d), x_te, y_te, args.k)
            xs, ys = x_te[idx].numpy(), y_te[idx].numpy()
            print(f"{name}: {len(idx)} images", flush=True)
            base = alirpa_model(name, d, xs, ys, Path(tmp), args)
            lsa = lsa_model(name, d, xs, ys, args)
            results["models"][name] = {"describe": MODELS[name].describe,
                                       "test_indices": idx, "lsa": lsa, "auto_lirpa": base,
                                       "compare": compare(lsa, base)}
            results["seconds"] = time.monotonic() - t0
            args.out.write_text(json.dumps(results, indent=1) + "\n")  # after each model
    plot(results, args.out.with_suffix(".png"))
    print(table(results))
    print(f"wrote {args.out} and .png ({results['seconds']:.0f} s)")
    return results


if __name__ == "__main__":
    main()
