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


class UnsupportedOpsError(OnnxLoadError):
    def __init__(self, counts: dict[str, int]) -> None:
        listing = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
        super().__init__(f"the graph uses ops this service cannot evaluate or bound: {listing}. "
                         "Export the model with standard ONNX ops (opset 17-20)")
        self.counts = counts


class DynamicSeqLenError(OnnxLoadError):
    pass
