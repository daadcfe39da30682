"""alpha-beta-CROWN (complete_verifier: CROWN, alpha-CROWN, then branch and bound) on the
images bench/trained/compare_alirpa.py compared, in the auto_LiRPA venv. Bench-only: its
source is exported under bench/out/alirpa/abcrown from a git directory of
Verified-Intelligence/alpha-beta-CROWN (`--src`; its datasets and model files are left out),
beside three files written here: custom/lsa_digits.py (the models of models.py with the
runner's rewrites, bench/trained/alirpa.py, and the images, the whole ball: no clipping),
run_abcrown.py (declares torchvision's C-op schemas first, tests/zoo/tv_schemas.py) and an
onnx2pytorch placeholder (its ONNX loader, not installable here and not used: the models are
given as torch modules).

    .venv/bin/python bench/trained/abcrown.py [--src GITDIR] [--only ...] [--timeout 20]

Per model of bench/out/trained/alirpa.json, norm and radius: one abcrown.py process on the
images both sides of the comparison finished, `bab: timeout` seconds per image, under a
wall-clock cap; its summary parsed into the images it verified (safe), falsified (unsafe)
and left unknown, written to bench/out/trained/abcrown.json (`compare_alirpa.py
--recompare` puts it beside the comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.trained.models import digits  # noqa: E402
from bench.trained.train import OUT  # noqa: E402

ALIRPA = OUT.parent / "alirpa"
DEST = ALIRPA / "abcrown"
PY = ALIRPA / "venv" / "bin" / "python"

CUSTOM = '''"""The bench's models and images for alpha-beta-CROWN (bench/trained/abcrown.py)."""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.environ["LSA_REPO"])


def model(name, weights):
    from safetensors.torch import load_model

    from bench.trained import alirpa
    from bench.trained.models import MODELS

    torch.nn.functional.scaled_dot_product_attention = alirpa._explicit_sdpa
    torch.backends.mha.set_fastpath_enabled(False)
    m = MODELS[name].build()
    load_model(m, weights)
    alirpa._drop_dropout(m)
    alirpa._explicit_attention(m)
    alirpa._swap_gelu(m)
    return m.eval()


def images(spec, xs, ys):
    x = torch.from_numpy(np.load(xs)).float()
    y = torch.from_numpy(np.load(ys)).long()
    # bounds far outside [0, 1]: the whole ball, the set lsa and the runner certify
    big = torch.full((1, 1, 1, 1), 1e4)
    return x, y, big, -big, torch.tensor(float(spec["epsilon"])).reshape(1, 1, 1, 1)
'''

WRAPPER = '''"""abcrown.py once torchvision's C-op schemas are declared (tests/zoo)."""
import os
import runpy
import sys

sys.path.insert(0, os.environ["LSA_REPO"])
from tests.zoo.tv_schemas import declare  # noqa: E402

declare()
here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
sys.argv[0] = "abcrown.py"
runpy.run_path(os.path.join(here, "abcrown.py"), run_name="__main__")
'''

PLACEHOLDER = '''"""Placeholder for Verified-Intelligence/onnx2pytorch (alpha-beta-CROWN's ONNX
loader), which cannot be installed here; the bench gives torch modules, never ONNX. Any use
fails."""


def __getattr__(name):
    raise ImportError(f"onnx2pytorch is not installed here (asked for {name})")
