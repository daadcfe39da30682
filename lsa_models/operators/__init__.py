"""lsa's operators: one class per op owning every bound mode, one registry (docs/operators.md).

`activation.py` holds the elementwise activations, `arithmetic.py` Exp, Sqrt, Reciprocal and
Pow, `softmax.py` Softmax, `normalization.py` LayerNormalization; `registry.py` maps ONNX op
types to classes; `base.py` the interface and `ModeNotImplemented`.
"""

from .base import ModeNotImplemented, Operator
from .registry import (
    ACTIVATION_TYPES,
    ACTIVATIONS,
    ARITHMETIC,
    ARITHMETIC_TYPES,
    FUSABLE_ACTIVATIONS,
    NORMS,
    OPERATORS,
    activation,
    arithmetic,
    arithmetic_by_kind,
    by_kind,
    make,
)

__all__ = ["ACTIVATIONS", "ACTIVATION_TYPES", "ARITHMETIC", "ARITHMETIC_TYPES",
           "FUSABLE_ACTIVATIONS", "ModeNotImplemented", "NORMS", "OPERATORS", "Operator",
           "activation", "arithmetic", "arithmetic_by_kind", "by_kind", "make"]
