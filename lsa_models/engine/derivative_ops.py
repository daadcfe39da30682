"""Ops that only the derived graphs (derived/tangent.py, derived/adjoint.py) contain, never a model:
they are not in `onnx.ops.OPS`, so an uploaded graph naming one is refused like any unknown op.

`ReluGrad(g, x) = g * H(x)`, H the step (x > 0, as torch differentiates Relu): the tangent
and the adjoint of `Relu(x)` alike (its Jacobian is diagonal). At x = 0 Relu has no derivative;
the Lipschitz constant is a supremum over the points where it has one, and the rules below
enclose both 0 and 1 wherever x's range reaches 0.
"""

from __future__ import annotations

import torch

from lsa_models.onnx.ops import OPS, Node, RunContext

RELU_GRAD = "ReluGrad"
# model ops whose boolean output the derived graphs treat as a guard (SDPA's
# Where(IsNaN(p), 0, p)): no tangent or adjoint of their own; the affine walk proves them
# False where their input's form is finite (affine/masks.py, _guard)
GUARDS = ("IsNaN", "IsInf")


def run_op(node: Node, ins: list[torch.Tensor | None], ctx: RunContext) -> list[torch.Tensor]:
    """The node's outputs: an internal op's, or the ONNX op's (`OPS`)."""
    if node.op_type == RELU_GRAD:
        g, x = ins[0], ins[1]
        assert g is not None and x is not None
        return [g * (x > 0).to(g.dtype)]  # exact: a product with 0 or 1
    return OPS[node.op_type].run(node, ins, ctx)
