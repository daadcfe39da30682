"""The affine forms' attention masks and guards: Where with a constant condition, masked
logits (-inf, or the float minimum) carried beside a form, IsNaN / IsInf guards proved
False where the form is finite."""

from __future__ import annotations

import numpy as np

from lsa_models.engine import elementwise_chains as fused
from lsa_models.engine.affine.form import Aff, NotAffine, _cols, ranges
from lsa_models.engine.affine.norms import _add
from lsa_models.engine.derivative_ops import GUARDS
from lsa_models.engine.values import Ball, center_margin
from lsa_models.onnx.ops import Node

# a constant logit at or below this is an attention mask's: its softmax weight relative to any
# finite logit of the row is below exp(-1e30), nothing in float64 (HF's masks use the float
# minimum, torch's -inf)
MASKED_BELOW = -1e30


def _guard(node: Node, x: Aff, ball: Ball) -> Aff:
    """IsNaN(x) / IsInf(x) for a form whose ranges over the ball are finite: False
    everywhere, as a constant form (no change), which a Where reads as a constant
    condition; refused where a range is not finite."""
    lo, hi = ranges(x, ball)
    if x.masked is not None or not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
        raise NotAffine(f"{node.op_type} node {node.name}: the input may not be finite")
    return _const_form(np.zeros(x.shape), x)


def _is_constant(f: object) -> bool:
    """A form with no change and an exact centre (a guard's output)."""
    return isinstance(f, Aff) and not (np.any(f.m) or np.any(f.o) or np.any(f.a)
                                       or np.any(f.b))


def _masked_input(node: Node, args: list, var: list[int], c0: np.ndarray | None, ball: Ball
                  ) -> Aff | None:
    """Add/Sub of a form and a constant mask, or Where(constant condition, ...) with a
    constant mask branch: the output's form with the masked entries marked (their parts set
    to 0, never read as values); None where no entry of the output is masked."""
    t = node.op_type
    if c0 is None or np.all(np.isfinite(c0) & (c0 > MASKED_BELOW)):
        return None
    c0 = np.asarray(c0, dtype=np.float64)
    shape = c0.shape
    if t in ("Add", "Sub") and len(var) == 1 and len(args) == 2:
        k = 1 - var[0]
        if t == "Sub" and k == 0:
            raise NotAffine(f"Sub node {node.name}: a form subtracted from a mask")
        const = np.broadcast_to(np.asarray(args[k], dtype=np.float64), shape)
        const = -const if t == "Sub" else const
        mask = const <= MASKED_BELOW
        x = args[var[0]]
        base = _add(_broadcast(x, shape), _const_form(np.where(mask, 0.0, const), x), ball)
    elif t == "Where" and len(args) == 3 and 0 not in var:
        base, mask = _where_branches(args, shape)
    else:
        return None
    if not np.all(mask | (np.isfinite(c0) & (c0 > MASKED_BELOW))):
        raise NotAffine(f"{t} node {node.name}: a centre value is not finite")
    keep = np.where(mask, 0.0, 1.0)
    c = np.where(mask, 0.0, c0)
    return Aff(c, center_margin(c) * keep, base.o * keep, base.a * keep[..., None],
               base.b * keep, masked=mask)


def _broadcast(x: Aff, shape: tuple[int, ...]) -> Aff:
    if x.shape == shape:
        return x
    return Aff(np.broadcast_to(x.c, shape), np.broadcast_to(x.m, shape),
               np.broadcast_to(x.o, shape), np.broadcast_to(x.a, (*shape, x.a.shape[-1])),
               np.broadcast_to(x.b, shape))


def _const_form(v: np.ndarray, like: Aff) -> Aff:
    """A constant as a form: no change, exact."""
    z = np.zeros(v.shape)
    return Aff(np.asarray(v, dtype=np.float64), z, z, np.zeros((*v.shape, like.a.shape[-1])), z)


