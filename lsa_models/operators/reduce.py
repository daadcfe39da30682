"""The reduction family: ReduceMean, ReduceSum and ReduceMax; and Where by a constant mask.

A mean or a max of m entries is 1-Lipschitz in both norms; a sum of m entries is sqrt(m) in
the 2-norm and m in the inf-norm (m: the input's entries per output entry). The reduced
tensor's rows are not the input's tokens: no radius. Where with a constant condition selects
entries: each output entry copies one entry of one branch, so the 2-norm constant is
sqrt(Lx^2 + Ly^2) when both branches depend on the input (the max in the inf-norm, or with one
input-dependent branch); an input-dependent condition, or a branch broadcast to the output,
has no rule.

The other modes live in the local engine today: the Jacobian enclosure and the affine forms
(engine/rules.py, engine/affine_linear.py, engine/affine_masks.py), the tangent and adjoint
graphs (engine/tangent.py, adjoint.py), the forward error (engine/forward_error.py) and the ball
arithmetic (engine/forward_ball.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from ..bounds.numerics import add_up, mul_up, sqrt_up
from .linear import Arg, GlobalOperator, Out, ints, is_var


class Reduce(GlobalOperator):
    types = ("ReduceMean", "ReduceSum", "ReduceMax")

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        axes = ints(ins[1]) if len(ins) > 1 and ins[1] is not None else list(
            self.attrs.get("axes", []))
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


__all__ = ["Reduce", "Where"]
