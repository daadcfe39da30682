"""lsa on the models people train: the digits classifiers of train.py, tried as a user would,
with `lsa robustness MODEL.onnx --at IMAGE.npy --label Y --norm N --json` (the radius search:
certified radius and PGD attack radius), one process per image under a wall-clock cap, beside
the bench's own PGD. Per model:

- clean test accuracy (500 images) and PGD accuracy at L_inf {0.005, 0.01, 0.02} and
  L2 {0.05, 0.1, 0.25} (pixels kept in [0, 1]; robust = no restart flips the label);
- on the first K correctly classified test images, each norm: lsa's certified radius, its
  route, its attack radius, its seconds (certify, attack, wall with the process start), or
  the cap it ran into, or the refusal message (exit 2; the model is then not tried again in
  that norm); the bench's own smallest PGD flip radius (bisection);
- certified accuracy of the K images at each radius (certified radius >= r; an image that ran
  into the cap counts as not certified); with --decide also `lsa robustness --radius r`'s
  verdict at each radius (certified / attacked / unknown), one capped process each;
- soundness: an image certified at a radius where any attack (the bench's PGD or lsa's own)
  flips it is listed under "unsound" (lsa's ball is not clipped to [0, 1], so it holds more
  points than the attacks search: a certificate there covers the clipped ball too).

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
                 norm: str, steps: int, restarts: int) -> float:
    """The fraction of images PGD does not flip at radius `eps` (an upper bound on the
    robust accuracy)."""
    adv = pgd(model, x, y, eps, norm, steps=steps, restarts=restarts)
    with torch.no_grad():
        return float((model(adv).argmax(1) == y).float().mean())


def attack_radius(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, norm: str,
                  steps: int, restarts: int, iters: int = 12) -> list[float | None]:
    """Per image, the smallest radius (to a bisection's precision) at which the bench's PGD
    flips the label: every image's ball of that radius holds a flip. None: no flip found
    even at ATTACK_HI."""
    lo = torch.zeros(len(y), dtype=torch.float64)
    hi = torch.full((len(y),), ATTACK_HI[norm], dtype=torch.float64)

    def flips(eps: torch.Tensor) -> torch.Tensor:
        adv = pgd(model, x, y, eps, norm, steps=steps, restarts=restarts)
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


def lsa_image(onnx: Path, image: Path, label: int, norm: str, cap: float,
              decide: bool) -> dict[str, Any]:
    """lsa's radius search on one image (and with `decide` its verdict at each radius)."""
    common = [str(onnx), "--at", str(image), "--label", str(label), "--norm", norm]
    r = lsa_call(common, cap)
    row: dict[str, Any] = {"outcome": r["outcome"], "wall_seconds": r["wall_seconds"]}
    if r["outcome"] == "ok":
        j = r["json"]
        row.update(certified_radius=j["certified_radius"], certified_by=j["certified_by"],
                   lsa_attack_radius=j["attack_radius"], affine_walks=j["affine_walks"],
                   seconds=j["seconds"])
    elif "message" in r:
        row["message"] = r["message"]
    if decide and r["outcome"] != "refused":
        row["verdicts"] = {}
        for radius in RADII[norm]:
            v = lsa_call([*common, "--radius", str(radius)], cap)
            cell: dict[str, Any] = {"outcome": v["outcome"], "wall_seconds": v["wall_seconds"]}
            if v["outcome"] == "ok":
                j = v["json"]
                cell.update(status=j["status"], certified_by=j["certified_by"],
                            flip_distance=j["flip_distance"], seconds=j["seconds"])
            row["verdicts"][str(radius)] = cell
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
            str(r): pgd_accuracy(model, x_te, y_te, r, norm, args.pgd_steps, args.restarts)
            for r in RADII[norm]}
    res["pgd_seconds"] = time.monotonic() - t0
    idx = [int(i) for i in torch.nonzero(pred == y_te).flatten()[:args.k]]
    onnx = args.out / f"{name}.onnx"
    for norm in args.norms:
        att = attack_radius(model, x_te[idx], y_te[idx], norm, args.pgd_steps, args.restarts)
        rows: list[dict[str, Any]] = []
        refusal: dict[str, Any] | None = None
        for i, a in zip(idx, att, strict=True):
            image = tmp / f"{name}_{i}.npy"
            np.save(image, x_te[i].numpy().astype(np.float64))  # (1, 8, 8)
            label = int(y_te[i])
            if refusal is not None:  # a refused model is refused on every image
                rows.append({"index": i, "label": label, "outcome": "refused (not tried)",
                             "pgd_attack_radius": a})
                continue
            row = {"index": i, "label": label, "pgd_attack_radius": a,
                   **lsa_image(onnx, image, label, norm, args.cap, args.decide)}
            c = row.get("certified_radius")
            row["ratio"] = c / a if c is not None and a else None
            rows.append(row)
            if row["outcome"] == "refused":
                refusal = row
            print(f"  {name} {norm} image {i}: {row['outcome']}"
                  + (f" certified {c:.4g} ({row['certified_by']}), PGD {a}, "
                     f"{row['wall_seconds']:.1f} s" if c is not None else
                     f" {row.get('message', '')} {row['wall_seconds']:.1f} s"), flush=True)
        res["norms"][norm] = _summary(rows, norm, refusal)
    return res


