"""The one bound engine: a typed layer graph, one value type, one verdict accumulator, one
driver (docs/bounds.md, "The bound engine").

Both front ends lower to it: the native walker (bounds/rules.py: one lowering rule per
module type) turns an nn.Module into one root layer (series, residuals and leaf layers), the
ONNX front end (onnx/analyzer.py) turns the recognised composites and the remaining nodes
into a `LayerGraph`. `families.py` bounds each layer kind, `driver.py` composes them.
"""

from .driver import Context, run
from .layers import (
    Activation,
    CertifiedResidual,
    DPAttention,
    Identity,
    L2Attention,
    Layer,
    LayerGraph,
    Linear,
    Norm,
    OpNode,
    Refused,
    Residual,
    Series,
)
from .values import Value, Verdicts

__all__ = [
    "Activation",
    "CertifiedResidual",
    "Context",
    "DPAttention",
    "Identity",
    "L2Attention",
    "Layer",
    "LayerGraph",
    "Linear",
    "Norm",
    "OpNode",
    "Refused",
    "Residual",
    "Series",
    "Value",
    "Verdicts",
    "run",
]
