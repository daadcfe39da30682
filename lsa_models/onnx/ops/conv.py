"""Conv: its evaluation and global rule are the class's in lsa_models/operators/conv.py
(docs/bounds.md, "Conv")."""

from __future__ import annotations

from collections.abc import Sequence

from ...operators.conv import Conv
from .base import Node, RegistryOp, register


@register
class ConvOp(RegistryOp):
    types = ("Conv",)


def patchwise_reason(node: Node, kernel: Sequence[int]) -> str | None:
    """Why the Conv is not a patch embedding (kernel == stride, no padding, dilation or
    groups), or None when it is. `kernel`: its spatial kernel shape."""
    return Conv(node.op_type, node.attrs).patchwise_reason(kernel)
