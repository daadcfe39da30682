"""A GPT-2-small-sized HF model through `lsa bound`, end to end, with both exporters.

Model: `transformers.GPT2Model` (12 layers, D=768, 12 heads, d_ff=3072; random weights from
the config, nothing downloads; eager attention), called on `inputs_embeds` (default) or on
token ids (`--ids`) with an all-ones attention mask, exported by torch's TorchScript
(opset 17) and dynamo (opset 18) exporters into a temporary directory.
Timed, one CPU thread:
- export (for information);
- `lsa bound FILE --json` as a subprocess, `--repeats` times, wall clock (median and min)
  and the child's CPU time (user + sys, steadier than the wall on a shared machine), with
  the load average: process start, imports, loading, the onnxruntime check, recognition,
  the bound (target: median < 15 s); then the same phases in-process (load, onnxruntime
  check, analysis) to show where the time goes;
- baselines in the same run: one onnxruntime inference of the same file (session build +
  run), and the certified spectral norms of every weight matrix (the irreducible part of any
  certified bound; bench/spectral_norm_speed.py).
Prints one JSON object (also written to bench/out/gpt2_bound.json) and draws
bench/out/gpt2_bound.png. Needs the `zoo` extra (transformers).
"""

from __future__ import annotations

import os

# One thread everywhere, BLAS included (numpy's OpenBLAS ignores torch.set_num_threads).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
TARGET_S = 15.0


