"""The operator registry: ONNX op type -> the class that owns every mode of it
(auto_LiRPA's `bound_op_map`). Adding an op: one class in the family's file, one line here
(docs/operators.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import activation as act
from . import arithmetic as ar
from . import constants as cs
from . import conv as cv
from . import layout as lo
from . import linear as li
from . import masks as ms
from . import reduce as rd
from .activation import Activation
from .arithmetic import Arithmetic
from .base import Operator
from .linear import GlobalOperator
from .normalization import LayerNormalization
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
# smooth activations with f'' enclosed: members of elementwise chains (engine/elementwise_chains.py)
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
    "LayerNormalization": LayerNormalization,
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


# the linear maps, layouts and reductions: their evaluation and global mode (onnx/ops reads
# them through `global_operator`)
LINEAR_MAPS: dict[str, type[GlobalOperator]] = {
    "MatMul": li.MatMul, "Gemm": li.Gemm, "Add": li.AddSub, "Sub": li.AddSub,
    "Mul": li.MulDiv, "Div": li.MulDiv, "Neg": li.Neg, "Einsum": li.Einsum,
    "Conv": cv.Conv,
    "Reshape": lo.Reshape, "Flatten": lo.Flatten, "Transpose": lo.Transpose,
    "Squeeze": lo.Squeeze, "Unsqueeze": lo.Squeeze, "Identity": lo.Identity,
    "Dropout": lo.Identity, "Cast": lo.Cast, "Slice": lo.Slice, "Gather": lo.Gather,
    "GatherElements": lo.GatherElements, "Concat": lo.Concat, "Split": lo.Split,
    "Expand": lo.Expand,
    "ReduceMean": rd.Reduce, "ReduceSum": rd.Reduce, "ReduceMax": rd.Reduce,
}
# the masks and clips: Where, the comparisons and logic, Trilu, Max/Min
MASKS: dict[str, type[GlobalOperator]] = {
    "Where": ms.Where, "Trilu": ms.Trilu, "Max": ms.MaxMin, "Min": ms.MaxMin,
    **{t: ms.Compare for t in ms.Compare.types},
}
# what the global analysis evaluates on constants and shapes only (ARITHMETIC's classes too:
# one class per op, evaluated on constants, refused on an input-dependent operand)
CONSTANTS: dict[str, type[GlobalOperator]] = {
    "Constant": cs.Constant, "Shape": cs.Shape, "Size": cs.Shape,
    "ConstantOfShape": cs.ConstantOfShape,
    **{t: cs.ConstantFunction for t in cs.ConstantFunction.types},
    **ARITHMETIC,
}
GLOBAL_OPERATORS: dict[str, type[GlobalOperator]] = {**LINEAR_MAPS, **MASKS, **CONSTANTS}
# (not in OPERATORS yet: the engine reads `make` as "an elementwise or row-wise op", e.g.
# forward_error's range fallback; it joins when those readers dispatch by family)


def global_operator(op_type: str, attrs: Mapping[str, Any] | None = None
                    ) -> GlobalOperator | None:
    """The op of a node's global mode (evaluation and rule); None: not one."""
    cls = GLOBAL_OPERATORS.get(op_type)
    return None if cls is None else cls(op_type, attrs)


__all__ = ["ACTIVATIONS", "ACTIVATION_TYPES", "ARITHMETIC", "ARITHMETIC_TYPES", "CONSTANTS",
           "FUSABLE_ACTIVATIONS", "GLOBAL_OPERATORS", "LINEAR_MAPS", "MASKS", "NORMS",
           "OPERATORS", "activation", "arithmetic", "arithmetic_by_kind", "by_kind",
           "global_operator", "make"]
