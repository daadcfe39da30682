"""Conv: evaluated in every form; bounded in every form (docs/bounds.md, "Conv").

A Conv applies one matrix per group (the group's kernel reshaped to (out/g, C/g * prod k)) to
each patch of its (zero-padded) input. Patch embeddings (kernel == stride, no padding,
dilation or groups) have disjoint patches: the operator norm is that matrix's (2: spectral
norm; inf: largest absolute row sum). In general a pixel lies in at most
`m = prod_a ceil(k_a gcd(d_a, s_a) / s_a)` patches, so the 2-norm constant is
`sqrt(m) max_g ||K_g||_2`; the inf-norm constant is still the largest absolute row sum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch.nn.functional as F
from torch import Tensor

from ...bounds.formulas import linear_bound
from ...bounds.numerics import mul_up, sqrt_up
from .base import Arg, Flow, Node, NotCertified, Op, RunContext, register

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _spatial(node: Node, name: str, k: int, default: int) -> list[int]:
    vals = node.attrs.get(name)
    return [default] * k if vals is None else [int(v) for v in vals]


def patchwise_reason(node: Node, kernel: Sequence[int]) -> str | None:
    """Why the Conv is not a patch embedding (kernel == stride, no padding, dilation or
    groups), or None when it is. `kernel`: its spatial kernel shape."""
    k = len(kernel)
    strides = _spatial(node, "strides", k, 1)
    pads = _spatial(node, "pads", 2 * k, 0)
    dilations = _spatial(node, "dilations", k, 1)
    auto_pad = node.attrs.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
    if list(kernel) != strides:
        return (f"its kernel {tuple(kernel)} differs from its strides {tuple(strides)} "
                "(overlapping or gapped patches)")
    if any(pads) or auto_pad not in ("NOTSET", "VALID"):
        return "it pads its input"
    if any(d != 1 for d in dilations):
        return f"it is dilated {tuple(dilations)}"
    if int(node.attrs.get("group", 1)) != 1:
        return f"it has {node.attrs.get('group')} groups"
    return None


@register
class ConvOp(Op):
    types = ("Conv",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        x, w = ins[0], ins[1]
        assert x is not None and w is not None
        bias = ins[2] if len(ins) > 2 else None
        k = w.dim() - 2
        if k not in _CONV:
            raise NotImplementedError(f"Conv node {node.name}: {k}-D convolutions")
        auto_pad = node.attrs.get("auto_pad", b"NOTSET")
        if (auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)) not in (
                "NOTSET", "VALID"):
            raise NotImplementedError(f"Conv node {node.name}: auto_pad={auto_pad!r}")
        pads = _spatial(node, "pads", 2 * k, 0)  # (begin_1..begin_k, end_1..end_k)
        if any(pads):
            # F.pad takes (last axis begin, end, previous axis begin, end, ...)
            x = F.pad(x, [p for i in reversed(range(k)) for p in (pads[i], pads[i + k])])
        y = _CONV[k](x, w, bias, stride=_spatial(node, "strides", k, 1),
                     dilation=_spatial(node, "dilations", k, 1),
                     groups=int(node.attrs.get("group", 1)))
        return [y]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else None
        if not (isinstance(x, Flow) and isinstance(w, np.ndarray)) or isinstance(bias, Flow):
            raise NotCertified(f"Conv node {node.name}: only an input-dependent image with a "
                               "constant kernel and bias is supported")
        # output rows (last axis: image columns) are not tokens: no radius
        return [Flow(mul_up(x.lip, conv_bound(node, w, norm)), None, out_shapes[0])]


def patch_overlap(node: Node, kernel: Sequence[int]) -> int:
    """The most patches one input pixel lies in: along axis a, the kernel offsets t with
    `p s + t d = i` for some output position p form an arithmetic progression of step
    `s / gcd(d, s)` in [0, k), so at most `ceil(k gcd(d, s) / s)` of them (1 for a patch
    embedding); the axes multiply. Padding adds zeros, not pixels."""
    k = len(kernel)
    strides = _spatial(node, "strides", k, 1)
    dilations = _spatial(node, "dilations", k, 1)
    m = 1
    for ka, sa, da in zip(kernel, strides, dilations, strict=True):
        m *= min(int(ka), -(-int(ka) * math.gcd(int(da), int(sa)) // int(sa)))
    return m


def conv_bound(node: Node, w: np.ndarray, norm: str) -> float:
    """Certified operator norm of the Conv's linear part on the whole tensor (docs/bounds.md,
    "Conv"): with `K_g` the kernel of group g as a (out/g, C/g * prod k) matrix, 2-norm
    `sqrt(m) max_g ||K_g||_2` (m = patch_overlap), inf-norm `max_o sum |K_o|` (a row of the
    kernel on its patch, whatever the groups)."""
    groups = int(node.attrs.get("group", 1))
    mat = w.reshape(w.shape[0], -1)  # (out_channels, C/g * prod k)
    if norm == "inf":
        return linear_bound(mat, "inf")
    per = w.shape[0] // groups
    blocks = [linear_bound(mat[g * per:(g + 1) * per], "2") for g in range(groups)]
    norm2 = max(blocks)
    m = patch_overlap(node, w.shape[2:])
    # each output position is K_g @ its own patch; a patch embedding's patches are disjoint
    return norm2 if m == 1 else mul_up(sqrt_up(m), norm2)