'''


def setup(src: Path) -> Path:
    """DEST holding complete_verifier and the three bench files (exported when missing)."""
    if not (DEST / "abcrown.py").is_file():
        listing = subprocess.run(["git", f"--git-dir={src}", "ls-tree", "-r", "HEAD",
                                  "complete_verifier"], check=True, capture_output=True,
                                 text=True, timeout=120).stdout
        for line in listing.splitlines():
            meta, path = line.split("\t", 1)
            _, kind, sha = meta.split()
            if kind != "blob" or "/datasets/" in path or "/models/" in path:
                continue
            blob = subprocess.run(["git", f"--git-dir={src}", "cat-file", "blob", sha],
                                  capture_output=True, timeout=60)
            if blob.returncode == 0:  # large files may be absent from the snapshot
                dest = DEST / path.removeprefix("complete_verifier/")
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(blob.stdout)
    (DEST / "custom").mkdir(parents=True, exist_ok=True)
    (DEST / "custom" / "lsa_digits.py").write_text(CUSTOM)
    (DEST / "run_abcrown.py").write_text(WRAPPER)
    (DEST / "onnx2pytorch").mkdir(exist_ok=True)
    (DEST / "onnx2pytorch" / "__init__.py").write_text(PLACEHOLDER)
    return DEST


def config(name: str, weights: Path, xs: Path, ys: Path, n: int, norm: str, eps: float,
           timeout: float) -> str:
    # conv_mode matrix (as the auto_LiRPA runner) and dense intermediate bounds: with the
    # defaults (patches, sparse) auto_LiRPA's alpha set-up fails an assertion on the ViTs
    return f"""general:
  device: cpu
  complete_verifier: bab
  conv_mode: matrix
  sparse_interm: false
model:
  name: Customized("lsa_digits", "model", name="{name}", weights="{weights}")
data:
  dataset: Customized("lsa_digits", "images", xs="{xs}", ys="{ys}")
  num_outputs: 10
  start: 0
  end: {n}
specification:
  norm: {'.inf' if norm == 'inf' else '2'}
  epsilon: {eps}
attack:
  pgd_order: skip
solver:
  batch_size: 64
bab:
  timeout: {timeout}
"""


SUMMARY = re.compile(r"^([a-z-]+(?: \(timed out\))?) \(total (\d+)\), index: \[([0-9, ]*)\]")


def parse(log: str) -> dict[str, list[int]]:
    """abcrown's summary lines: {status: [instance indices]}."""
    out: dict[str, list[int]] = {}
    for line in log.splitlines():
        m = SUMMARY.match(line.strip())
        if m:
            out[m.group(1)] = [int(v) for v in m.group(3).split(",") if v.strip()]
    return out


def run_one(name: str, weights: Path, xs: np.ndarray, ys: np.ndarray, norm: str, eps: float,
            args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    np.save(tmp / "x.npy", xs.astype(np.float32))
    np.save(tmp / "y.npy", ys.astype(np.int64))
    cfg = tmp / "abcrown.yaml"
    cfg.write_text(config(name, weights, tmp / "x.npy", tmp / "y.npy", len(ys), norm, eps,
                          args.timeout))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "LSA_REPO": str(Path(__file__).resolve().parents[2])}
    t0 = time.monotonic()
    proc = subprocess.Popen([str(PY), str(DEST / "run_abcrown.py"), "--config", str(cfg)],
                            cwd=DEST, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=args.cap)
        killed = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this call started, and only it
        log, _ = proc.communicate()
        killed = True
    res: dict[str, Any] = {"seconds": time.monotonic() - t0, "returncode": proc.returncode,
                           "status": parse(log)}
    if killed:
        res["killed"] = f"past the {args.cap} s cap"
    if not res["status"]:
        res["log_tail"] = [ln for ln in log.splitlines() if "arn" not in ln][-6:]
    verified = sorted(i for k, v in res["status"].items() if k.startswith("safe") for i in v)
    res["verified"] = verified
    res["certified_accuracy"] = len(verified) / len(ys) if len(ys) else None
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path,
                    default=Path("/work/.mirror/Verified-Intelligence+alpha-beta-CROWN/repo"))
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--timeout", type=float, default=20.0, help="BaB seconds per image")
    ap.add_argument("--cap", type=float, default=240.0, help="wall seconds per abcrown run")
    ap.add_argument("--radii", nargs="*", type=float, default=None,
                    help="only these radii of the grid")
    ap.add_argument("--results", type=Path, default=OUT / "alirpa.json")
    ap.add_argument("--out", type=Path, default=OUT / "abcrown.json")
    args = ap.parse_args(argv)
    setup(args.src)
    results = json.loads(args.results.read_text())
    _, _, x_te, y_te = digits()
    out: dict[str, Any] = {"timeout_per_image": args.timeout, "cap_seconds": args.cap,
                           "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, m in results["models"].items():
            if args.only and name not in args.only:
                continue
            weights = Path(m["auto_lirpa"].get("spec", {}).get("weights", ""))
            cmp = m.get("compare", {}).get("norms", {})
            rows: dict[str, Any] = {}
            for norm, radii in results["radii"].items():
                pos = [p["i"] for p in cmp.get(norm, {}).get("images", [])]
                if not pos or not weights.is_file():
                    continue
                idx = [m["test_indices"][i] for i in pos]
                xs, ys = x_te[idx].numpy(), y_te[idx].numpy()
                for r in radii:
                    if args.radii is not None and float(r) not in args.radii:
                        continue
                    res = run_one(name, weights, xs, ys, norm, float(r), args, Path(tmp))
                    res["images"] = pos
                    res["verified"] = [pos[j] for j in res["verified"]]  # image ids
                    rows.setdefault(norm, {})[str(r)] = res
                    print(f"{name} L{norm} {r}: abcrown verified {res['verified']} of "
                          f"{len(pos)} ({res['seconds']:.0f} s){res.get('killed', '')}",
                          flush=True)
                    out["models"][name] = rows
                    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
