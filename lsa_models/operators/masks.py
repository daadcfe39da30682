"""The mask family: Where by a constant condition, the comparisons and logic that build masks
(Equal, Less, Greater, LessOrEqual, GreaterOrEqual, Not, And, Or, IsNaN, IsInf), Trilu (causal
masks), and Max/Min by constants (clipping).

Where with a constant condition selects entries: each output entry copies one entry of one
branch, so the 2-norm constant is sqrt(Lx^2 + Ly^2) when both branches depend on the input
(the max in the inf-norm, or with one input-dependent branch); an input-dependent condition,
or a branch broadcast to the output, has no rule. Max/Min of an input-dependent tensor with
constants of no larger shape clips each entry: 1-Lipschitz in both norms, no radius. The
comparisons, logic and Trilu are step functions or mask builders: on input-dependent
operands they have no rule outside a recognised pattern (attention's masks, NaN guards).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from ..bounds.numerics import add_up, mul_up, sqrt_up
from .constants import ConstantOnly
from .linear import OUTSIDE_PATTERN, Arg, GlobalOperator, Out, is_var


class Where(GlobalOperator):
    types = ("Where",)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        c, x, y = ins
        assert c is not None and x is not None and y is not None
        return [torch.where(c.bool(), x, y)]

    def global_bound(self, args: Sequence[Arg], out_shapes: list[tuple[int, ...]],
                     norm: str) -> list[Out | None]:
        c, x, y = args
        if is_var(c):
            raise self.refused(" with an input-dependent condition")
        flows = [f for f in (x, y) if is_var(f)]
        if any(f.shape != out_shapes[0] for f in flows):
            raise self.refused(" broadcasts an input-dependent tensor")
        # a constant mask selects entries: each output entry copies one input entry
        # (2-norm: the selected entries of both inputs, sqrt(Lx^2 + Ly^2); inf-norm: the max)
        if len(flows) == 2 and norm == "2":
            lip = sqrt_up(add_up(*(mul_up(f.lip, f.lip) for f in flows)))
        else:
            lip = max(f.lip for f in flows)
        return [Out(lip, None)]


_UNARY: dict[str, Callable[[Tensor], Tensor]] = {
    "Not": torch.logical_not, "IsNaN": torch.isnan, "IsInf": torch.isinf}
_BINARY: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "Equal": torch.eq, "Less": torch.lt, "Greater": torch.gt, "LessOrEqual": torch.le,
    "GreaterOrEqual": torch.ge, "And": torch.logical_and, "Or": torch.logical_or}


class Compare(ConstantOnly):
    """The comparisons and logic: boolean outputs, no rule on input-dependent operands."""

    types = (*_BINARY, *_UNARY)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        if self.op_type in _UNARY:
            return [_UNARY[self.op_type](x)]
        y = ins[1]
        assert y is not None
        return [_BINARY[self.op_type](x, y)]


class Trilu(ConstantOnly):
    types = ("Trilu",)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        y = ins[1] if len(ins) > 1 else None
        k = int(y.item()) if y is not None else 0
        upper = bool(self.attrs.get("upper", 1))
        return [torch.triu(x, k) if upper else torch.tril(x, k)]


class MaxMin(GlobalOperator):
    """Max/Min of its operands; bounded when the first is input-dependent and of the output's
    shape and the others are constants (a clip)."""

    types = ("Max", "Min")

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        out = ins[0]
        assert out is not None
        for z in ins[1:]:
            assert z is not None
            out = torch.maximum(out, z) if self.op_type == "Max" else torch.minimum(out, z)
        return [out]

    def global_bound(self, args: Sequence[Arg], out_shapes: list[tuple[int, ...]],
                     norm: str) -> list[Out | None]:
        a = args[0]
        if all(isinstance(c, np.ndarray) for c in args[1:]) and is_var(a) \
                and a.shape == out_shapes[0]:
            return [Out(a.lip, None)]  # clipping is 1-Lipschitz
        raise self.refused(OUTSIDE_PATTERN)


__all__ = ["Compare", "MaxMin", "Trilu", "Where"]
