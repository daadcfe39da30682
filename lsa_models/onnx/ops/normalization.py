"""LayerNormalization (its modes: lsa_models/operators/normalization.py); the decomposed
LayerNorm and RMSNorm are recognised in patterns.py and bounded as the engine's Norm layers."""

from __future__ import annotations

import numpy as np
from torch import Tensor

from ...bounds.formulas import linear_bound
from ...bounds.numerics import add_up, mul_up, sqrt_up
from ...operators import ModeNotImplemented
from ...operators.linear import row_width
from ...operators.normalization import LayerNormalization
from .base import Arg, Flow, Node, NotCertified, Op, RunContext, register


@register
class LayerNormOp(Op):
    types = ("LayerNormalization",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        x, scale = ins[0], ins[1]
        assert x is not None and scale is not None
        bias = ins[2] if len(ins) > 2 else None
        return [LayerNormalization(node.op_type, node.attrs).evaluate(x, scale, bias)]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a, gamma = args[0], args[1]
        beta = args[2] if len(args) > 2 else None
        if not isinstance(a, Flow) or not isinstance(gamma, np.ndarray) \
                or isinstance(beta, Flow):
            raise NotCertified(f"LayerNormalization node {node.name}: scale and bias must be "
                               "constants")
        if int(node.attrs.get("axis", -1)) % len(a.shape) != len(a.shape) - 1:
            raise NotCertified(f"LayerNormalization node {node.name} normalises over more "
                               "than the last axis")
        # the native Norm layer's numbers: the op's global factor, output tokens below
        # sqrt(D) max|gamma| + ||beta||
        width = row_width(out_shapes[0])
        g = np.broadcast_to(np.asarray(gamma, dtype=np.float64), (width,))
        try:
            upper = LayerNormalization(node.op_type, node.attrs).lipschitz(g, norm)
        except ModeNotImplemented:
            raise NotCertified("LayerNorm with epsilon <= 0 is not Lipschitz") from None
        b = 0.0 if beta is None else linear_bound(
            np.broadcast_to(np.asarray(beta, dtype=np.float64), (width,))[None, :], "2")
        radius = add_up(mul_up(sqrt_up(width), float(np.abs(g).max())), b)
        return [Flow(mul_up(a.lip, upper), radius, out_shapes[0])]
