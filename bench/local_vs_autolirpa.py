"""Local Lipschitz constants and robustness radii on the three classifiers of
bench/local_models.py (an MLP,
1- and 2-layer pre-norm Transformers with explicit attention, D=16, N=8, exported to ONNX):
lsa's local engine and auto_LiRPA on the same models, eps and centres, in one run, against
the in-ball float64 lower bound (projected Jacobian ascent). One thread; writes
bench/out/local_vs_autolirpa.json and .png and prints the JSON.

    .venv/bin/python bench/local_vs_autolirpa.py [--kinds mlp tf1 tf2] [--alirpa-src DIR]

auto_LiRPA is a benchmark baseline only, never a dependency of lsa: it lives in its own venv
(bench/out/alirpa/venv), which this script builds when missing from a source checkout
(`--alirpa-src`, a directory with its setup.py or a git directory, default
bench/out/alirpa/src; e.g. `git clone https://github.com/Verified-Intelligence/auto_LiRPA
bench/out/alirpa/src`): `pip install torch==<this torch>`, `pip install --no-deps <src>`, and
the few pure-Python packages it imports. Without a source it is skipped, saying why.
auto_LiRPA's local constants (its Jacobian mode) are run on the L_inf ball only (its
maintainers call its L2 Jacobian bounds loose), so those columns exist for norm inf only; its
CROWN robustness radius is run in both norms. Its numbers are checked against the float64
lower bound (a local constant below it, or a certified radius above the attack radius, is
unsound) and flagged.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.local_models import KINDS, build, center, export  # noqa: E402
from lsa_models.empirical.local import local_lower_bound  # noqa: E402
from lsa_models.engine.routes.certify import certify_local, robustness  # noqa: E402
from lsa_models.onnx import load_onnx  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
ALIRPA = OUT / "alirpa"
EPS = (1e-3, 1e-2, 1e-1)
# pure-Python packages auto_LiRPA imports (its setup.py pins torch < 2.9 and test tools, so it
# is installed with --no-deps beside them)
ALIRPA_DEPS = ("numpy", "packaging", "appdirs", "pyyaml", "tqdm", "graphviz")
# what bench/trained/alirpa.py needs besides: the digits models' weights and libraries (timm
# imports torchvision, which goes in with --no-deps as in the Makefile)
TRAINED_DEPS = ("safetensors", "scikit-learn", "timm", "x-transformers")
TORCHVISION = "torchvision==0.28.0"


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", *args], check=True,
                   capture_output=True, text=True, timeout=1800)


def _source(src: Path) -> Path:
    """A directory holding auto_LiRPA's setup.py: `src` itself, or one exported from a git
    directory."""
    if (src / "setup.py").is_file():
        return src
    if (src / "HEAD").is_file() and (src / "objects").is_dir():  # a bare git directory
        dest = ALIRPA / "src"
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", f"--git-dir={src}", "archive", "HEAD"], check=True,
                                 capture_output=True, timeout=300).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True, timeout=300)
        return dest
    raise FileNotFoundError(f"no auto_LiRPA source at {src}: clone "
                            "https://github.com/Verified-Intelligence/auto_LiRPA there or "
                            "pass --alirpa-src")


def ensure_alirpa(src: Path, venv: Path = ALIRPA / "venv") -> tuple[Path | None, str]:
    """The auto_LiRPA venv's python (built when missing), or None and the reason."""
    python = venv / "bin" / "python"

    def importable() -> bool:
        return python.is_file() and subprocess.run(
            [str(python), "-c", "import auto_LiRPA"], capture_output=True, timeout=300
        ).returncode == 0
    if importable():
        return python, f"existing venv {venv}"
    try:
        source = _source(src)
        if not python.is_file():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True,
                           capture_output=True, timeout=600)
        _pip(python, f"torch=={torch.__version__.split('+')[0]}")
        _pip(python, "--no-deps", str(source))
        _pip(python, *ALIRPA_DEPS)
        constraint = venv / "constraints.txt"
        constraint.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
        _pip(python, "-c", str(constraint), *TRAINED_DEPS)
        _pip(python, "--no-deps", TORCHVISION)
    except (OSError, subprocess.SubprocessError) as exc:
        err = getattr(exc, "stderr", "") or ""
        return None, f"auto_LiRPA venv not built ({exc}; {str(err)[-300:]}): baseline skipped"
    if not importable():
        return None, f"auto_LiRPA does not import in {venv}: baseline skipped"
    return python, f"built {venv} from {source}"


