"""lsa on the models people train: the digits classifiers of train.py, tried as a user would,
with `lsa robustness MODEL.onnx --at IMAGE.npy --label Y --norm N --json` (the radius search:
certified radius and PGD attack radius), one process per image under a wall-clock cap, beside
the bench's own PGD. Per model:

- clean test accuracy (500 images) and PGD accuracy at L_inf {0.005, 0.01, 0.02} and
  L2 {0.05, 0.1, 0.25} (on the whole ball, the set lsa certifies; --clip keeps pixels in
  [0, 1]; robust = no restart flips the label);
- on the first K correctly classified test images, each norm: lsa's certified radius, its
  route, its attack radius, its seconds (certify, attack, wall with the process start), or
  the cap it ran into, or the refusal message (exit 2; the model is then not tried again in
  that norm); the bench's own smallest PGD flip radius (bisection);
- certified accuracy of the K images at each radius (certified radius >= r; an image that ran
  into the cap counts as not certified); with --decide also `lsa robustness --radius r`'s
  verdict at each radius (certified / attacked / unknown), one capped process each;
- soundness: an image certified at a radius where any attack (the bench's PGD or lsa's own)
  flips it is listed under "unsound" (lsa's ball is not clipped to [0, 1]: a certificate
  covers the clipped ball too).

Writes bench/out/trained/results.json and results.png and prints a table. One thread per
process. Run train.py first.

    .venv/bin/python bench/trained/run.py [--only ...] [--k 10] [--norms inf 2] [--cap 120]
                                          [--decide]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.trained.models import MODELS, digits, pgd  # noqa: E402
from bench.trained.train import OUT, load_trained  # noqa: E402

RADII = {"inf": (0.005, 0.01, 0.02), "2": (0.05, 0.1, 0.25)}
# where the bench's bisection of the smallest PGD flip starts (every image flips well inside)
ATTACK_HI = {"inf": 0.5, "2": 4.0}
LSA = Path(sys.executable).with_name("lsa")


def pgd_accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float,
                 norm: str, steps: int, restarts: int, clip: bool) -> float:
    """The fraction of images PGD does not flip at radius `eps` (an upper bound on the
    robust accuracy)."""
    adv = pgd(model, x, y, eps, norm, steps=steps, restarts=restarts, clip=clip)
    with torch.no_grad():
        return float((model(adv).argmax(1) == y).float().mean())


def attack_radius(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, norm: str,
                  steps: int, restarts: int, clip: bool, iters: int = 12
                  ) -> list[float | None]:
    """Per image, the smallest radius (to a bisection's precision) at which the bench's PGD
    flips the label: every image's ball of that radius holds a flip. None: no flip found
    even at ATTACK_HI."""
    lo = torch.zeros(len(y), dtype=torch.float64)
    hi = torch.full((len(y),), ATTACK_HI[norm], dtype=torch.float64)

    def flips(eps: torch.Tensor) -> torch.Tensor:
        adv = pgd(model, x, y, eps, norm, steps=steps, restarts=restarts, clip=clip)
        with torch.no_grad():
            return model(adv).argmax(1) != y

    found = flips(hi)
    for _ in range(iters):
        mid = (lo + hi) / 2
        f = flips(mid)
        hi = torch.where(f, mid, hi)
        lo = torch.where(f, lo, mid)
    return [float(h) if ok else None for h, ok in zip(hi, found, strict=True)]


def lsa_call(args: list[str], cap: float) -> dict[str, Any]:
    """One `lsa robustness ... --json` process under a wall-clock cap: {"outcome": "ok",
    "json": its JSON}, or "refused" with its message (exit 2), "cap" when it ran past `cap`
    seconds (its process group is then ended), "error" otherwise; with "wall_seconds"."""
    t0 = time.monotonic()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.Popen([str(LSA), "robustness", *args, "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=cap)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this call started, and only it
        proc.communicate()
        return {"outcome": "cap", "wall_seconds": time.monotonic() - t0}
    wall = time.monotonic() - t0
    if proc.returncode == 2:
        msg = err.strip().splitlines()
        return {"outcome": "refused", "message": msg[-1] if msg else "", "wall_seconds": wall}
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"outcome": "error", "returncode": proc.returncode,
                "message": (err.strip() or out.strip())[-500:], "wall_seconds": wall}
    return {"outcome": "ok", "json": json.loads(lines[-1]), "wall_seconds": wall}


def lsa_image(onnx: Path, image: Path, labels: Path, label: int, norm: str,
              args: argparse.Namespace) -> dict[str, Any]:
    """lsa on one image: its radius search (unless --no-search) and with --decide its verdict
    at each radius, each one capped process."""
    row: dict[str, Any] = {}
    if args.search:
        r = lsa_call([str(onnx), "--at", str(image), "--label", str(label), "--norm", norm],
                     args.cap)
        row.update(outcome=r["outcome"], wall_seconds=r["wall_seconds"])
        if r["outcome"] == "ok":
            j = r["json"]
            row.update(certified_radius=j["certified_radius"], certified_by=j["certified_by"],
                       lsa_attack_radius=j["attack_radius"], affine_walks=j["affine_walks"],
                       seconds=j["seconds"])
        elif "message" in r:
            row["message"] = r["message"]
        if r["outcome"] == "refused":
            return row
    if args.decide:
        # the set mode on this one image: the per-radius verdict a certified-accuracy gate
        # takes; --no-sweep (its documented faster mode) unless --sweep
        row["verdicts"] = {}
        for radius in RADII[norm]:
            v = lsa_call([str(onnx), "--inputs", str(image), "--labels", str(labels),
                          "--radius", str(radius), "--norm", norm, "--workers", "1",
                          *([] if args.sweep else ["--no-sweep"])], args.cap)
            cell: dict[str, Any] = {"outcome": v["outcome"], "wall_seconds": v["wall_seconds"]}
            if v["outcome"] == "ok":
                j = v["json"]["samples"][0]
                cell.update(status=j["status"], certified_by=j["certified_by"],
                            flip_distance=j["flip_distance"], seconds=j["seconds"],
                            affine_walks=j["affine_walks"])
            elif "message" in v:
                cell["message"] = v["message"]
            row["verdicts"][str(radius)] = cell
            if v["outcome"] == "refused":
                row.setdefault("outcome", "refused")
                row.setdefault("message", v.get("message", ""))
                break
    return row


def certified_at(row: dict[str, Any], radius: float) -> bool:
    """The image is certified at `radius`: by the radius search (its certified radius is at
    least `radius`) or by the verdict at that radius."""
    if row.get("certified_radius") is not None and row["certified_radius"] >= radius:
        return True
    v = row.get("verdicts", {}).get(str(radius), {})
    return v.get("status") == "certified"


def unsound(row: dict[str, Any], norm: str) -> list[str]:
    """What an attack found inside a ball lsa certified (empty when sound)."""
    bad = []
    cert = row.get("certified_radius")
    for who in ("pgd_attack_radius", "lsa_attack_radius"):
        att = row.get(who)
        if cert is not None and att is not None and cert > att:
            bad.append(f"certified radius {cert:.6g} > {who} {att:.6g}")
    for r in RADII[norm]:
        v = row.get("verdicts", {}).get(str(r), {})
        if v.get("status") == "certified" and row.get("pgd_attack_radius") is not None \
                and row["pgd_attack_radius"] <= r:
            bad.append(f"certified at {r} where PGD flips at {row['pgd_attack_radius']:.6g}")
    verdicts = row.get("verdicts", {}).values()
    flips = [v["flip_distance"] for v in verdicts if v.get("status") == "attacked"]
    for r in RADII[norm]:
        v = row.get("verdicts", {}).get(str(r), {})
        if v.get("status") == "certified" and flips and min(flips) <= r:
            bad.append(f"certified at {r} where lsa's attack flips at {min(flips):.6g}")
    return bad


def run_model(name: str, data: tuple[torch.Tensor, ...], args: argparse.Namespace,
              tmp: Path) -> dict[str, Any]:
    model = load_trained(name, args.out)
    for p in model.parameters():
        p.requires_grad_(False)
    _, _, x_te, y_te = data
    with torch.no_grad():
        pred = model(x_te).argmax(1)
    res: dict[str, Any] = {"describe": MODELS[name].describe,
                           "clean_accuracy": float((pred == y_te).float().mean()),
                           "pgd_accuracy": {}, "norms": {}}
    t0 = time.monotonic()
    for norm in args.norms:
        res["pgd_accuracy"][norm] = {
            str(r): pgd_accuracy(model, x_te, y_te, r, norm, args.pgd_steps, args.restarts,
                                 args.clip) for r in RADII[norm]}
    res["pgd_seconds"] = time.monotonic() - t0
    idx = [int(i) for i in torch.nonzero(pred == y_te).flatten()[:args.k]]
    onnx = args.out / f"{name}.onnx"
    for norm in args.norms:
        att = attack_radius(model, x_te[idx], y_te[idx], norm, args.pgd_steps, args.restarts,
                            args.clip)
        rows: list[dict[str, Any]] = []
        refusal: dict[str, Any] | None = None
        for i, a in zip(idx, att, strict=True):
            image, labels = tmp / f"{name}_{i}.npy", tmp / f"{name}_{i}_label.npy"
            np.save(image, x_te[i:i + 1].numpy().astype(np.float64))  # (1, 1, 8, 8)
            label = int(y_te[i])
            np.save(labels, np.array([label], dtype=np.int64))
            if refusal is not None:  # a refused model is refused on every image
                rows.append({"index": i, "label": label, "outcome": "refused (not tried)",
                             "pgd_attack_radius": a})
                continue
            row = {"index": i, "label": label, "pgd_attack_radius": a,
                   **lsa_image(onnx, image, labels, label, norm, args)}
            c = row.get("certified_radius")
            row["ratio"] = c / a if c is not None and a else None
            rows.append(row)
            if row.get("outcome") == "refused":
                refusal = row
            print(f"  {name} {norm} image {i} (PGD flips at {a}): " + _line(row), flush=True)
        res["norms"][norm] = _summary(rows, norm, refusal)
    return res


def _line(row: dict[str, Any]) -> str:
    parts = []
    if "wall_seconds" in row:  # the radius search ran
        c = row.get("certified_radius")
        parts.append(f"search {row['outcome']}"
                     + (f" certified {c:.4g} ({row['certified_by']})" if c is not None else "")
                     + f" {row['wall_seconds']:.1f} s")
    for r, v in row.get("verdicts", {}).items():
        parts.append(f"{r}: {v.get('status', v['outcome'])} {v['wall_seconds']:.1f} s")
    if row.get("message"):
        parts.append(row["message"])
    return "; ".join(parts)


def _verdict_counts(rows: list[dict[str, Any]], norm: str) -> dict[str, Any] | None:
    """Per radius, how many images got each verdict (or ran into the cap, or were
    refused)."""
    if not any("verdicts" in r for r in rows):
        return None
    out: dict[str, Any] = {}
    for rad in RADII[norm]:
        cells = [r.get("verdicts", {}).get(str(rad)) for r in rows]
        words = [c.get("status", c["outcome"]) for c in cells if c is not None]
        out[str(rad)] = {w: words.count(w) for w in sorted(set(words))}
    return out


def _summary(rows: list[dict[str, Any]], norm: str, refusal: dict[str, Any] | None
             ) -> dict[str, Any]:
    k = len(rows)
    walls = [r["wall_seconds"] for r in rows if "wall_seconds" in r]
    verdict_walls = [v["wall_seconds"] for r in rows for v in r.get("verdicts", {}).values()]
    ratios = [r["ratio"] for r in rows if r.get("ratio") is not None]
    return {
        "k": k,
        "refused": None if refusal is None else refusal.get("message", ""),
        "capped": sum(r.get("outcome") == "cap" for r in rows),
        "verdicts_capped": sum(v["outcome"] == "cap" for r in rows
                               for v in r.get("verdicts", {}).values()),
        "verdict_counts": _verdict_counts(rows, norm),
        "median_verdict_wall_seconds": (float(np.median(verdict_walls)) if verdict_walls
                                        else None),
        "certified_accuracy_of_k": {str(r): (sum(certified_at(row, r) for row in rows) / k
                                             if k else None) for r in RADII[norm]},
        "median_ratio": float(np.median(ratios)) if ratios else None,
        "median_wall_seconds": float(np.median(walls)) if walls else None,
        "unsound": {str(r["index"]): u for r in rows if (u := unsound(r, norm))},
        "images": rows,
    }


def _certified_radius(row: dict[str, Any], norm: str) -> float | None:
    """The radius search's certified radius, else the largest radius certified by a verdict
    (0 when none was; None when lsa did not answer)."""
    if row.get("certified_radius") is not None:
        return float(row["certified_radius"])
    if not row.get("verdicts"):
        return None
    return max([r for r in RADII[norm] if certified_at(row, r)], default=0.0)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    norms = [n for n in ("inf", "2") if any(n in m["norms"] for m in results["models"].values())]
    fig, axes = plt.subplots(2, len(norms), figsize=(6.5 * len(norms), 9), squeeze=False)
    for col, norm in enumerate(norms):
        ax, sc = axes[0][col], axes[1][col]
        for i, (name, m) in enumerate(results["models"].items()):
            if norm not in m["norms"]:
                continue
            color = f"C{i % 10}"
            rs = [0.0, *RADII[norm]]
            ax.plot(rs, [m["clean_accuracy"], *m["pgd_accuracy"][norm].values()], "--",
                    color=color, alpha=0.6)
            s = m["norms"][norm]
            cert = [1.0, *s["certified_accuracy_of_k"].values()]
            ax.plot(rs, cert, "o-", color=color,
                    label=name + (" (refused)" if s["refused"] is not None else ""))
            pts = [(r["pgd_attack_radius"], c) for r in s["images"]
                   if (c := _certified_radius(r, norm)) is not None and r.get("pgd_attack_radius")]
            if pts:
                sc.scatter(*zip(*pts, strict=True), color=color, label=name, s=18)
        ax.set(title=f"L{norm}: certified (solid, of the first K correct) and PGD (dashed, "
               "500 test images)", xlabel="radius", ylabel="accuracy", ylim=(-0.03, 1.03))
        ax.title.set_fontsize(8)
        ax.legend(fontsize=7)
        lim = ATTACK_HI[norm] / 4
        sc.plot([0, lim], [0, lim], "k:", lw=0.8)
        sc.set(title=f"L{norm}: lsa certified radius (search, else largest certified verdict) "
               "vs PGD attack radius, per image",
               xlabel="PGD attack radius", ylabel="lsa certified radius")
        sc.title.set_fontsize(8)
        sc.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: dict[str, Any]) -> str:
    head = ("| model | norm | clean | PGD acc | lsa cert. acc (of K) | median cert/PGD "
            "radius | median s (search/verdict) | capped (search/verdicts) | refused |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for name, m in results["models"].items():
        for norm, s in m["norms"].items():
            pg = " / ".join(f"{v:.2f}" for v in m["pgd_accuracy"][norm].values())
            ce = " / ".join("-" if v is None else f"{v:.2f}"
                            for v in s["certified_accuracy_of_k"].values())
            mr = "-" if s["median_ratio"] is None else f"{s['median_ratio']:.3f}"
            mw = "/".join("-" if v is None else f"{v:.1f}" for v in (
                s["median_wall_seconds"], s["median_verdict_wall_seconds"]))
            lines.append(f"| {name} | {norm} | {m['clean_accuracy']:.3f} | {pg} | {ce} | {mr} "
                         f"| {mw} | {s['capped']}, {s['verdicts_capped']} of {s['k']} images | "
                         f"{s['refused'] or ''} |")
    return "\n".join(lines)


def replot(path: Path) -> dict[str, Any]:
    results = json.loads(path.read_text())
    for m in results["models"].values():
        for norm, s in m["norms"].items():
            refusal = next((r for r in s["images"] if r.get("outcome") == "refused"), None)
            m["norms"][norm] = _summary(s["images"], norm, refusal)
    path.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, path.with_suffix(".png"))
    print(table(results))
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", choices=sorted(MODELS), default=None)
    ap.add_argument("--k", type=int, default=10, help="correctly classified test images "
                    "given to lsa")
    ap.add_argument("--norms", nargs="*", choices=("inf", "2"), default=["inf", "2"])
    ap.add_argument("--cap", type=float, default=120.0, help="wall seconds per lsa process")
    ap.add_argument("--decide", action="store_true", help="also lsa's verdict at each radius "
                    "(the set mode on each image)")
    ap.add_argument("--sweep", action="store_true", help="with --decide: let the verdicts try "
                    "the radius sweep (minutes per input on these models)")
    ap.add_argument("--no-search", dest="search", action="store_false",
                    help="skip the radius search (with --decide: the verdicts only)")
    ap.add_argument("--pgd-steps", type=int, default=40)
    ap.add_argument("--restarts", type=int, default=2)
    ap.add_argument("--clip", action="store_true", help="the attacks keep pixels in [0, 1] "
                    "(default: the whole ball, the set lsa certifies)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--replot", type=Path, default=None, help="recompute the summaries, table "
                    "and PNG of a results JSON this script wrote (nothing is run)")
    args = ap.parse_args(argv)
    if args.replot is not None:
        return replot(args.replot)
    torch.set_num_threads(1)
    trained = json.loads((args.out / "models.json").read_text())
    data = digits()
    results: dict[str, Any] = {
        "k": args.k, "cap_seconds": args.cap, "radii": RADII, "pgd_steps": args.pgd_steps,
        "restarts": args.restarts, "torch_threads": 1, "cpu_count": os.cpu_count(),
        "clip": args.clip, "search": args.search, "decide": args.decide,
        "verdict_sweep": args.sweep,
        # where the lsa processes import lsa from (a snapshot of a commit, or the work tree)
        "lsa_pythonpath": os.environ.get("PYTHONPATH"),
        "models": {}}
    t0 = time.monotonic()
    stem = "_".join(["results", *(args.only or []),
                     *([f"l{args.norms[0]}"] if len(args.norms) == 1 else [])])
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or list(MODELS):
            if name not in trained or not trained[name].get("onnx"):
                print(f"{name}: not trained or not exported (run train.py)", flush=True)
                continue
            results["models"][name] = {**run_model(name, data, args, Path(tmp)),
                                       "train": trained[name]}
            results["seconds"] = time.monotonic() - t0
            # written after each model: a run stopped early keeps what it measured
            (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / f"{stem}.png")
    print(table(results))
    print(f"wrote {args.out / stem}.json and .png ({results['seconds']:.0f} s)")
    return results


if __name__ == "__main__":
    main()
