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


@register
class ActivationOp(Op):
    """The pointwise activations and Softmax: the class's global factor composed with the
    input's constant, and the token radius it passes on."""

    types = (*ACTIVATION_TYPES, "Softmax")

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        assert ins[0] is not None
        return [_op(node).evaluate(ins[0])]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a = args[0]
        assert isinstance(a, Flow)
        op = _op(node)
        try:
            if isinstance(op, Softmax):
                radius = op.token_radius(a.radius, row_width(a.shape), len(a.shape))
            else:
                radius = op.token_radius(a.radius, row_width(a.shape))
            return [Flow(mul_up(a.lip, op.global_factor()), radius, out_shapes[0])]
        except ModeNotImplemented as e:
            raise NotCertified(f"{node.op_type} node {node.name}: {e}") from None


def _op(node: Node) -> Activation | Softmax:
    op = Softmax(node.op_type, node.attrs) if node.op_type == "Softmax" else activation(
        node.op_type, node.attrs)
    assert op is not None
    return op
