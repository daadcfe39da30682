"""The local rule for Conv (docs/local-enclosure.md, "Conv"): a Conv with a constant kernel and
bias on an input-dependent tensor is linear, y = K * x + b, so

- centre: the op's float64 evaluation at X0 (drivers/centre.py's forward pass);
- Jacobian centre `jc' = K * jc` (the kernel applied to each of the P input-direction slices,
  no bias), radius `jr' = |K| * jr`, widened by gamma_k |K| * |jc| for the rounding of jc'
  (k = C/g * prod kernel: the products summed per output entry);
- value range: `|y(X) - y(X0)| <= |K| * rad_in`, widened, plus the centre's margin,
  intersected with the mean-value enclosure (`enclose`);
- no remainder term (linear).

The P directions are folded into the batch axis, so one float64 Conv call (ConvOp.run, every
stride, padding, dilation and group form) computes each of the three maps.
Registered into LOCAL_RULES on import (engine/__init__.py).
"""

from __future__ import annotations

import numpy as np
import torch

from lsa_models.engine.enclosure import primitives as pr
from lsa_models.engine.enclosure.rules import CTX, Arg, LocalRule, register_local
from lsa_models.engine.values import Ball, LocalNotCertified, LocalValue, center_margin, widen_up
from lsa_models.onnx.ops import OPS, Node

Out = list[LocalValue | np.ndarray | None]


def _conv_directions(node: Node, w: np.ndarray, t: np.ndarray, out_shape: tuple[int, ...]
                     ) -> np.ndarray:
    """The Conv's linear part (no bias) applied to every direction slice of t (*S_in, P):
    (*S_out, P)."""
    p = t.shape[-1]
    n = t.shape[0]
    x = np.moveaxis(t, -1, 0).reshape(p * n, *t.shape[1:-1])  # (P*N, C, *spatial)
    y = OPS["Conv"].run(node, [torch.from_numpy(np.ascontiguousarray(x)),
                               torch.from_numpy(np.ascontiguousarray(w))], CTX)[0]
    y_np = y.numpy().reshape(p, *out_shape)  # (P, N, O, *spatial_out)
    return np.moveaxis(y_np, 0, -1)  # (*S_out, P)


@register_local
class ConvRule(LocalRule):
    types = ("Conv",)

    def apply(self, node: Node, args: list[Arg], centers: list[np.ndarray | None],
              ball: Ball) -> Out:
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else None
        c = centers[0]
        if not isinstance(x, LocalValue) or not isinstance(w, np.ndarray) \
                or isinstance(bias, LocalValue) or c is None:
            raise LocalNotCertified(f"Conv node {node.name}: only an input-dependent image "
                                    "with a constant kernel and bias has a local rule")
        if x.center.ndim != w.ndim:
            raise LocalNotCertified(f"Conv node {node.name}: input rank {x.center.ndim} "
                                    f"does not match the kernel's {w.ndim}")
        w64 = w.astype(np.float64)
        aw = np.abs(w64)
        shape = tuple(c.shape)
        jc = _conv_directions(node, w64, x.jc, shape)
        jr_abs = _conv_directions(node, aw, x.jr, shape)
        jc_abs = _conv_directions(node, aw, np.abs(x.jc), shape)
        # terms per output entry: C/g input channels times the kernel's spatial size
        k = int(np.prod(w.shape[1:]))
        # interval form: |y(X) - y(X0)| <= |K| * rad_in (the bias cancels), plus the centre's
        # own margin (the float64 forward pass)
        spread = _conv_directions(node, aw, x.rad[..., None], shape)[..., 0]
        rad = widen_up(spread, k) + center_margin(c)
        return [pr.linear(c, jc, jr_abs, jc_abs, k, ball, c - rad, c + rad)]
