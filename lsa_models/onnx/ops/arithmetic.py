"""Elementwise arithmetic: Add/Sub, Mul/Div by constants (or two token-bounded tensors), Neg;
their evaluation and global rule are the classes' in lsa_models/operators/linear.py."""

from __future__ import annotations

from ...operators.linear import Refused, product_bound
from .base import Flow, Node, NotCertified, RegistryOp, register


@register
class AddSubOp(RegistryOp):
    types = ("Add", "Sub")


@register
class MulDivOp(RegistryOp):
    types = ("Mul", "Div")


@register
class NegOp(RegistryOp):
    types = ("Neg",)


def _product_flow(node: Node, a: Flow, b: Flow, shape: tuple[int, ...]) -> Flow:
    """`a * b` of two input-dependent tensors with bounded tokens (operators.linear's
    `product_bound`) as the flow of the node's output."""
    try:
        out = product_bound(a, b, shape)
    except Refused as e:
        raise NotCertified(f"{node.op_type} node {node.name}{e.tail}") from None
    return Flow(out.lip, out.radius, shape)