def _select(cond: np.ndarray, x: Aff, y: Aff) -> Aff:
    """Where(cond, x, y) for a constant cond: each entry's form from its branch."""
    n = max(x.a.shape[-1], y.a.shape[-1])
    return Aff(np.where(cond, x.c, y.c), np.where(cond, x.m, y.m), np.where(cond, x.o, y.o),
               np.where(cond[..., None], _cols(x.a, n), _cols(y.a, n)),
               np.where(cond, x.b, y.b))


def _where_branches(args: list, shape: tuple[int, ...]) -> tuple[Aff, np.ndarray]:
    """Where(cond, x, y) for a constant cond, each entry's form from its branch (a constant
    branch: no change, exact, its entries at or below MASKED_BELOW set to 0), and the entries
    a constant branch masks."""
    cond = np.broadcast_to(np.asarray(args[0]).astype(bool), shape)
    ref = next(a for a in args[1:] if isinstance(a, Aff))
    mask = np.zeros(shape, dtype=bool)
    forms = []
    for i, br in enumerate(args[1:]):
        if isinstance(br, Aff):
            forms.append(_broadcast(br, shape))
            continue
        v = np.broadcast_to(np.asarray(br, dtype=np.float64), shape)
        low = v <= MASKED_BELOW
        mask |= (cond if i == 0 else ~cond) & low
        forms.append(_const_form(np.where(low, 0.0, v), ref))
    return _select(cond, forms[0], forms[1]), mask


def _where(args: list, c0: np.ndarray) -> Aff:
    """Where(cond, x, y) for a constant condition where no entry is masked: each entry's
    form from its branch, the centre the graph's."""
    f, _ = _where_branches(args, c0.shape)
    return Aff(c0, np.maximum(f.m, center_margin(c0)), f.o, f.a, f.b)


def _unmask(x: Aff, axis: int, ball: Ball) -> Aff:
    """A Softmax's masked input with finite stand-ins: each masked entry a constant (no
    change) 1000 below its row's lowest reachable unmasked logit, so its weight relative to
    the row's largest is below exp(-1000) (1e-434, under the TINY = 1e-300 the caller adds to
    every output entry): the probabilities the rules enclose are the masked softmax's. A row
    masked entirely is refused."""
    mask = x.masked
    assert mask is not None
    lo, _ = ranges(x, ball)
    row = np.where(mask, np.inf, lo).min(axis=axis, keepdims=True)
    if not np.all(np.isfinite(row)):
        raise NotAffine("a softmax row masked entirely")
    keep = np.where(mask, 0.0, 1.0)
    stand = np.broadcast_to(row - 1000.0, x.c.shape)
    return Aff(np.where(mask, stand, x.c), x.m * keep, x.o * keep, x.a * keep[..., None],
               x.b * keep)


def _masks(node: Node, args: list, var: list[int], centers: list[np.ndarray | None],
           ball: Ball, chain: fused.Chain | None) -> list | None:
    """The attention masks' rules (a mask put in by Add/Sub/Where, a Where of a constant
    condition), None for any other node; a masked form read by anything but a Softmax is
    refused."""
    t = node.op_type
    if any(args[i].masked is not None for i in var) and t != "Softmax":
        raise NotAffine(f"{t} node {node.name}: reads an attention mask's -inf entries")
    if t in GUARDS and var == [0]:
        return [_guard(node, args[0], ball)]
    if t == "Where" and 0 in var and _is_constant(args[0]):
        # a guard's condition (IsNaN of a finite form): constant over the ball
        args = [args[0].c.astype(bool)] + list(args[1:])
        var = [i for i in var if i != 0]
    if t in ("Add", "Sub", "Where") and chain is None and centers and var:
        m_in = _masked_input(node, args, var, centers[0], ball)
        if m_in is not None:
            return [m_in]
    if t == "Where" and var and 0 not in var and centers and centers[0] is not None:
        return [_where(args, np.asarray(centers[0], dtype=np.float64))]
    return None
