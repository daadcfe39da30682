"""The local 2-norm constant of the 12-layer D=768 encoder of bench/onnx_bound_speed.py (post-norm,
ReLU, H=12, d_ff=3072) on the ball of radius eps around a random input, and its time, beside the
global bound on the bounded domain (radius 1). At this size the Jacobian enclosure would not
fit (MAX_JACOBIAN_ENTRIES): the global per-layer rules on the tokens the ball reaches bound
it, reported with their time. Writes bench/out/local_large.json and prints it.

    .venv/bin/python bench/local_large.py [--seq-len 16] [--eps 0.01]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

OUT = Path(__file__).resolve().parent / "out"


def build(d: int, heads: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()
    with torch.no_grad():  # as bench/onnx_bound_speed.py: layers that differ
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

    return Wrapped()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--eps", type=float, default=1e-2)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from lsa_models.engine.routes.certify import certify_local
    from lsa_models.engine.routes.constant import global_bound
    from lsa_models.onnx import LoadOptions, analyse, load_onnx

    model = build(args.d_model, args.heads, args.layers)
    x = torch.randn(1, args.seq_len, args.d_model, generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "encoder.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=18,
                              input_names=["x"], output_names=["y"])
        om = load_onnx(path.read_bytes(), "encoder.onnx", LoadOptions(check_ort=False))
    # the global per-layer rules on the tokens the ball reaches (certify_local's route
    # where the enclosure does not fit), timed alone
    x0 = x.double().numpy()
    tb = time.perf_counter()
    reach = global_bound(om, "2", x0, args.eps)
    tr = time.perf_counter()
    t0 = time.perf_counter()
    local = certify_local(om, x.numpy(), args.eps, "2")
    t1 = time.perf_counter()
    glob = analyse(om, "2", args.seq_len, 1.0)
    t2 = time.perf_counter()
    worst = sorted((lb for lb in local.layers if lb.upper is not None),
                   key=lambda lb: -(lb.upper or 0.0))[:5]
    doc = {"layers": args.layers, "d_model": args.d_model, "seq_len": args.seq_len,
           "eps": args.eps, "local_upper": local.upper, "local_verdict": local.verdict,
           "local_seconds": t1 - t0, "global_radius1_upper": glob.upper,
           "reachable_tokens_upper": reach.upper, "reachable_tokens_seconds": tr - tb,
           "global_seconds": t2 - t1, "method": local.method,
           "largest_layer_factors": [{"name": lb.name, "kind": lb.kind, "upper": lb.upper,
                                      "rule": lb.rule} for lb in worst]}
    OUT.mkdir(exist_ok=True)
    (OUT / "local_large.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
