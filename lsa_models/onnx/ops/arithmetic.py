"""Elementwise arithmetic: Add/Sub, Mul/Div by constants, Neg."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ...bounds.numerics import (
    add_up,
    div_up,
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
    _max_row_norm,
    _row_width,
    register,
)

# ---- elementwise arithmetic ---------------------------------------------------------------

def _broadcast_add_radius(flow: Flow, c: np.ndarray) -> float | None:
    if flow.radius is None:
        return None
    c = np.asarray(c, dtype=np.float64)
    width = _row_width(flow.shape)
    if c.ndim == 0 or c.shape[-1] == 1:
        # a scalar (or per-row constant) added to every coordinate of a row
        return add_up(flow.radius, mul_up(float(np.abs(c).max()), sqrt_up(width)))
    return add_up(flow.radius, _max_row_norm(c))


@register
class AddSubOp(Op):
    types = ("Add", "Sub")

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        a, b = ins[0], ins[1]
        return [a + b if node.op_type == "Add" else a - b]  # type: ignore[operator]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a, b = args[0], args[1]
        shape = out_shapes[0]
        if isinstance(a, Flow) and isinstance(b, Flow):
            if a.shape != shape or b.shape != shape:
                raise NotCertified(f"{node.op_type} node {node.name} broadcasts an "
                                   "input-dependent tensor")
            # Lip(f + g) <= Lip(f) + Lip(g): residual connections
            r = None if a.radius is None or b.radius is None else add_up(a.radius, b.radius)
            return [Flow(add_up(a.lip, b.lip), r, shape)]
        flow, const = (a, b) if isinstance(a, Flow) else (b, a)
        assert isinstance(flow, Flow) and isinstance(const, np.ndarray)
        if flow.shape != shape:
            raise NotCertified(f"{node.op_type} node {node.name} broadcasts an "
                               "input-dependent tensor")
        return [Flow(flow.lip, _broadcast_add_radius(flow, const), shape)]


def _product_flow(node: Node, a: Flow, b: Flow, shape: tuple[int, ...]) -> Flow:
    """`a * b` of two input-dependent tensors with bounded tokens (a gated MLP's
    `silu(x W^G) * (x W^U)` behind an RMSNorm): `A B - A' B' = (A - A') B + A' (B - B')`, and
    every entry of a token is at most its 2-norm, so `Lip <= R_b Lip(a) + R_a Lip(b)` in the 2-
    and the inf-norm; tokens have norm `<= R_a R_b` (docs/bounds.md, "Gated MLPs (SwiGLU)")."""
    if a.shape != shape or b.shape != shape:
        raise NotCertified(f"Mul node {node.name} broadcasts an input-dependent tensor")
    assert a.radius is not None and b.radius is not None
    lip = add_up(mul_up(b.radius, a.lip), mul_up(a.radius, b.lip))
    return Flow(lip, mul_up(a.radius, b.radius), shape)


@register
class MulDivOp(Op):
    types = ("Mul", "Div")

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        a, b = ins[0], ins[1]
        assert a is not None and b is not None
        if node.op_type == "Mul":
            return [a * b]
        if not a.is_floating_point() and not b.is_floating_point():
            return [torch.div(a, b, rounding_mode="trunc")]
        return [a / b]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a, b = args[0], args[1]
        if node.op_type == "Mul" and isinstance(b, Flow) and isinstance(a, np.ndarray):
            a, b = b, a
        if node.op_type == "Mul" and isinstance(a, Flow) and isinstance(b, Flow) \
                and a.radius is not None and b.radius is not None:
            return [_product_flow(node, a, b, out_shapes[0])]
        if not (isinstance(a, Flow) and isinstance(b, np.ndarray)):
            raise NotCertified(f"{node.op_type} node {node.name} of two input-dependent "
                               "tensors (or a constant divided by one) outside a recognised "
                               "pattern: not Lipschitz in general (a product of two is bounded "
                               "when both factors' token norms are, e.g. behind a LayerNorm "
                               "or RMSNorm, or with an input radius)")
        if a.shape != out_shapes[0]:
            raise NotCertified(f"{node.op_type} node {node.name} broadcasts an "
                               "input-dependent tensor")
        c = np.abs(np.asarray(b, dtype=np.float64))
        if node.op_type == "Mul":
            factor = float(c.max()) if c.size else 0.0
        else:
            if c.size == 0 or float(c.min()) == 0.0:
                raise NotCertified(f"Div node {node.name} divides by zero")
            factor = div_up(1.0, float(c.min()))
        # a diagonal scaling: operator norm max|c| in both norms; rows shrink or grow alike
        radius = None if a.radius is None else mul_up(a.radius, factor)
        return [Flow(mul_up(a.lip, factor), radius, out_shapes[0])]


@register
class NegOp(Op):
    types = ("Neg",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        return [-ins[0]]  # type: ignore[operator]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a = args[0]
        assert isinstance(a, Flow)
        return [Flow(a.lip, a.radius, out_shapes[0])]


