"""Reductions (ReduceSum/ReduceMean/ReduceMax); their evaluation and global rule are the
classes' in lsa_models/operators/reduce.py (Where: constant.py)."""

from __future__ import annotations

from .base import RegistryOp, register


@register
class ReduceOp(RegistryOp):
    types = ("ReduceMean", "ReduceSum", "ReduceMax")
