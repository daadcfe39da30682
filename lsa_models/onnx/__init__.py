"""ONNX models: safe loading, a torch evaluator, the op registry, attention recognition,
certified bounds and export.

`load_onnx_model` is the upload loader that `lsa_models.analysis.load_model_bytes` calls by
name for .onnx files and zips of an .onnx with its external data; it returns an
`OnnxLoadedModel`, which certifies itself with the graph analyser.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..bounds import BoundResult
from ..bounds.analyzer import norm_name
from ..bounds.report import NormName
from ..loaded import LoadedModel, sha256_hex
from .analyzer import analyse
from .errors import (
    DynamicSeqLenError,
    OnnxCheckError,
    OnnxExternalDataError,
    OnnxInputError,
    OnnxLoadError,
    OnnxMismatchError,
    OnnxParseError,
    OnnxShapeError,
    OnnxTooLargeError,
    UnsupportedOpsError,
)
from .export import export_onnx
from .loading import LoadOptions, OnnxModel, is_onnx, load_onnx
from .ops import OPS, supported_op_types


@dataclass
class OnnxLoadedModel(LoadedModel):
    """An uploaded ONNX graph; `onnx` is the loaded graph the analyser reads."""

    onnx: OnnxModel = field(kw_only=True)

    def certify(self, norm: NormName | float, seq_len: int | None = None,
                radius: float | None = None) -> BoundResult:
        return analyse(self.onnx, norm_name(norm), self.resolve_seq_len(seq_len), radius)


def load_onnx_model(data: bytes, filename: str = "", *, check_ort: bool = True) -> OnnxLoadedModel:
    """An upload -> `OnnxLoadedModel(format="onnx"|"onnx-zip")`. `check_ort=False` skips the
    onnxruntime comparison (for bytes that already passed it at upload)."""
    model = load_onnx(data, filename, replace(LoadOptions(), check_ort=check_ort))
    spec = model.spec
    summary: dict[str, Any] = {
        "kind": "onnx",
        "opset": spec.opset,
        "nodes": len(spec.nodes),
        "parameters": int(sum(_numel(t) for t in spec.model.graph.initializer)),
        "d_model": spec.d_model,
        "seq_len": spec.seq_len,
        # a fixed graph also answers to the tokens its attention sees (N + 1: class token)
        "seq_len_choices": list(spec.attention_tokens),
        "input": spec.input_name,
        # "seq_first": the upload takes (N, 1, D); analysed (and reported) as (1, N, D);
        # "pixels": it takes (B, C, H, W); analysed (and reported) on its patches (B, P, D)
        "layout": "seq_first" if spec.seq_first else "pixels" if spec.pixels else "batch_first",
        "output": spec.output_name,
        "onnxruntime_max_abs_diff": model.max_abs_diff,
    }
    return OnnxLoadedModel(model.format, sha256_hex(data), model.module, summary,
                           seq_len=spec.seq_len, d_model=spec.d_model,
                           seq_len_choices=spec.attention_tokens, onnx=model)


def _numel(t: Any) -> int:  # an onnx TensorProto
    n = 1
    for d in t.dims:
        n *= int(d)
    return n


__all__ = [
    "OPS",
    "DynamicSeqLenError",
    "LoadOptions",
    "OnnxCheckError",
    "OnnxExternalDataError",
    "OnnxInputError",
    "OnnxLoadError",
    "OnnxLoadedModel",
    "OnnxMismatchError",
    "OnnxModel",
    "OnnxParseError",
    "OnnxShapeError",
    "OnnxTooLargeError",
    "UnsupportedOpsError",
    "analyse",
    "export_onnx",
    "is_onnx",
    "load_onnx",
    "load_onnx_model",
    "supported_op_types",
]
