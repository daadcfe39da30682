"""Layout ops: reshape, transpose, slice, gather, concat, split, expand, cast; their
evaluation and global rule are the classes' in lsa_models/operators/layout.py."""

from __future__ import annotations

from .base import RegistryOp, register


@register
class LayoutOp(RegistryOp):
    types = ("Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Dropout",
             "Cast", "Slice", "Gather", "GatherElements", "Concat", "Split", "Expand")
