"""Linear algebra: MatMul and Gemm; their evaluation and global rule are the classes' in
lsa_models/operators/linear.py."""

from __future__ import annotations

from torch import Tensor

from ...operators.linear import Gemm
from .base import Node, RegistryOp, register


@register
class LinearOp(RegistryOp):
    types = ("MatMul", "Gemm")


def gemm_epilogue(node: Node, product: Tensor, ins: list[Tensor | None]) -> Tensor:
    """What Gemm does after its product: `alpha A'B' + beta C`."""
    return Gemm(node.op_type, node.attrs).epilogue(product, ins)
