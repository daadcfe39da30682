"""Constants, shapes, masks and Einsum; their evaluation and global rule are the classes' in
lsa_models/operators/: constants.py (Constant, Shape, ConstantOfShape and the constant
tables' functions), masks.py (Where, the comparisons and logic, Trilu, Max/Min clips) and
linear.py (Einsum)."""

from __future__ import annotations

from ...operators.registry import CONSTANTS, MASKS
from .base import RegistryOp, register


@register
class ConstantOp(RegistryOp):
    types = (*CONSTANTS, *MASKS, "Einsum")
