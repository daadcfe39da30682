"""Sums of squares over the last axis, s = sum_k x_k^2, as one rule: the L2 attention's
pairwise squared distances ||q_i - k_j||^2, exported as Sub, then Mul(d, d) or Pow(d, 2),
then ReduceSum over the head axis. Derivation in docs/local-affine.md, "Squared distances".

Node by node, the square is a product per entry (N N H d entries), each with a fresh symbol
for its quadratic error: on a 16-token, 4-head ViT with head size 8 that is 8 192 symbols per
layer, which soon passes the forms' size limit (affine.form.MAX_FORM_ENTRIES), so the errors
go to the box, lose their signs, and the box's |W| growth runs the second block away. Read
as one rule the quadratic part is one term per distance, ||D||^2 in [0, rho^2] (rho a bound
on the difference's change, `token_radius`), nonnegative like the square it bounds, with one
symbol per distance (N N H) instead of one per entry.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lsa_models.bounds.numerics import U
from lsa_models.engine.affine.form import _REL, TINY, Aff, NotAffine, _up, fresh, token_radius
from lsa_models.engine.affine.linear import weighted_sum
from lsa_models.engine.values import Ball, center_margin
from lsa_models.onnx.ops import Node


def square_sums(nodes: Sequence[Node], env: dict[str, torch.Tensor], keep: str = ""
                ) -> dict[str, Node]:
    """The squares Mul(d, d) / Pow(d, 2) whose output only one node reads, a ReduceSum over
    the last axis alone: the square's node name -> that ReduceSum."""
    readers: dict[str, list[Node]] = {}
    for node in nodes:
        for i in set(node.inputs):
            if i:
                readers.setdefault(i, []).append(node)
    out: dict[str, Node] = {}
    for node in nodes:
        if not _is_square(node, env) or node.outputs[0] == keep:
            continue
        r = readers.get(node.outputs[0], [])
        if len(r) == 1 and _sums_last_axis(r[0], env):
            out[node.name] = r[0]
    return out


def _const(name: str, env: dict[str, torch.Tensor]) -> np.ndarray | None:
    v = env.get(name)
    return None if v is None else v.detach().numpy()


def _is_square(node: Node, env: dict[str, torch.Tensor]) -> bool:
    if len(node.outputs) != 1 or not node.inputs or not node.inputs[0]:
        return False
    if node.op_type == "Mul":
        return len(node.inputs) == 2 and node.inputs[0] == node.inputs[1]
    if node.op_type == "Pow" and len(node.inputs) == 2:
        e = _const(node.inputs[1], env)
        return e is not None and e.size == 1 and float(e.reshape(())) == 2.0
    return False


def _sums_last_axis(node: Node, env: dict[str, torch.Tensor]) -> bool:
    """A ReduceSum over the last axis of its input only (the axes as its second input, or
    as the attribute of the older opsets)."""
    if node.op_type != "ReduceSum" or not node.inputs or len(node.outputs) != 1:
        return False
    x = env.get(node.inputs[0])
    if x is None:
        return False
    if len(node.inputs) > 1 and node.inputs[1]:
        ax = _const(node.inputs[1], env)
        axes = [] if ax is None else [int(v) for v in ax.reshape(-1)]
    else:
        axes = [int(v) for v in node.attrs.get("axes", [])]
    return len(axes) == 1 and axes[0] % x.dim() == x.dim() - 1


def square_sum(x: Aff, keepdims: bool, out_c: np.ndarray, ball: Ball) -> Aff:
    """s = sum_k x_k^2 over the last axis (kept as a size-1 axis where `keepdims`) by its
    expansion around the true centre x0 (|x0 - c| <= m): with D = x(X) - x0 and
    rho >= ||D||_2 (`token_radius`),
        s(X) - s(X0) = 2 c . D + 2 (x0 - c) . D + ||D||^2,
    the first exact on the form (`weighted_sum`: 2 c is exact in binary), the second within
    2 ||m|| rho, the last in [0, rho^2]: offset rho^2 / 2 and one new symbol per sum of
    half width rho^2 / 2 + 2 ||m|| rho. The centre `out_c` (the forward pass's) and its
    margin are the graph's."""
    rho = token_radius(x, ball)  # (..., 1)
    s = weighted_sum(x, 2.0 * x.c, ball)  # its change is 2 c . D
    quad = _up(rho * rho, 2)
    mn = np.sqrt(_up(np.square(x.m).sum(axis=-1, keepdims=True), x.shape[-1] + 2)) * (1 + 4 * U)
    half = _up(0.5 * quad + 2.0 * mn * rho + _REL * (np.abs(s.o) + quad), 4) + TINY
    a, b = fresh(s.a, s.b, half)
    o = s.o + 0.5 * quad
    shape = out_c.shape
    if not keepdims:
        o, a, b = o[..., 0], a[..., 0, :], b[..., 0]
    return Aff(out_c, center_margin(out_c), o.reshape(shape), a.reshape(*shape, a.shape[-1]),
               b.reshape(shape))


def square_sum_step(reduce: Node, x: Aff, env: dict[str, torch.Tensor], ball: Ball) -> Aff:
    """`square_sum` for the ReduceSum node `reduce` that reads the square of x's tensor."""
    out_c = np.asarray(env[reduce.outputs[0]].detach().numpy(), dtype=np.float64)
    if not np.all(np.isfinite(out_c)):
        raise NotAffine(f"ReduceSum node {reduce.name}: a centre value is not finite")
    with np.errstate(over="ignore", invalid="ignore"):
        y = square_sum(x, bool(int(reduce.attrs.get("keepdims", 1))), out_c, ball)
    if not all(np.all(np.isfinite(v)) for v in (y.o, y.a, y.b)):
        raise NotAffine(f"ReduceSum node {reduce.name}: a form overflowed")
    return y
