"""Elementwise arithmetic: Add/Sub, Mul/Div by constants (or two token-bounded tensors), Neg;
their evaluation and global rule are the classes' in lsa_models/operators/linear.py."""

from __future__ import annotations

from .base import RegistryOp, register


@register
class ArithmeticOp(RegistryOp):
    types = ("Add", "Sub", "Mul", "Div", "Neg")
