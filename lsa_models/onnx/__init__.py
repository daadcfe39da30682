"""ONNX models: safe loading, a torch evaluator, the op registry, attention recognition,
certified bounds and export.

Importing this package registers the ONNX loader in `lsa_models.analysis.LOADERS`, so
`load_model_bytes` reads .onnx files and zips of an .onnx with its external data.
"""

from __future__ import annotations

from .analyzer import analyse, resolve_seq_len
from .export import export_onnx
from .graph import GraphModule, GraphSpec
from .loading import (
    DynamicSeqLenError,
    LoadOptions,
    OnnxCheckError,
    OnnxExternalDataError,
    OnnxInputError,
    OnnxLoadError,
    OnnxMismatchError,
    OnnxModel,
    OnnxParseError,
    OnnxShapeError,
    OnnxTooLargeError,
    UnsupportedOpsError,
    is_onnx,
    load_onnx,
)
from .ops import OPS, supported_op_types


def load_onnx_model(data: bytes, filename: str = "", *, check_ort: bool = True):  # type: ignore[no-untyped-def]
    """The `LOADERS` entry: an upload -> `LoadedModel(format="onnx"|"onnx-zip")`.
    `check_ort=False` skips the onnxruntime comparison (for bytes that already passed it)."""
    import dataclasses

    from ..analysis import LoadedModel, sha256_hex
    from ..bounds.report import NormName

    model = load_onnx(data, filename, dataclasses.replace(LoadOptions(), check_ort=check_ort))
    spec = model.spec

    def certify_fn(norm: NormName, seq_len: int, radius: float | None):  # type: ignore[no-untyped-def]
        return analyse(model, norm, seq_len, radius)

    summary = {
        "kind": "onnx",
        "opset": spec.opset,
        "nodes": len(spec.nodes),
        "parameters": int(sum(int(_numel(t)) for t in spec.model.graph.initializer)),
        "d_model": spec.d_model,
        "seq_len": spec.seq_len,
        "input": spec.input_name,
        # "seq_first": the upload takes (N, 1, D); analysed (and reported) as (1, N, D)
        "layout": "seq_first" if spec.seq_first else "batch_first",
        "output": spec.output_name,
        "onnxruntime_max_abs_diff": model.max_abs_diff,
    }
    loaded = LoadedModel(model.format, sha256_hex(data), model.module, summary,
                         seq_len=spec.seq_len, d_model=spec.d_model, certify_fn=certify_fn)
    loaded.onnx = model  # type: ignore[attr-defined]
    return loaded


def _numel(t) -> int:  # type: ignore[no-untyped-def]
    n = 1
    for d in t.dims:
        n *= int(d)
    return n


def _register() -> None:
    from .. import analysis

    if not any(loader is load_onnx_model for _, loader in analysis.LOADERS):
        # after the native loader: its sniffing is structural (header length + JSON)
        analysis.LOADERS.append((is_onnx, load_onnx_model))


_register()

__all__ = [
    "OPS",
    "DynamicSeqLenError",
    "GraphModule",
    "GraphSpec",
    "LoadOptions",
    "OnnxCheckError",
    "OnnxExternalDataError",
    "OnnxInputError",
    "OnnxLoadError",
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
    "resolve_seq_len",
    "supported_op_types",
]
