"""How long an ONNX upload takes: load, check against onnxruntime, certify with a radius.

Model: a 12-layer `nn.TransformerEncoder` (D=768, H=12, d_ff=3072, post-norm, ReLU), built
and exported by torch at run time into a temporary directory (nothing is checked in).
Phases, each timed on one CPU thread:
- export (for information only);
- load: parse, checker, shape inference, external-data/size checks, torch evaluator build;
- ort_check: torch evaluation versus onnxruntime on a random input;
- bound: the analytic certified bound with a radius (reference evaluation, attention
  recognition by probing, formulas);
- baseline (same run): certified spectral norms of every weight matrix of the model, the
  irreducible part of any certified bound, so `bound / baseline` is the analyser's overhead.
Target: bound < 5 s (median of `--repeats` runs, each listed). Prints one JSON object and
writes it to bench/out/onnx_bound_speed.json; `--plot PATH` also draws the phases (PNG).
"""

from __future__ import annotations

import os

# One thread everywhere, BLAS included (numpy's OpenBLAS ignores torch.set_num_threads).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--radius", type=float, default=1.0)
    parser.add_argument("--dynamo", action="store_true", help="use the dynamo exporter")
    parser.add_argument("--repeats", type=int, default=3, help="bound runs (median reported)")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from lsa_models.bounds.numerics import spectral_norm_upper
    from lsa_models.onnx import LoadOptions, analyse, load_onnx
    from lsa_models.onnx.loading import compare_with_onnxruntime

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(args.d_model, args.heads, 4 * args.d_model,
                                       dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False).eval()
    with torch.no_grad():  # the stack starts as copies of one layer: make the layers differ
        for name, p in encoder.named_parameters():
            if p.dim() == 2:
                nn.init.xavier_uniform_(p)
            elif "norm" in name and "weight" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.02)

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.encoder(x, mask=None, is_causal=False)

    phases: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "encoder.onnx"
        x = torch.randn(1, args.seq_len, args.d_model)
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if args.dynamo:
                prog = torch.onnx.export(Wrapped(), (x,), dynamo=True, opset_version=18,
                                         input_names=["x"], output_names=["y"])
                assert prog is not None
                prog.save(str(path), external_data=False)
            else:
                torch.onnx.export(Wrapped(), (x,), str(path), dynamo=False, opset_version=18,
                                  input_names=["x"], output_names=["y"])
        phases["export_s"] = time.perf_counter() - t0
        data = path.read_bytes()
    opts = LoadOptions(check_ort=False)
    t0 = time.perf_counter()
    model = load_onnx(data, "encoder.onnx", opts)
    phases["load_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    diff = compare_with_onnxruntime(model.spec, model.module, LoadOptions(), None)
    phases["ort_check_s"] = time.perf_counter() - t0
    # the shared 2-core machine is noisy: the median of a few runs (each from scratch: the
    # analyser caches nothing between calls), every run reported
    runs = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        result = analyse(model, "2", None, args.radius)
        runs.append(time.perf_counter() - t0)
    phases["bound_s"] = statistics.median(runs)
    t0 = time.perf_counter()
    for p in encoder.parameters():
        if p.dim() == 2:
            spectral_norm_upper(p)
    phases["baseline_spectral_norms_s"] = time.perf_counter() - t0
    out = {
        "benchmark": "onnx_bound_speed",
        "threads": torch.get_num_threads(),
        "exporter": "dynamo" if args.dynamo else "torchscript",
        "layers": args.layers, "d_model": args.d_model, "heads": args.heads,
        "seq_len": args.seq_len, "radius": args.radius,
        "onnx_bytes": len(data), "nodes": len(model.spec.nodes),
        "onnxruntime_max_abs_diff": diff,
        "verdict": result.verdict, "upper": result.upper,
        "attention_layers": sum(1 for lb in result.layers if lb.kind.startswith("dp_mha")),
        **{k: round(v, 3) for k, v in phases.items()},
        "bound_runs_s": [round(r, 3) for r in runs],
        "bound_over_baseline": round(phases["bound_s"] / phases["baseline_spectral_norms_s"], 2),
        "target_bound_s": 5.0,
        "bound_meets_target": phases["bound_s"] < 5.0,
    }
    out_dir = Path(__file__).resolve().parent / "out"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "onnx_bound_speed.json").write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = ["load_s", "ort_check_s", "bound_s", "baseline_spectral_norms_s"]
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.barh(names, [phases[n] for n in names])
        ax.axvline(5.0, color="red", linestyle="--", label="bound target")
        ax.set_xlabel("seconds (1 thread)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)


if __name__ == "__main__":
    main()
