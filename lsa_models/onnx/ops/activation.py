"""Pointwise activations and Softmax."""

from __future__ import annotations

import torch
from torch import Tensor

from ...bounds.numerics import (
    ACTIVATION_LIPSCHITZ,
    mul_up,
    sqrt_up,
)
from .base import (
    ERF_LIPSCHITZ,
    SOFTMAX_LIPSCHITZ,
    Arg,
    Flow,
    Node,
    Op,
    RunContext,
    _row_width,
    register,
)

# ---- activations --------------------------------------------------------------------------

@register
class ActivationOp(Op):
    types = ("Relu", "Tanh", "Sigmoid", "Gelu", "Erf")

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        t = node.op_type
        if t == "Relu":
            return [torch.relu(x)]
        if t == "Tanh":
            return [torch.tanh(x)]
        if t == "Sigmoid":
            return [torch.sigmoid(x)]
        if t == "Erf":
            return [torch.erf(x)]
        approx = node.attrs.get("approximate", b"none")
        approx = approx.decode() if isinstance(approx, bytes) else str(approx)
        return [torch.nn.functional.gelu(x, approximate=approx)]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a = args[0]
        assert isinstance(a, Flow)
        t = node.op_type
        lip = ERF_LIPSCHITZ if t == "Erf" else ACTIVATION_LIPSCHITZ[t.lower()]
        width = _row_width(a.shape)
        if t in ("Sigmoid",):
            radius: float | None = sqrt_up(width)  # values in (0, 1)
        elif t in ("Tanh", "Erf"):
            radius = sqrt_up(width) if a.radius is None else min(sqrt_up(width),
                                                                 mul_up(lip, a.radius))
        else:
            # act(0) = 0 and |act(x)| <= L |x| coordinate-wise
            radius = None if a.radius is None else mul_up(lip, a.radius)
        return [Flow(mul_up(a.lip, lip), radius, out_shapes[0])]


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


