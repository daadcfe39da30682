"""Conv: its evaluation and global rule are the class's in lsa_models/operators/conv.py
(docs/bounds.md, "Conv")."""

from __future__ import annotations

from .base import RegistryOp, register


@register
class ConvOp(RegistryOp):
    types = ("Conv",)
