"""Ops the global analysis meets on constants and shapes only: Constant, Shape/Size,
ConstantOfShape, and the elementwise functions of position and scale tables (Range, Mod, Log,
Cos, Sin; Exp, Sqrt, Reciprocal and Pow, where a graph computes a constant with them, are their
classes in arithmetic.py, which evaluate them here too).

Their global mode evaluates them: a node whose inputs are all constants is a constant. On an
input-dependent operand they have no rule: a Shape's output is a constant of any input (the
front end never bounds it); the others are refused ("applied to an input-dependent tensor
outside a recognised pattern") unless a pattern took their node first (decomposed LayerNorm
and RMSNorm, GELU's Erf form, softmax's Exp). The input-dependent Exp, Sqrt, Reciprocal and
Pow are one class each in arithmetic.py, every mode (local and global: `evaluate_inputs`, Pow's
exponent read as an operand, a tensor, not an attribute, and the same refusal as here).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import torch
from torch import Tensor

from .linear import OUTSIDE_PATTERN, Arg, GlobalOperator, Out, Unevaluable, ints


def from_proto(t: onnx.TensorProto, float_dtype: torch.dtype | None) -> Tensor:
    """An ONNX tensor as torch: floats in the evaluator's precision, other types as stored."""
    arr = onnx.numpy_helper.to_array(t)
    if np.issubdtype(arr.dtype, np.floating) and float_dtype == torch.float64:
        return torch.from_numpy(arr.astype(np.float64))  # one pass: convert and own the copy
    out = torch.from_numpy(np.array(arr, copy=True))
    return out.to(float_dtype) if out.is_floating_point() else out


class ConstantOnly(GlobalOperator):
    """An op with no rule on input-dependent operands outside a recognised pattern."""

    def global_bound(self, args: Sequence[Arg], out_shapes: list[tuple[int, ...]],
                     norm: str) -> list[Out | None]:
        raise self.refused(OUTSIDE_PATTERN)


class Constant(ConstantOnly):
    types = ("Constant",)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        a = self.attrs
        if "value" in a:
            return [from_proto(a["value"], float_dtype)]
        if "value_float" in a:
            return [torch.tensor(a["value_float"], dtype=float_dtype)]
        if "value_floats" in a:
            return [torch.tensor(list(a["value_floats"]), dtype=float_dtype)]
        if "value_int" in a:
            return [torch.tensor(a["value_int"], dtype=torch.int64)]
        if "value_ints" in a:
            return [torch.tensor(list(a["value_ints"]), dtype=torch.int64)]
        raise Unevaluable(": unsupported value attribute")


class Shape(GlobalOperator):
    """Shape and Size: constants of any input (the front end never bounds their output)."""

    types = ("Shape", "Size")

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        if self.op_type == "Size":
            return [torch.tensor(x.numel(), dtype=torch.int64)]
        dims = list(x.shape)
        start = int(self.attrs.get("start", 0))
        end = self.attrs.get("end")
        return [torch.tensor(dims[start:None if end is None else int(end)], dtype=torch.int64)]


class ConstantOfShape(ConstantOnly):
    types = ("ConstantOfShape",)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        shape = ints(ins[0])
        if "value" in self.attrs:
            v = from_proto(self.attrs["value"], float_dtype).reshape(())
        else:
            v = torch.tensor(0.0, dtype=float_dtype)
        return [torch.full(shape, v.item(), dtype=v.dtype)]


_TABLES = {"Cos": torch.cos, "Sin": torch.sin, "Log": torch.log}


class ConstantFunction(ConstantOnly):
    """Range, Mod, Log, Cos, Sin on constants."""

    types = ("Range", "Mod", "Log", "Cos", "Sin")

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        t = self.op_type
        x = ins[0]
        assert x is not None
        if t in _TABLES:
            return [_TABLES[t](x)]
        y = ins[1]
        assert y is not None
        if t == "Mod":
            return [torch.fmod(x, y) if self.attrs.get("fmod", 0) else torch.remainder(x, y)]
        start, limit, delta = (v.item() for v in ins)  # type: ignore[union-attr]  # Range
        return [torch.arange(start, limit, delta, dtype=x.dtype)]


__all__ = ["Constant", "ConstantFunction", "ConstantOfShape", "ConstantOnly", "Shape",
           "from_proto"]
