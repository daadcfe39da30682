"""Pointwise activations and Softmax.

The activations' every mode is their class's in lsa_models/operators/ (docs/operators.md).
"""

from __future__ import annotations

from torch import Tensor

from ...bounds.numerics import mul_up
from ...operators import ACTIVATION_TYPES, ModeNotImplemented, activation
from ...operators.activation import Activation
from ...operators.linear import row_width
from ...operators.softmax import Softmax
from .base import Arg, Flow, Node, NotCertified, Op, RunContext, register

# ---- activations: every mode in lsa_models/operators/activation.py --------------------------

@register
class ActivationOp(Op):
    types = ACTIVATION_TYPES

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        return [_op(node).evaluate(x)]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a = args[0]
        assert isinstance(a, Flow)
        op = _op(node)
        try:
            radius = op.token_radius(a.radius, row_width(a.shape))
            return [Flow(mul_up(a.lip, op.global_factor()), radius, out_shapes[0])]
        except ModeNotImplemented as e:
            raise NotCertified(f"{node.op_type} node {node.name}: {e}") from None


def _op(node: Node) -> Activation:
    op = activation(node.op_type, node.attrs)
    assert op is not None
    return op


@register
class SoftmaxOp(Op):
    types = ("Softmax",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        assert ins[0] is not None
        return [Softmax(node.op_type, node.attrs).evaluate(ins[0])]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a = args[0]
        assert isinstance(a, Flow)
        op = Softmax(node.op_type, node.attrs)  # operators/softmax.py
        radius = op.token_radius(a.radius, row_width(a.shape), len(a.shape))
        return [Flow(mul_up(a.lip, op.global_factor()), radius, out_shapes[0])]
