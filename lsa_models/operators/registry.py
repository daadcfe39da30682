"""The operator registry: ONNX op type -> the class that owns every mode of it
(auto_LiRPA's `bound_op_map`). Adding an op: one class in the family's file, one line here
(docs/operators.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import activation as act
from . import arithmetic as ar
from .activation import Activation
from .arithmetic import Arithmetic
from .base import Operator
from .softmax import Softmax

ACTIVATIONS: dict[str, type[Activation]] = {
    "Relu": act.Relu,
    "Tanh": act.Tanh,
    "Sigmoid": act.Sigmoid,
    "Erf": act.Erf,
    "Gelu": act.Gelu,
    "Softplus": act.Softplus,
    "HardSigmoid": act.HardSigmoid,
    "HardSwish": act.HardSwish,
    "LeakyRelu": act.LeakyRelu,
}
ACTIVATION_TYPES: tuple[str, ...] = tuple(ACTIVATIONS)
# smooth activations with f'' enclosed: members of elementwise chains (engine/fused.py)
FUSABLE_ACTIVATIONS: tuple[str, ...] = tuple(t for t, c in ACTIVATIONS.items() if c.fusable)
# the arithmetic elementwise functions (Pow's constant exponent as the attribute "exponent")
ARITHMETIC: dict[str, type[Arithmetic]] = {
    "Exp": ar.Exp,
    "Sqrt": ar.Sqrt,
    "Reciprocal": ar.Reciprocal,
    "Pow": ar.Pow,
}
ARITHMETIC_TYPES: tuple[str, ...] = tuple(ARITHMETIC)
# the row-wise normalisations (not elementwise: their rules read rows along an axis)
NORMS: dict[str, type[Operator]] = {
    "Softmax": Softmax,
}
OPERATORS: dict[str, type[Operator]] = {**ACTIVATIONS, **ARITHMETIC, **NORMS}
_BY_KIND = {c.kind: t for t, c in ACTIVATIONS.items()}
_ARITHMETIC_BY_KIND = {c.kind: t for t, c in ARITHMETIC.items()}


def activation(op_type: str, attrs: Mapping[str, Any] | None = None) -> Activation | None:
    """The activation op for a node's type and attributes; None: not an activation."""
    cls = ACTIVATIONS.get(op_type)
    return None if cls is None else cls(op_type, attrs)


def make(op_type: str, attrs: Mapping[str, Any] | None = None) -> Operator | None:
    """The operator for a node's type and attributes; None: not in the registry."""
    cls = OPERATORS.get(op_type)
    return None if cls is None else cls(op_type, attrs)


def arithmetic(op_type: str, attrs: Mapping[str, Any] | None = None) -> Arithmetic | None:
    """The arithmetic op for a node's type and attributes; None: not one."""
    cls = ARITHMETIC.get(op_type)
    return None if cls is None else cls(op_type, attrs)


def arithmetic_by_kind(kind: str, attrs: Mapping[str, Any] | None = None
                       ) -> Arithmetic | None:
    """The arithmetic op the local engine names `kind` ("exp", ..., "pow"); None: none."""
    t = _ARITHMETIC_BY_KIND.get(kind)
    return None if t is None else arithmetic(t, attrs)


def by_kind(kind: str, attrs: Mapping[str, Any] | None = None) -> Activation | None:
    """The activation whose reports name it `kind` ("tanh", ...); None: no such one."""
    t = _BY_KIND.get(kind)
    return None if t is None else activation(t, attrs)


__all__ = ["ACTIVATIONS", "ACTIVATION_TYPES", "ARITHMETIC", "ARITHMETIC_TYPES",
           "FUSABLE_ACTIVATIONS", "NORMS", "OPERATORS", "activation", "arithmetic",
           "arithmetic_by_kind", "by_kind", "make"]
