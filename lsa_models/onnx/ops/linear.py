"""Linear algebra: MatMul and Gemm; their evaluation and global rule are the classes' in
lsa_models/operators/linear.py."""

from __future__ import annotations

from .base import RegistryOp, register


@register
class LinearOp(RegistryOp):
    types = ("MatMul", "Gemm")
