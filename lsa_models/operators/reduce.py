"""The reduction family: ReduceMean, ReduceSum and ReduceMax (Where: masks.py).

A mean or a max of m entries is 1-Lipschitz in both norms; a sum of m entries is sqrt(m) in
the 2-norm and m in the inf-norm (m: the input's entries per output entry). The reduced
tensor's rows are not the input's tokens: no radius.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from ..bounds.numerics import mul_up, sqrt_up
from .linear import Arg, GlobalOperator, Out, axes_of, is_var


class Reduce(GlobalOperator):
    types = ("ReduceMean", "ReduceSum", "ReduceMax")

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        axes = axes_of(ins, self.attrs)
        keep = bool(self.attrs.get("keepdims", 1))
        if not axes:
            if self.attrs.get("noop_with_empty_axes", 0):
                return [x]
            axes = list(range(x.dim()))
        dims = tuple(sorted(a % x.dim() for a in axes))
        if self.op_type == "ReduceMean":
            return [x.mean(dim=dims, keepdim=keep)]
        if self.op_type == "ReduceSum":
            return [x.sum(dim=dims, keepdim=keep)]
        return [x.amax(dim=dims, keepdim=keep)]

    def global_bound(self, args: Sequence[Arg], out_shapes: list[tuple[int, ...]],
                     norm: str) -> list[Out | None]:
        a = args[0]
        assert is_var(a)
        m = max(int(np.prod(a.shape)) // max(int(np.prod(out_shapes[0])), 1), 1)
        # a mean or a max of m entries is 1-Lipschitz in both norms; a sum is not
        factor = (sqrt_up(m) if norm == "2" else float(m)) if self.op_type == "ReduceSum" \
            else 1.0
        return [Out(mul_up(a.lip, factor), None)]


__all__ = ["Reduce"]
