"""The convolution family: Conv, evaluated in every form and bounded in every form
(docs/bounds.md, "Conv").

A Conv applies one matrix per group (the group's kernel reshaped to (out/g, C/g * prod k)) to
each patch of its (zero-padded) input. Patch embeddings (kernel == stride, no padding,
dilation or groups) have disjoint patches: the operator norm is that matrix's (2: spectral
norm; inf: largest absolute row sum). In general a pixel lies in at most
`m = prod_a ceil(k_a gcd(d_a, s_a) / s_a)` patches, so the 2-norm constant is
`sqrt(m) max_g ||K_g||_2`; the inf-norm constant is still the largest absolute row sum. The
output's rows (image columns) are not tokens: no radius. Only an input-dependent image with a
constant kernel and bias has a rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..bounds.formulas import linear_bound
from ..bounds.numerics import mul_up, sqrt_up
from .base import text_attr
from .linear import Arg, GlobalOperator, Out, Unevaluable, is_var

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


class Conv(GlobalOperator):
    types = ("Conv",)

    def spatial(self, name: str, k: int, default: int) -> list[int]:
        vals = self.attrs.get(name)
        return [default] * k if vals is None else [int(v) for v in vals]

    def patchwise_reason(self, kernel: Sequence[int]) -> str | None:
        """Why the Conv is not a patch embedding (kernel == stride, no padding, dilation or
        groups), or None when it is. `kernel`: its spatial kernel shape."""
        k = len(kernel)
        strides = self.spatial("strides", k, 1)
        pads = self.spatial("pads", 2 * k, 0)
        dilations = self.spatial("dilations", k, 1)
        auto_pad = text_attr(self.attrs, "auto_pad", "NOTSET")
        if list(kernel) != strides:
            return (f"its kernel {tuple(kernel)} differs from its strides {tuple(strides)} "
                    "(overlapping or gapped patches)")
        if any(pads) or auto_pad not in ("NOTSET", "VALID"):
            return "it pads its input"
        if any(d != 1 for d in dilations):
            return f"it is dilated {tuple(dilations)}"
        if int(self.attrs.get("group", 1)) != 1:
            return f"it has {self.attrs.get('group')} groups"
        return None

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        x, w = ins[0], ins[1]
        assert x is not None and w is not None
        bias = ins[2] if len(ins) > 2 else None
        k = w.dim() - 2
        if k not in _CONV:
            raise Unevaluable(f": {k}-D convolutions")
        auto_pad = self.attrs.get("auto_pad", b"NOTSET")
        if text_attr(self.attrs, "auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
            raise Unevaluable(f": auto_pad={auto_pad!r}")
        pads = self.spatial("pads", 2 * k, 0)  # (begin_1..begin_k, end_1..end_k)
        if any(pads):
            # F.pad takes (last axis begin, end, previous axis begin, end, ...)
            x = F.pad(x, [p for i in reversed(range(k)) for p in (pads[i], pads[i + k])])
        y = _CONV[k](x, w, bias, stride=self.spatial("strides", k, 1),
                     dilation=self.spatial("dilations", k, 1),
                     groups=int(self.attrs.get("group", 1)))
        return [y]

    def global_bound(self, args: Sequence[Arg], out_shapes: list[tuple[int, ...]],
                     norm: str) -> list[Out | None]:
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else None
        if not (is_var(x) and isinstance(w, np.ndarray)) or is_var(bias):
            raise self.refused(": only an input-dependent image with a constant kernel and "
                               "bias is supported")
        # output rows (last axis: image columns) are not tokens: no radius
        return [Out(mul_up(x.lip, self.operator_norm(w, norm)), None)]

    def patch_overlap(self, kernel: Sequence[int]) -> int:
        """The most patches one input pixel lies in: along axis a, the kernel offsets t with
        `p s + t d = i` for some output position p form an arithmetic progression of step
        `s / gcd(d, s)` in [0, k), so at most `ceil(k gcd(d, s) / s)` of them (1 for a patch
        embedding); the axes multiply. Padding adds zeros, not pixels."""
        k = len(kernel)
        strides = self.spatial("strides", k, 1)
        dilations = self.spatial("dilations", k, 1)
        m = 1
        for ka, sa, da in zip(kernel, strides, dilations, strict=True):
            m *= min(int(ka), -(-int(ka) * math.gcd(int(da), int(sa)) // int(sa)))
        return m

    def operator_norm(self, w: np.ndarray, norm: str) -> float:
        """Certified operator norm of the Conv's linear part on the whole tensor: with `K_g`
        the kernel of group g as a (out/g, C/g * prod k) matrix, 2-norm `sqrt(m) max_g
        ||K_g||_2` (m = patch_overlap), inf-norm `max_o sum |K_o|` (a row of the kernel on its
        patch, whatever the groups)."""
        groups = int(self.attrs.get("group", 1))
        mat = w.reshape(w.shape[0], -1)  # (out_channels, C/g * prod k)
        if norm == "inf":
            return linear_bound(mat, "inf")
        per = w.shape[0] // groups
        blocks = [linear_bound(mat[g * per:(g + 1) * per], "2") for g in range(groups)]
        norm2 = max(blocks)
        m = self.patch_overlap(w.shape[2:])
        # each output position is K_g @ its own patch; a patch embedding's patches are disjoint
        return norm2 if m == 1 else mul_up(sqrt_up(m), norm2)


__all__ = ["Conv"]
