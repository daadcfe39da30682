"""The ONNX op registry: for each op family, a torch implementation and a Lipschitz rule.

One module per op family (auto_LiRPA's `operators/` layout): `linear` (MatMul, Gemm),
`arithmetic` (Add/Sub/Mul/Div/Neg), `activation` (pointwise activations; Softmax),
`normalization` (LayerNormalization), `conv` (Conv), `layout` (reshape, transpose, slice,
gather, concat, ...), `reduce` (reductions), `constant` (constants, shapes, masks, Max/Min
clips, Einsum). The activations', linear maps', layouts', reductions', masks' and constants'
evaluation and global rule are their classes' in lsa_models/operators/ (docs/operators.md);
`base.RegistryOp` reads them and names the node in their refusals. Each module registers its
ops in `base.OPS` with `@register`; importing this package imports them all, so the registry
is complete whenever `OPS` is reachable.
"""

from __future__ import annotations

from ...operators.layout import FLOAT_TYPES
from ...operators.normalization import decimal_attr
from . import activation, arithmetic, constant, conv, layout, linear, normalization, reduce
from .base import (
    OPS,
    Flow,
    Node,
    NotCertified,
    RunContext,
    supported_op_types,
    tensor_from_proto,
    unsupported_ops,
)
from .conv import patchwise_reason
from .linear import gemm_epilogue

FAMILIES = (activation, arithmetic, constant, conv, layout, linear, normalization, reduce)

__all__ = [
    "FAMILIES",
    "FLOAT_TYPES",
    "OPS",
    "Flow",
    "Node",
    "NotCertified",
    "RunContext",
    "decimal_attr",
    "gemm_epilogue",
    "patchwise_reason",
    "supported_op_types",
    "tensor_from_proto",
    "unsupported_ops",
]