def _alirpa(python: Path | None, why: str, kind: str, seed: int, x0: Path,
            label: int) -> dict[str, Any]:
    if python is None:
        return {"skipped": why}
    runner = Path(__file__).resolve().parent / "alirpa_runner.py"
    try:
        res = subprocess.run([str(python), str(runner), kind, str(seed), str(x0), str(label),
                              *map(str, EPS)], capture_output=True, text=True, timeout=1800,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 1800 s"}
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        return {"error": (res.stderr or res.stdout).strip()[-300:]}
    out: dict[str, Any] = json.loads(lines[-1])
    return out


def lsa_rows(om: Any, f64: Any, x0: np.ndarray, seed: int, kind: str) -> list[dict[str, Any]]:
    """lsa's local constant and the in-ball float64 lower bound per norm and eps (shared with
    bench/local_tightness.py)."""
    rows = []
    for norm in ("2", "inf"):
        for eps in EPS:
            t0 = time.monotonic()
            res = certify_local(om, x0, eps, norm)  # type: ignore[arg-type]
            t1 = time.monotonic()
            lb = local_lower_bound(f64, x0, eps, norm, restarts=3, steps=15, seed=seed)
            up = res.upper
            rows.append({"norm": norm, "eps": eps, "upper": up, "lower": lb.lower,
                         "ratio": None if up is None else up / lb.lower,
                         "sound": up is None or up >= lb.lower,
                         "upper_seconds": t1 - t0, "lower_seconds": lb.seconds})
            print(json.dumps({"kind": kind, **rows[-1]}), file=sys.stderr, flush=True)
    return rows


def _compare(rows: list[dict[str, Any]], radii: dict[str, Any], base: dict[str, Any]) -> None:
    """Put auto_LiRPA's inf-norm numbers beside lsa's rows; flag unsound ones."""
    jac = {r["eps"]: r for r in base.get("jacobian_linf", [])}
    for row in rows:
        if row["norm"] != "inf" or row["eps"] not in jac:
            continue
        a = jac[row["eps"]]
        if "upper" in a:
            row["alirpa_upper"] = a["upper"]
            row["alirpa_ratio"] = a["upper"] / row["lower"]
            # auto_LiRPA computes in float32: below the float64 lower bound is unsound
            row["alirpa_sound"] = a["upper"] >= row["lower"]
            row["lsa_at_least_as_tight"] = row["upper"] is not None and \
                row["upper"] <= a["upper"]
        else:
            row["alirpa_error"] = a.get("error")
        row["alirpa_seconds"] = a.get("seconds")
    for key, norm in (("crown_linf", "inf"), ("crown_l2", "2")):
        crown = base.get(key, {})
        attack = radii[norm]["attack"]
        if "radius" in crown:
            crown["ratio_to_attack"] = crown["radius"] / attack if attack else None
            crown["sound"] = attack is None or crown["radius"] <= attack
            crown["lsa_radius"] = radii[norm]["certified"]


def run_kind(kind: str, seed: int, tmp: Path, alirpa: tuple[Path | None, str]
             ) -> dict[str, Any]:
    model = build(kind, seed)
    om = load_onnx(export(model, tmp / f"{kind}.onnx").read_bytes())
    x0 = center(seed + 1).numpy().astype(np.float64)
    f64 = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        label = int(f64(torch.from_numpy(x0)).argmax())
    rows = lsa_rows(om, f64, x0, seed, kind)
    radii = {}
    for norm in ("2", "inf"):
        r = robustness(om, x0, label, norm)  # type: ignore[arg-type]
        radii[norm] = {"certified": r.certified_radius, "attack": r.attack_radius,
                       "ratio": (r.certified_radius / r.attack_radius) if r.attack_radius
                       else None, "certify_seconds": r.certify_seconds,
                       "attack_seconds": r.attack_seconds}
    np.save(tmp / f"{kind}_x0.npy", x0.astype(np.float32))
    base = _alirpa(*alirpa, kind, seed, tmp / f"{kind}_x0.npy", label)
    _compare(rows, radii, base)
    return {"kind": kind, "label": label, "local": rows, "radii": radii, "auto_lirpa": base}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, norm in zip(axes[:2], ("2", "inf"), strict=True):
        for i, r in enumerate(results):
            rows = [x for x in r["local"] if x["norm"] == norm and x["ratio"]]
            ax.plot([x["eps"] for x in rows], [x["ratio"] for x in rows], "o-", c=f"C{i}",
                    label=f"lsa {r['kind']}")
            al = [x for x in rows if "alirpa_ratio" in x]
            if al:
                ax.plot([x["eps"] for x in al], [x["alirpa_ratio"] for x in al], "s--",
                        c=f"C{i}", label=f"auto_LiRPA {r['kind']}")
        ax.axhline(1.0, ls=":", c="k")
        ax.axhline(1.5, ls="--", c="grey")
        ax.set(xscale="log", yscale="log", xlabel="eps", ylabel="upper / float64 lower",
               title=f"local constant, {norm}-norm ball")
        ax.legend(fontsize=7)
    ax = axes[2]
    names = ["lsa 2", "CROWN 2", "lsa inf", "CROWN inf"]
    for i, r in enumerate(results):
        base = r["auto_lirpa"]
        vals = [r["radii"]["2"]["ratio"] or 0,
                base.get("crown_l2", {}).get("ratio_to_attack") or 0,
                r["radii"]["inf"]["ratio"] or 0,
                base.get("crown_linf", {}).get("ratio_to_attack") or 0]
        ax.bar(np.arange(4) + 0.25 * i, vals, 0.25, label=r["kind"])
    ax.set_xticks(np.arange(4) + 0.25, names)
    ax.axhline(0.6, ls="--", c="grey")
    ax.set(ylabel="certified / attack radius", title="robustness radius")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", nargs="+", default=list(KINDS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--alirpa-src", type=Path, default=ALIRPA / "src")
    ap.add_argument("--no-alirpa", action="store_true", help="skip the baseline")
    args = ap.parse_args()
    torch.set_num_threads(1)
    OUT.mkdir(exist_ok=True)
    alirpa = (None, "--no-alirpa") if args.no_alirpa else ensure_alirpa(args.alirpa_src)
    print(f"auto_LiRPA: {alirpa[1]}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_kind(k, args.seed, Path(tmp), alirpa) for k in args.kinds]
    doc = {"models": results, "eps": list(EPS), "auto_lirpa_setup": alirpa[1],
           "auto_lirpa_constant_norms": ["inf"], "auto_lirpa_radius_norms": ["inf", "2"],
           "threads": 1}
    (OUT / "local_vs_autolirpa.json").write_text(json.dumps(doc, indent=1))
    plot(results, OUT / "local_vs_autolirpa.png")
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
