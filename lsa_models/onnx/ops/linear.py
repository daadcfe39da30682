"""Linear algebra: MatMul and Gemm with a constant weight."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ...bounds.formulas import linear_bound
from ...bounds.numerics import (
    add_up,
    mul_up,
)
from .base import (
    Arg,
    Flow,
    Node,
    NotCertified,
    Op,
    RunContext,
    _max_row_norm,
    register,
)

# ---- linear algebra -----------------------------------------------------------------------

@register
class MatMulOp(Op):
    types = ("MatMul",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        a, b = ins[0], ins[1]
        assert a is not None and b is not None
        if a.dim() > 2 and b.dim() == 2:
            # one (rows, k) @ (k, m) product: torch.matmul runs a seq-first (N, 1, k) input
            # as N separate vector products that each stream the whole weight (4x slower)
            return [(a.reshape(-1, a.shape[-1]) @ b).reshape(*a.shape[:-1], b.shape[-1])]
        return [torch.matmul(a, b)]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a, b = args[0], args[1]
        if isinstance(a, Flow) and isinstance(b, np.ndarray) and b.ndim == 2:
            return [_right_linear(a, b, None, norm, out_shapes[0])]
        if isinstance(a, Flow) and isinstance(b, np.ndarray) and b.ndim > 2:
            # batched constant right factors (per head): the worst one bounds every slice
            mats = b.reshape(-1, b.shape[-2], b.shape[-1])
            flows = [_right_linear(a, m, None, norm, out_shapes[0]) for m in mats]
            return [Flow(max(f.lip for f in flows), _max_or_none([f.radius for f in flows]),
                         out_shapes[0])]
        if isinstance(b, Flow) and isinstance(a, np.ndarray) and a.ndim == 2:
            # C @ X mixes rows (tokens): ||C X||_F <= ||C||_2 ||X||_F; inf: ||C||_inf
            op_norm = linear_bound(a, "2") if norm == "2" else linear_bound(a, "inf")
            return [Flow(mul_up(b.lip, op_norm), None, out_shapes[0])]
        raise NotCertified(f"MatMul node {node.name} multiplies two input-dependent tensors "
                           "outside a recognised attention layer: not Lipschitz in general")


def _max_or_none(xs: list[float | None]) -> float | None:
    return None if any(x is None for x in xs) else max(x for x in xs if x is not None)


def _right_linear(a: Flow, w: np.ndarray, bias: np.ndarray | None, norm: str,
                  out_shape: tuple[int, ...]) -> Flow:
    """`x -> x W (+ b)` on every row, W (in, out) in the row-vector convention."""
    wt = w.T  # torch layout (out, in) for linear_bound (a view: norms read any layout)
    lip = linear_bound(wt, norm)
    radius = None
    if a.radius is not None:
        w2 = lip if norm == "2" else linear_bound(wt, "2")
        radius = mul_up(w2, a.radius)
        if bias is not None:
            radius = add_up(radius, _max_row_norm(np.broadcast_to(bias, (w.shape[1],))
                                                   if bias.ndim == 0 else bias))
    return Flow(mul_up(a.lip, lip), radius, out_shape)


def gemm_epilogue(node: Node, product: Tensor, ins: list[Tensor | None]) -> Tensor:
    """What Gemm does after its product: `alpha A'B' + beta C`."""
    y = node.attrs.get("alpha", 1.0) * product
    if len(ins) > 2 and ins[2] is not None:
        y = y + node.attrs.get("beta", 1.0) * ins[2]
    return y


@register
class GemmOp(Op):
    types = ("Gemm",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        a, b = ins[0], ins[1]
        assert a is not None and b is not None
        if node.attrs.get("transA", 0):
            a = a.T
        if node.attrs.get("transB", 0):
            b = b.T
        return [gemm_epilogue(node, a @ b, ins)]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a, b = args[0], args[1]
        c = args[2] if len(args) > 2 else None
        if not (isinstance(a, Flow) and isinstance(b, np.ndarray)) or isinstance(c, Flow) \
                or node.attrs.get("transA", 0):
            raise NotCertified(f"Gemm node {node.name}: only input @ constant is supported")
        w = b.T if node.attrs.get("transB", 0) else b
        w = w * float(node.attrs.get("alpha", 1.0))
        bias = None if c is None else np.asarray(c) * float(node.attrs.get("beta", 1.0))
        return [_right_linear(a, w, bias, norm, out_shapes[0])]


