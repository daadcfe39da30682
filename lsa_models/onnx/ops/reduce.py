"""Reductions (ReduceSum/ReduceMean/...) and Where."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ...bounds.numerics import (
    add_up,
    mul_up,
    sqrt_up,
)
from .base import (
    Arg,
    Flow,
    Node,
    NotCertified,
    Op,
    RunContext,
    _ints,
    register,
)


@register
class ReduceOp(Op):
    types = ("ReduceMean", "ReduceSum", "ReduceMax")

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        axes = _ints(ins[1]) if len(ins) > 1 and ins[1] is not None else list(
            node.attrs.get("axes", []))
        keep = bool(node.attrs.get("keepdims", 1))
        if not axes:
            if node.attrs.get("noop_with_empty_axes", 0):
                return [x]
            axes = list(range(x.dim()))
        dims = tuple(sorted(a % x.dim() for a in axes))
        if node.op_type == "ReduceMean":
            return [x.mean(dim=dims, keepdim=keep)]
        if node.op_type == "ReduceSum":
            return [x.sum(dim=dims, keepdim=keep)]
        return [x.amax(dim=dims, keepdim=keep)]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a = args[0]
        assert isinstance(a, Flow)
        m = max(int(np.prod(a.shape)) // max(int(np.prod(out_shapes[0])), 1), 1)
        # a mean or a max of m entries is 1-Lipschitz in both norms; a sum is not
        factor = (sqrt_up(m) if norm == "2" else float(m)) if node.op_type == "ReduceSum" \
            else 1.0
        return [Flow(mul_up(a.lip, factor), None, out_shapes[0])]


@register
class WhereOp(Op):
    types = ("Where",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        c, x, y = ins
        assert c is not None and x is not None and y is not None
        return [torch.where(c.bool(), x, y)]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        c, x, y = args
        if isinstance(c, Flow):
            raise NotCertified(f"Where node {node.name} with an input-dependent condition")
        flows = [f for f in (x, y) if isinstance(f, Flow)]
        if any(f.shape != out_shapes[0] for f in flows):
            raise NotCertified(f"Where node {node.name} broadcasts an input-dependent tensor")
        # a constant mask selects entries: each output entry copies one input entry
        # (2-norm: the selected entries of both inputs, sqrt(Lx^2 + Ly^2); inf-norm: the max)
        if len(flows) == 2 and norm == "2":
            lip = sqrt_up(add_up(*(mul_up(f.lip, f.lip) for f in flows)))
        else:
            lip = max(f.lip for f in flows)
        return [Flow(lip, None, out_shapes[0])]