def _summary(rows: list[dict[str, Any]], norm: str, refusal: dict[str, Any] | None
             ) -> dict[str, Any]:
    k = len(rows)
    walls = [r["wall_seconds"] for r in rows if "wall_seconds" in r]
    ratios = [r["ratio"] for r in rows if r.get("ratio") is not None]
    return {
        "k": k,
        "refused": None if refusal is None else refusal.get("message", ""),
        "capped": sum(r["outcome"] == "cap" for r in rows),
        "certified_accuracy_of_k": {str(r): (sum(certified_at(row, r) for row in rows) / k
                                             if k else None) for r in RADII[norm]},
        "median_ratio": float(np.median(ratios)) if ratios else None,
        "median_wall_seconds": float(np.median(walls)) if walls else None,
        "unsound": {str(r["index"]): u for r in rows if (u := unsound(r, norm))},
        "images": rows,
    }


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
            pts = [(r["pgd_attack_radius"], r["certified_radius"]) for r in s["images"]
                   if r.get("certified_radius") is not None and r.get("pgd_attack_radius")]
            if pts:
                sc.scatter(*zip(*pts, strict=True), color=color, label=name, s=18)
        ax.set(title=f"L{norm}: certified (solid, of the first K correct) and PGD (dashed, "
               "500 test images)", xlabel="radius", ylabel="accuracy", ylim=(-0.03, 1.03))
        ax.title.set_fontsize(8)
        ax.legend(fontsize=7)
        lim = ATTACK_HI[norm] / 4
        sc.plot([0, lim], [0, lim], "k:", lw=0.8)
        sc.set(title=f"L{norm}: lsa certified radius vs PGD attack radius, per image",
               xlabel="PGD attack radius", ylabel="lsa certified radius")
        sc.title.set_fontsize(8)
        sc.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: dict[str, Any]) -> str:
    head = ("| model | norm | clean | PGD acc | lsa cert. acc (of K) | median cert/PGD "
            "radius | median s/image | capped | refused |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for name, m in results["models"].items():
        for norm, s in m["norms"].items():
            pg = " / ".join(f"{v:.2f}" for v in m["pgd_accuracy"][norm].values())
            ce = " / ".join("-" if v is None else f"{v:.2f}"
                            for v in s["certified_accuracy_of_k"].values())
            mr = "-" if s["median_ratio"] is None else f"{s['median_ratio']:.3f}"
            mw = "-" if s["median_wall_seconds"] is None else f"{s['median_wall_seconds']:.1f}"
            lines.append(f"| {name} | {norm} | {m['clean_accuracy']:.3f} | {pg} | {ce} | {mr} "
                         f"| {mw} | {s['capped']}/{s['k']} | {s['refused'] or ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", choices=sorted(MODELS), default=None)
    ap.add_argument("--k", type=int, default=10, help="correctly classified test images "
                    "given to lsa")
    ap.add_argument("--norms", nargs="*", choices=("inf", "2"), default=["inf", "2"])
    ap.add_argument("--cap", type=float, default=120.0, help="wall seconds per lsa process")
    ap.add_argument("--decide", action="store_true", help="also lsa's verdict at each radius")
    ap.add_argument("--pgd-steps", type=int, default=40)
    ap.add_argument("--restarts", type=int, default=2)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    trained = json.loads((args.out / "models.json").read_text())
    data = digits()
    results: dict[str, Any] = {
        "k": args.k, "cap_seconds": args.cap, "radii": RADII, "pgd_steps": args.pgd_steps,
        "restarts": args.restarts, "torch_threads": 1, "cpu_count": os.cpu_count(),
        "models": {}}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or list(MODELS):
            if name not in trained or not trained[name].get("onnx"):
                print(f"{name}: not trained or not exported (run train.py)", flush=True)
                continue
            results["models"][name] = {**run_model(name, data, args, Path(tmp)),
                                       "train": trained[name]}
    results["seconds"] = time.monotonic() - t0
    stem = "results" if args.only is None else "results_" + "_".join(args.only)
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / f"{stem}.png")
    print(table(results))
    print(f"wrote {args.out / stem}.json and .png ({results['seconds']:.0f} s)")
    return results


if __name__ == "__main__":
    main()
