"""Train the bench models on the digits (bench/trained/models.py), export each to ONNX as the
project's tests do (tests/onnx_export.py; input "x" (1, 1, 8, 8), output "y" (1, 10)) and
keep its weights (safetensors) for the attacks of run.py. Writes, under bench/out/trained/:
<name>.onnx, <name>.safetensors and models.json (clean test accuracy, training seconds,
parameters, the ONNX file's agreement with torch on the test images). One thread.

    .venv/bin/python bench/trained/train.py [--only timm_vit mlp ...] [--exporter torchscript]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.trained.models import MODELS, digits, train  # noqa: E402
from tests.onnx_export import export_to  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "out" / "trained"


def export(model: nn.Module, path: Path, dynamo: bool = True) -> Path:
    """The model's ONNX graph at one image. lsa_models' L2 layers are exported through their
    `forward_export` (explicit logits, W^V kept apart), as lsa_models.onnx.export_onnx does
    for token models; that function takes (B, N, D) inputs only, so its context is used
    here around the image model."""
    from lsa_models.onnx.export import _export_forms

    x = torch.zeros(1, 1, 8, 8)
    with _export_forms(model, "pairwise") if _has_lsa_l2(model) else contextlib.nullcontext():
        return export_to(model, x, path, dynamo=dynamo)


def _has_lsa_l2(model: nn.Module) -> bool:
    from lsa_models.attention import L2MHA

    return any(isinstance(m, L2MHA) for m in model.modules())


def onnx_agreement(path: Path, model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """The ONNX graph (onnxruntime, one image at a time) against torch on images `x`: the
    largest logit difference and the fraction of equal predictions."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        ref = model(x).numpy()
    got = np.concatenate([sess.run(None, {"x": x[i:i + 1].numpy()})[0] for i in range(len(x))])
    return {"max_abs_logit_diff": float(np.abs(got - ref).max()),
            "same_prediction": float((got.argmax(1) == ref.argmax(1)).mean())}


def save_weights(model: nn.Module, path: Path) -> None:
    from safetensors.torch import save_model

    save_model(model, str(path))


def load_trained(name: str, out: Path = OUT) -> nn.Module:
    """MODELS[name] with the weights train.py wrote, in eval mode."""
    from safetensors.torch import load_model

    model = MODELS[name].build()
    load_model(model, str(out / f"{name}.safetensors"))
    return model.eval()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", choices=sorted(MODELS), default=None)
    ap.add_argument("--exporter", choices=("dynamo", "torchscript"), default="dynamo")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    index = args.out / "models.json"
    records: dict[str, Any] = json.loads(index.read_text()) if index.is_file() else {}
    data = digits()
    for name in args.only or list(MODELS):
        model, rec = train(name, data=data)
        path = args.out / f"{name}.onnx"
        try:
            export(model, path, dynamo=args.exporter == "dynamo")
            rec["onnx"] = path.name
            rec.update(onnx_agreement(path, model, data[2][:100]))
        except Exception as exc:  # an exporter failure is a result of the bench, not a crash
            rec["onnx"] = None
            rec["export_error"] = f"{type(exc).__name__}: {exc}"[:500]
        rec["exporter"] = args.exporter
        save_weights(model, args.out / f"{name}.safetensors")
        records[name] = rec
        print(f"{name}: clean accuracy {rec['clean_accuracy']:.3f}, "
              f"{rec['train_seconds']:.1f} s, onnx {rec['onnx']}"
              + (f" ({rec['export_error']})" if rec["onnx"] is None else
                 f", max logit diff {rec['max_abs_logit_diff']:.2e}"), flush=True)
        index.write_text(json.dumps(records, indent=2) + "\n")
    return records


if __name__ == "__main__":
    main()
