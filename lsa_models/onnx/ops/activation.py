"""Pointwise activations and Softmax.

The activations' every mode is their class's in lsa_models/operators/ (docs/operators.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...bounds.numerics import mul_up, sqrt_up
from ...operators import ACTIVATION_TYPES, ModeNotImplemented, activation
from ...operators.activation import Activation
from .base import (
    SOFTMAX_LIPSCHITZ,
    Arg,
    Flow,
    Node,
    NotCertified,
    Op,
    RunContext,
    _row_width,
    register,
)

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
            radius = op.token_radius(a.radius, _row_width(a.shape))
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
        return [torch.softmax(ins[0], dim=int(node.attrs.get("axis", -1)))]  # type: ignore[arg-type]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a = args[0]
        assert isinstance(a, Flow)
        axis = int(node.attrs.get("axis", -1)) % max(len(a.shape), 1)
        # probabilities: a row along the softmax axis has 2-norm <= 1, any row <= sqrt(width)
        radius = 1.0 if axis == len(a.shape) - 1 else sqrt_up(_row_width(a.shape))
        return [Flow(mul_up(a.lip, SOFTMAX_LIPSCHITZ), radius, out_shapes[0])]


