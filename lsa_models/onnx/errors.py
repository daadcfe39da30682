"""Errors of the ONNX loader and analyser: the upload is not a model this service can analyse.

Every class is a `ValueError` (the service answers 4xx, the CLI exits 2). They live apart from
`loading.py` so that `graph.py` can raise them without importing the loader (no import cycle).
"""

from __future__ import annotations


class OnnxLoadError(ValueError):
    """Base class: the upload is not an ONNX model this service can analyse."""


class OnnxTooLargeError(OnnxLoadError):
    pass


class OnnxParseError(OnnxLoadError):
    pass


class OnnxExternalDataError(OnnxLoadError):
    pass


class OnnxCheckError(OnnxLoadError):
    pass


class OnnxShapeError(OnnxLoadError):
    pass


class OnnxInputError(OnnxLoadError):
    pass


class OnnxMismatchError(OnnxLoadError):
    pass


# What a user can do about an op the service does not read, by op type.
_HINTS = {
    "If": "control flow: export with torch.onnx.export(..., dynamo=True) or trace with fixed "
          "shapes",
    "Loop": "control flow: export with torch.onnx.export(..., dynamo=True) or trace with fixed "
            "shapes",
    "Attention": "a fused attention op: export with opset 17-20 so attention is written out",
    "RMSNormalization": "the fused RMSNorm op: export with opset 17-20 (written out, it is "
                        "recognised)",
}


class UnsupportedOpsError(OnnxLoadError):
    def __init__(self, counts: dict[str, int]) -> None:
        listing = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
        hints = "; ".join(f"{k}: {_HINTS[k]}" for k in sorted(counts) if k in _HINTS)
        super().__init__(f"the graph uses ops this service cannot evaluate or bound: {listing}. "
                         + (f"{hints}. " if hints else "")
                         + "Export the model with standard ONNX ops (opset 17-20); "
                         "`lsa_models.onnx.supported_op_types()` lists the ops read")
        self.counts = counts


class DynamicSeqLenError(OnnxLoadError):
    pass
