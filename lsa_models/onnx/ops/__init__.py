"""The ONNX op registry (`OPS`): for each op type, a torch implementation and a Lipschitz rule,
one module per family (`lsa supports` lists them by module). Most evaluation and global rules
are the classes' in lsa_models/operators/ (docs/operators.md), read through `base.RegistryOp`,
which names the node in their refusals; importing this package registers every family.
"""

from __future__ import annotations

# FLOAT_TYPES and decimal_attr: read through this package by lsa_models/engine
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
    "supported_op_types",
    "tensor_from_proto",
    "unsupported_ops",
]