class Embeds(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:  # (1, N, D)
        mask = torch.ones(x.shape[0], x.shape[1], dtype=torch.long)  # (1, N)
        return self.model(inputs_embeds=x, attention_mask=mask)[0]  # (1, N, D)


class Ids(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:  # (1, N) int64
        mask = torch.ones_like(ids)  # (1, N)
        return self.model(input_ids=ids, attention_mask=mask)[0]  # (1, N, D)


_TV_LIB: list[torch.library.Library] = []


def declare_torchvision_schemas() -> None:
    """transformers imports torchvision, whose registry wheel (a CUDA build, installed with
    --no-deps) fails to import against CPU torch registering fake kernels for `nms`/`qnms`;
    declaring the two schemas lets it finish (tests/zoo/tv_schemas.py explains)."""
    try:
        torch.ops.torchvision.nms  # noqa: B018  (defined: torchvision's C ops loaded)
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TV_LIB.append(lib)  # the schemas live as long as the library object


def build(args: argparse.Namespace) -> tuple[nn.Module, nn.Module, Tensor]:
    declare_torchvision_schemas()
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=args.vocab, n_positions=max(args.seq_len, 1024),
                     n_embd=args.d_model, n_layer=args.layers, n_head=args.heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     attn_implementation="eager")
    base = GPT2Model(cfg).eval()
    if args.ids:
        return base, Ids(base), torch.randint(0, args.vocab, (1, args.seq_len))
    return base, Embeds(base), torch.randn(1, args.seq_len, args.d_model)


def export(module: nn.Module, x: Tensor, path: Path, exporter: str) -> float:
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            prog = torch.onnx.export(module, (x,), dynamo=True, opset_version=18,
                                     input_names=["x"], output_names=["y"], verbose=False)
            assert prog is not None
            prog.save(str(path), external_data=False)
        else:
            torch.onnx.export(module, (x,), str(path), dynamo=False, opset_version=17,
                              input_names=["x"], output_names=["y"])
    return time.perf_counter() - t0


def lsa_bound(path: Path) -> tuple[float, float, dict]:  # type: ignore[type-arg]
    """(wall seconds, CPU seconds of the child (user + sys), summary) of one `lsa bound`."""
    exe = shutil.which("lsa", path=str(Path(sys.executable).parent)) or "lsa"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([exe, "bound", str(path), "--json"], capture_output=True, text=True,
                          check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        return wall, cpu, {"exit_code": proc.returncode, "error": proc.stderr.strip()[-500:]}
    report = json.loads(proc.stdout)
    return wall, cpu, {"exit_code": 0, "verdict": report["verdict"], "upper": report["upper"],
                       "reason": report.get("reason"),
                       "attention_layers": sum(1 for lb in report["layers"]
                                               if "mha" in lb["kind"])}


def timed_runs(path: Path, repeats: int) -> dict:  # type: ignore[type-arg]
    """`repeats` runs of `lsa bound`: median and min wall and CPU, the load average around
    them (the machine is shared: the median and the load say how much to trust a figure)."""
    walls, cpus = [], []
    report: dict = {}  # type: ignore[type-arg]
    load_before = os.getloadavg()[0]
    for _ in range(repeats):
        wall, cpu, report = lsa_bound(path)
        walls.append(wall)
        cpus.append(cpu)
    return {"lsa_bound_s": round(statistics.median(walls), 2),
            "lsa_bound_min_s": round(min(walls), 2),
            "lsa_bound_runs_s": [round(w, 2) for w in walls],
            "lsa_bound_cpu_s": round(statistics.median(cpus), 2),
            "load_average_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            **report}


def phases(path: Path) -> dict[str, float | str]:
    """The same work in-process, phase by phase: where `lsa bound`'s time goes."""
    from lsa_models.onnx import LoadOptions, analyse, load_onnx
    from lsa_models.onnx.loading import compare_with_onnxruntime

    out: dict[str, float | str] = {}
    data = path.read_bytes()
    t0 = time.perf_counter()
    try:
        model = load_onnx(data, path.name, LoadOptions(check_ort=False))
        out["load_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        compare_with_onnxruntime(model.spec, model.module, LoadOptions(), None)
        out["ort_check_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        analyse(model, "2")
        out["analyse_s"] = round(time.perf_counter() - t0, 2)
    except ValueError as exc:  # the loader's errors (exit 2 in the CLI)
        out["phase_error"] = str(exc)[:200]
    return out


def ort_inference(path: Path, x: Tensor) -> float:
    import onnxruntime as ort

    t0 = time.perf_counter()
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    return time.perf_counter() - t0


def spectral_baseline(base: nn.Module) -> float:
    from lsa_models.bounds.numerics import spectral_norm_upper

    t0 = time.perf_counter()
    for name, p in base.named_parameters():
        if p.dim() == 2 and not name.startswith(("wte", "wpe")):
            spectral_norm_upper(p.detach())
    return time.perf_counter() - t0


def plot(rows: list[dict], path: Path) -> None:  # type: ignore[type-arg]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["lsa_bound_s", "ort_inference_s", "spectral_norms_s"]
    fig, ax = plt.subplots(figsize=(7, 3))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        pos = np.arange(len(names)) + i * width
        ax.barh(pos, [r[n] for n in names], height=width, label=r["exporter"])
    ax.set_yticks(np.arange(len(names)) + width * (len(rows) - 1) / 2, names)
    ax.axvline(TARGET_S, color="red", linestyle="--", label="lsa bound target")
    ax.set_xlabel("seconds (1 thread)")
    ax.set_title("GPT-2-small-sized HF model through `lsa bound`")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--ids", action="store_true", help="export on token ids")
    parser.add_argument("--exporters", default="torchscript,dynamo")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of `lsa bound` per exporter (the median is reported)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base, module, x = build(args)
    spectral_s = spectral_baseline(base)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for exporter in args.exporters.split(","):
            path = Path(tmp) / f"gpt2-{exporter}.onnx"
            try:
                export_s = export(module, x, path, exporter)
            except Exception as exc:  # torch's exporters raise many types
                rows.append({"exporter": exporter, "export_error": str(exc)[:300]})
                continue
            runs = timed_runs(path, args.repeats)
            rows.append({"exporter": exporter, "onnx_bytes": path.stat().st_size,
                         "export_s": round(export_s, 2), **runs,
                         "ort_inference_s": round(ort_inference(path, x), 2),
                         "spectral_norms_s": round(spectral_s, 2), **phases(path),
                         "meets_target": runs["lsa_bound_s"] < TARGET_S})
    out = {"benchmark": "gpt2_bound", "threads": torch.get_num_threads(),
           "layers": args.layers, "d_model": args.d_model, "heads": args.heads,
           "seq_len": args.seq_len, "input": "ids" if args.ids else "inputs_embeds",
           "target_s": TARGET_S, "runs": rows}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpt2_bound.json").write_text(json.dumps(out, indent=1))
    timed = [r for r in rows if "lsa_bound_s" in r]
    if timed:
        plot(timed, OUT / "gpt2_bound.png")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
