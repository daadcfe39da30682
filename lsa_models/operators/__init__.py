"""lsa's operators: one class per op owning every bound mode, one registry (docs/operators.md).

`activation.py` holds the elementwise activations; `registry.py` maps ONNX op types to
classes; `base.py` the interface and `ModeNotImplemented`.
"""

from .base import ModeNotImplemented, Operator
from .registry import ACTIVATION_TYPES, ACTIVATIONS, FUSABLE_ACTIVATIONS, activation, by_kind

__all__ = ["ACTIVATIONS", "ACTIVATION_TYPES", "FUSABLE_ACTIVATIONS", "ModeNotImplemented",
           "Operator", "activation", "by_kind"]
