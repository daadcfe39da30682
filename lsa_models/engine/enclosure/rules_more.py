"""More local rules (docs/local-enclosure.md, "More ops"):

- masked softmax: logits holding mask entries (-inf, or finite fills such as float32's
  smallest value) whose probability is at most e^-1000 everywhere on the ball are dropped
  from the softmax's ranges; the rest is the Softmax rule of enclosure/primitives.py;
- -inf masks through Add/Sub (and Mul/Div by positive constants): the masked entries are
  carried as the finite stand-in `NEG_MASK` with a zero Jacobian (every other op refuses a
  non-finite value, as before);
- Where with a condition constant on the ball: a selection (the Layout rule); comparisons
  (Greater, Less, ..., Equal), IsNaN and IsInf of input-dependent tensors are constant on the
  ball when their operands' ranges decide them, and refused otherwise;
- ReduceMax: exact selection where one entry dominates its group on the whole ball, else the
  Clarke hull of the candidates' Jacobians;
- Gelu: approximate="tanh" (opset 20's fused op) as the chain it stands for,
  0.5 x (1 + tanh(c (x + 0.044715 x^3))), every link a primitive; the exact form by
  rules.ElementwiseRule (which leaves Gelu to this rule).

The other classes register over (and where they must, delegate to) the rule enclosure/rules.py
registered for their op type, so this module is imported once, after enclosure/rules.py.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np

from lsa_models.engine.enclosure import primitives as pr
from lsa_models.engine.enclosure.rules import (
    LOCAL_RULES,
    Arg,
    ElementwiseRule,
    LocalRule,
    register_local,
)
from lsa_models.engine.remainders.signed_adjoints import SignedTerm, layernorm_rules
from lsa_models.engine.remainders.structured_norms import alternatives
from lsa_models.engine.values import (
    FORWARD_FLOOR,
    FORWARD_MARGIN,
    Ball,
    LocalNotCertified,
    LocalValue,
    OpRemainder,
    Parts,
    center_margin,
    dual_row_norms,
    enclose,
    widen_up,
)
from lsa_models.onnx.ops import Node, decimal_attr
from lsa_models.operators import activation
from lsa_models.operators.activation import Gelu

Out = list[LocalValue | np.ndarray | None]

# Centres at or below this are mask candidates (torch/HF fill masks with -inf or the dtype's
# smallest value, -3.4e38 for float32); they are left out of the forward margin's scale.
MASK_LEVEL = -1e20
# A logit whose upper end is this far below its row's largest lower end has probability at
# most e^-1000 on the whole ball (docs: "Masked softmax").
MASK_GAP = 1000.0
# The finite stand-in for a -inf mask entry (a constant: zero Jacobian).
NEG_MASK = -1e30
# Bounds n^2 e^-1000 (n < 1e100): the change of the softmax's Jacobian and values by the
# dropped entries, relative to the input's Jacobian scale.
TINY = 1e-300


def _base(op_type: str) -> LocalRule:
    rule = LOCAL_RULES.get(op_type)
    if rule is None:
        raise RuntimeError(f"rules_more must be imported after enclosure/rules.py ({op_type})")
    return rule


# ---- masked softmax -------------------------------------------------------------------------


def _masked_ranges(x: LocalValue, ball: Ball) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(candidate mask, lo, hi): every entry's range from its Jacobian enclosure (mean value
    form), with the forward margin's floor scaled by the non-candidate entries only (a mask
    fill does not enter the computation of the other entries), intersected with x's own."""
    c = x.center
    cand = c <= MASK_LEVEL
    rest = np.abs(c[~cand])
    scale = float(rest.max()) if rest.size else float(np.abs(c).max())
    rows = dual_row_norms(np.abs(x.jc) + x.jr, ball.norm)  # (*S,)
    rad = widen_up(ball.eps * rows + FORWARD_MARGIN * np.abs(c) + FORWARD_FLOOR * scale, 4)
    return cand, np.maximum(x.lo, c - rad), np.minimum(x.hi, c + rad)


def masked_softmax(x: LocalValue, axis: int, out_center: np.ndarray, ball: Ball) -> LocalValue:
    """Softmax along `axis` of logits that may hold mask entries: an entry whose upper end
    lies MASK_GAP below its row's largest lower end is replaced by a constant that far below
    (probability <= e^-1000 before and after), the enclosure/primitives.py rule runs on the rest,
    and TINY terms cover the difference (docs/local-enclosure.md)."""
    ax = axis % len(x.shape)
    cand, lo, hi = _masked_ranges(x, ball)
    lo_m, hi_m, cand_m = (np.moveaxis(a, ax, -1) for a in (lo, hi, cand))  # (..., n)
    best = np.where(cand_m, -np.inf, lo_m).max(axis=-1, keepdims=True)  # (..., 1)
    if not np.all(np.isfinite(best)):
        raise LocalNotCertified("Softmax of a row whose every logit is masked")
    masked_m = cand_m & (hi_m < best - MASK_GAP)
    if np.any(cand_m & ~masked_m):
        raise LocalNotCertified("Softmax: a mask-valued logit the ball can bring within "
                                f"{MASK_GAP:g} of its row's largest")
    if not (np.all(np.isfinite(lo_m[~masked_m])) and np.all(np.isfinite(hi_m[~masked_m]))):
        raise LocalNotCertified("Softmax of logits with unbounded ranges")
    fill = np.broadcast_to(best - 2 * MASK_GAP, lo_m.shape)
    masked = np.moveaxis(masked_m, -1, ax)  # (*S,)
    fill = np.moveaxis(fill, -1, ax)
    keep = ~masked[..., None]
    mod = LocalValue(np.where(masked, fill, x.center), np.where(masked, fill, lo),
                     np.where(masked, fill, hi), np.where(keep, x.jc, 0.0),
                     np.where(keep, x.jr, 0.0))
    out = pr.softmax(mod, ax, out_center, ball)
    # the dropped entries change S = diag(p) - p p^T by <= 4 n^2 e^-1000 entrywise and p by
    # <= n e^-1000: TINY times the input Jacobian's largest row sum covers both
    scale = 1.0 + float((np.abs(x.jc) + x.jr).sum(axis=-1).max())
    slack = TINY * scale
    res = LocalValue(out.center, np.maximum(out.lo - TINY, 0.0), np.minimum(out.hi + TINY, 1.0),
                     out.jc, out.jr + slack)
    base_term = out.term
    assert base_term is not None
    up = 1.0 + float((np.abs(x.jc) + x.jr).max())

    def term(g: np.ndarray) -> np.ndarray:
        k = g.shape[0]
        extra = TINY * up * np.abs(g).reshape(k, -1).sum(axis=1, keepdims=True)  # (K, 1)
        return base_term(g) + extra * np.ones((1, ball.size))
    res.remainder = OpRemainder(term)
    return res


@register_local
class MaskedSoftmaxRule(LocalRule):
    """Softmax, with mask entries allowed (the plain rule when there are none)."""

    types: ClassVar[tuple[str, ...]] = ("Softmax",)

    def __init__(self) -> None:
        self.base = _base("Softmax")

    def apply(self, node: Node, args: list[Arg], centers: list[np.ndarray | None],
              ball: Ball) -> Out:
        x, c = args[0], centers[0]
        if not isinstance(x, LocalValue) or c is None or not np.all(np.isfinite(c)):
            raise LocalNotCertified(f"Softmax node {node.name}: a row the mask empties "
                                    "(non-finite probabilities)")
        if not np.any(x.center <= MASK_LEVEL):
            return self.base.apply(node, args, centers, ball)
        return [masked_softmax(x, int(node.attrs.get("axis", -1)), c, ball)]


# ---- -inf masks through the linear ops --------------------------------------------------


def _neg_inf_ok(node: Node, args: list[Arg]) -> bool:
    """The op passes -inf masks on: Add/Sub of constants (-inf allowed where the output is
    -inf), Mul/Div by finite positive constants."""
    t = node.op_type
    for i, a in enumerate(args):
        if not isinstance(a, np.ndarray) or not np.issubdtype(a.dtype, np.floating):
            continue
        if t in ("Mul", "Div") and not (np.all(np.isfinite(a)) and np.all(a > 0)):
            return False
        if t == "Add" and np.any(np.isnan(a) | (a == np.inf)):
            return False
        if t == "Sub" and np.any(np.isnan(a) | (a == (np.inf if i == 0 else -np.inf))):
            return False
    return t in ("Add", "Sub", "Mul", "Div") and not (
        t in ("Mul", "Div") and sum(isinstance(a, LocalValue) for a in args) > 1)


def _masked_value(v: LocalValue, masked: np.ndarray) -> LocalValue:
    """v with the entries `masked` set to the constant NEG_MASK (zero Jacobian)."""
    keep = ~masked[..., None]
    out = LocalValue(np.where(masked, NEG_MASK, v.center), np.where(masked, NEG_MASK, v.lo),
                     np.where(masked, NEG_MASK, v.hi), np.where(keep, v.jc, 0.0),
                     np.where(keep, v.jr, 0.0))
    if v.remainder is not None:  # the term alone: the other forms are v's op's on v's entries
        out.remainder = OpRemainder(v.remainder.term)
    return out


@register_local
class MaskedLinearRule(LocalRule):
    """Add/Sub/Mul/Div as enclosure/rules.py bounds them; where the output holds -inf entries (a
    mask added to logits), those are carried as NEG_MASK constants."""

    types: ClassVar[tuple[str, ...]] = ("Add", "Sub", "Mul", "Div")

    def __init__(self) -> None:
        self.base = {t: _base(t) for t in self.types}

    def apply(self, node: Node, args: list[Arg], centers: list[np.ndarray | None],
              ball: Ball) -> Out:
        base = self.base[node.op_type]
        c = centers[0]
        if c is None or np.all(np.isfinite(c)):
            return base.apply(node, args, centers, ball)
        masked = c == -np.inf
        if np.any(~np.isfinite(c) & ~masked) or not _neg_inf_ok(node, args):
            raise LocalNotCertified(f"{node.op_type} node {node.name}: a non-finite value that "
                                    "is not a -inf mask")
        fixed: list[Arg] = [np.where(np.isfinite(a), a, 0.0) if isinstance(a, np.ndarray)
                            and np.issubdtype(a.dtype, np.floating) else a for a in args]
        out = base.apply(node, fixed, [np.where(masked, NEG_MASK, c)], ball)[0]
        assert isinstance(out, LocalValue)
        return [_masked_value(out, masked)]


# ---- Where, comparisons ---------------------------------------------------------------------


@register_local
class WhereRule(LocalRule):
    """Where(cond, x, y) with cond constant on the ball: each output entry copies one input
    entry (the Layout rule, exact); -inf fills become NEG_MASK constants."""

    types: ClassVar[tuple[str, ...]] = ("Where",)

    def apply(self, node: Node, args: list[Arg], centers: list[np.ndarray | None],
              ball: Ball) -> Out:
        if isinstance(args[0], LocalValue):
            raise LocalNotCertified(f"Where node {node.name}: a condition computed from the "
                                    "input by an op that is not a comparison")
        c = centers[0]
        if c is None:
            raise LocalNotCertified(f"Where node {node.name}: no centre value")
        masked = c == -np.inf
        if np.any(~np.isfinite(c) & ~masked):
            raise LocalNotCertified(f"Where node {node.name}: selects +inf or NaN")
        fixed: list[Arg] = [np.where(np.isfinite(a), a, 0.0) if isinstance(a, np.ndarray)
                            and np.issubdtype(a.dtype, np.floating) else a for a in args]
        out = _base("Reshape").apply(node, fixed, [np.where(masked, NEG_MASK, c)], ball)[0]
        assert isinstance(out, LocalValue)
        return [_masked_value(out, masked) if masked.any() else out]


def _range(a: Arg) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(a, LocalValue):
        return a.lo, a.hi
    assert a is not None
    v = np.asarray(a, dtype=np.float64)
    return v, v


def _decided(node: Node, value: np.ndarray, known: np.ndarray,
             center: np.ndarray | None) -> np.ndarray:
    """The comparison's value where every point of the ball agrees; refused elsewhere."""
    if not np.all(known):
        raise LocalNotCertified(f"{node.op_type} node {node.name}: the ball crosses the "
                                "comparison's boundary (the model is discontinuous there)")
    value = np.asarray(value, dtype=bool)
    if center is not None and not np.array_equal(np.broadcast_to(center, value.shape), value):
        raise LocalNotCertified(f"{node.op_type} node {node.name}: the forward pass disagrees "
                                "with the ranges")
    return value.reshape(center.shape) if center is not None else value


@register_local
class CompareRule(LocalRule):
    """Greater/Less(OrEqual)/Equal of input-dependent tensors: constant on the ball when the
    operands' ranges decide every entry (a strict gap between the ranges)."""

    types: ClassVar[tuple[str, ...]] = ("Greater", "Less", "GreaterOrEqual", "LessOrEqual",
                                        "Equal")

    def apply(self, node: Node, args: list[Arg], centers: list[np.ndarray | None],
              ball: Ball) -> Out:
        (alo, ahi), (blo, bhi) = _range(args[0]), _range(args[1])
        t = node.op_type
        if t in ("Less", "LessOrEqual"):  # a < b is b > a
            (alo, ahi), (blo, bhi) = (blo, bhi), (alo, ahi)
            t = t.replace("Less", "Greater")
        if t == "Equal":
            # only a gap between the ranges decides: equality on a ball is never certain
            value, known = np.zeros(np.broadcast(alo, blo).shape, dtype=bool), \
                (alo > bhi) | (ahi < blo)
        else:
            # a > b everywhere when lo_a > hi_b; nowhere when hi_a < lo_b (or <= for strict >)
            true = alo > bhi if t == "Greater" else alo >= bhi
            false = ahi <= blo if t == "Greater" else ahi < blo
            value, known = true, true | false
        return [_decided(node, value, known, centers[0])]


@register_local
class IsNaNRule(LocalRule):
    """IsNaN / IsInf of an input-dependent tensor: its entries are finite on the ball (the
    enclosure is finite), except NEG_MASK entries, which stand for -inf."""

    types: ClassVar[tuple[str, ...]] = ("IsNaN", "IsInf")

    def apply(self, node: Node, args: list[Arg], centers: list[np.ndarray | None],
              ball: Ball) -> Out:
        x = args[0]
        assert isinstance(x, LocalValue)
        finite = np.isfinite(x.lo) & np.isfinite(x.hi)
        neg = x.center == NEG_MASK
        if node.op_type == "IsNaN":
            return [_decided(node, np.zeros(x.shape, dtype=bool), finite | neg, centers[0])]
        if not int(node.attrs.get("detect_negative", 1)):
            return [_decided(node, np.zeros(x.shape, dtype=bool), finite | neg, centers[0])]
        return [_decided(node, neg, finite | neg, centers[0])]


# ---- ReduceMax ------------------------------------------------------------------------------


def _reduce_axes(node: Node, args: list[Arg], ndim: int) -> tuple[int, ...]:
    axes: list[int] = []
    if len(args) > 1 and isinstance(args[1], np.ndarray):
        axes = [int(a) for a in np.asarray(args[1]).reshape(-1)]
    elif "axes" in node.attrs:
        axes = [int(a) for a in node.attrs["axes"]]
    if not axes:
        if node.attrs.get("noop_with_empty_axes", 0):
            return ()
        axes = list(range(ndim))
    return tuple(sorted(a % ndim for a in axes))


def reduce_max(x: LocalValue, axes: tuple[int, ...], out_center: np.ndarray,
               ball: Ball) -> LocalValue:
    """y = max over `axes`. Candidates of a group: entries whose upper end reaches the group's
    largest lower end. On the ball y's Clarke Jacobian lies in the hull of the candidates'
    Jacobians, so with k0 the centre's argmax: jc = jc_k0, jr = max_k (|jc_k - jc_k0| + jr_k);
    exact (jr = jr_k0) where k0 is the only candidate."""
    keep = [a for a in range(len(x.shape)) if a not in axes]
    perm = keep + list(axes)
    s_keep = tuple(x.shape[a] for a in keep)
    m = int(np.prod([x.shape[a] for a in axes])) if axes else 1
    p = ball.size

    def group(a: np.ndarray, tail: tuple[int, ...] = ()) -> np.ndarray:
        return np.transpose(a, perm + [len(x.shape) + i for i in range(len(tail))]) \
            .reshape(*s_keep, m, *tail)
    c, lo, hi = group(x.center), group(x.lo), group(x.hi)  # (*K, m)
    jc, jr = group(x.jc, (p,)), group(x.jr, (p,))  # (*K, m, P)
    best_lo = lo.max(axis=-1, keepdims=True)
    cand = hi >= best_lo  # (*K, m): the argmax can only be one of these on the ball
    k0 = np.argmax(c, axis=-1)[..., None]  # (*K, 1)
    jc0 = np.take_along_axis(jc, k0[..., None], axis=-2)  # (*K, 1, P)
    jr0 = np.take_along_axis(jr, k0[..., None], axis=-2)
    dev = np.where(cand[..., None], widen_up(np.abs(jc - jc0), 2) + jr, 0.0)
    jr_y = np.maximum(dev.max(axis=-2), jr0[..., 0, :])  # (*K, P)
    single = cand.sum(axis=-1) == 1  # (*K,)
    shape = out_center.shape
    out = enclose(out_center, jc0[..., 0, :].reshape(*shape, p), jr_y.reshape(*shape, p), ball,
                  best_lo.reshape(shape), hi.max(axis=-1).reshape(shape))
    if np.all(single):
        return out  # a selection on the whole ball: D_op is constant, no remainder term
    # D(X) - D(X0) = e_k - e_k0 for candidates k (the true argmax at X0 is a candidate too):
    # |(e_k - e_k0) J_in(X)| <= 2 max_cand (|jc| + jr), in the groups with several candidates
    spread = 2.0 * np.where(cand[..., None], np.abs(jc) + jr, 0.0).max(axis=-2)  # (*K, P)
    spread = np.where(single[..., None], 0.0, spread).reshape(-1, p)

    def term(g: np.ndarray) -> np.ndarray:
        k = g.shape[0]
        return np.abs(g).reshape(k, -1) @ spread
    out.remainder = OpRemainder(term)
    return out


@register_local
class ReduceMaxRule(LocalRule):
    types: ClassVar[tuple[str, ...]] = ("ReduceMax",)

    def apply(self, node: Node, args: list[Arg], centers: list[np.ndarray | None],
              ball: Ball) -> Out:
        x, c = args[0], centers[0]
        if not isinstance(x, LocalValue) or c is None:
            raise LocalNotCertified(f"ReduceMax node {node.name}: input-dependent axes")
        axes = _reduce_axes(node, args, len(x.shape))
        if not axes:
            return [x]
        return [reduce_max(x, axes, np.asarray(c, dtype=np.float64), ball)]


# ---- fused tanh-Gelu ------------------------------------------------------------------------

_C = math.sqrt(2.0 / math.pi)
_A = 0.044715


def gelu_tanh(x: LocalValue, out_center: np.ndarray, ball: Ball) -> LocalValue:
    """y = h s with h = x / 2, s = 1 + tanh(u), u = c (x + a x^3): the chain of the unfused
    export, each link a primitive (pow, linear, tanh, linear, product); the remainder term
    sums the links' terms with adjoint bounds carried through the links' |centre
    derivatives| (docs/local-enclosure.md)."""
    xc = x.center
    ajc = np.abs(x.jc)
    x3 = pr.elementwise(x, "pow", xc ** 3, ball, exponent=3.0)
    uc = _C * (xc + _A * xc ** 3)
    u = pr.linear(uc, _C * x.jc + _C * _A * x3.jc, _C * x.jr + _C * _A * x3.jr,
                  _C * ajc + _C * _A * np.abs(x3.jc), 4, ball)
    t = pr.elementwise(u, "tanh", np.tanh(uc), ball)
    s = pr.linear(1.0 + t.center, t.jc, t.jr, np.abs(t.jc), 2, ball,
                  lo=np.zeros(xc.shape), hi=np.full(xc.shape, 2.0))
    h = pr.linear(0.5 * xc, 0.5 * x.jc, 0.5 * x.jr, 0.5 * ajc, 1, ball)
    y = pr.product(h, s, out_center, ball, matmul=False)
    y_t, t_t, x3_t = y.term, t.term, x3.term
    assert y_t is not None and t_t is not None and x3_t is not None
    # bounds on |d y / d (link output)| at X0 from a bound G >= |d out / d y|: through s the
    # factor |h(X0)|, through tanh its slope (<= 1), into x^3 the constant c a
    hmax = widen_up(np.abs(h.center) + center_margin(h.center), 2)
    # tanh' is even and decreasing in |u|: its largest value over the centre's margin
    near = np.maximum(np.abs(uc) - center_margin(uc), 0.0)
    tslope = np.minimum(1.0, widen_up(1.0 - np.tanh(near) ** 2, 4) + pr.LIBM_REL)

    def adjoints(g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ag = np.abs(g)
        gt = ag * hmax
        return ag, gt, widen_up(gt * tslope * (_C * _A), 2)

    def term(g: np.ndarray) -> np.ndarray:
        ag, gt, gx3 = adjoints(g)
        return y_t(ag) + t_t(gt) + x3_t(gx3)

    links = (y.parts, t.parts, x3.parts)

    def parts(g: np.ndarray) -> list[Parts]:
        # the links' factored terms for the same adjoint bounds, each by its first
        # decomposition (every one of a PartsChoice is valid)
        return [pt for f, a in zip(links, adjoints(g), strict=True) if f is not None
                for pt in alternatives(f(a))[0]]
    # the chain's own forms: the product's opnorm and second-order rules bound its share only
    y.remainder = OpRemainder(term, parts if all(f is not None for f in links) else None)
    return y


@register_local
class GeluRule(LocalRule):
    """Gelu: approximate="tanh" by its chain; the exact form by the elementwise rule."""

    types: ClassVar[tuple[str, ...]] = ("Gelu",)

    def __init__(self) -> None:
        self.base = ElementwiseRule()

    def apply(self, node: Node, args: list[Arg], centers: list[np.ndarray | None],
              ball: Ball) -> Out:
        op = activation(node.op_type, node.attrs)
        if not isinstance(op, Gelu) or op.approximate != "tanh":
            return self.base.apply(node, args, centers, ball)
        x, c = args[0], centers[0]
        if not isinstance(x, LocalValue) or c is None:
            raise LocalNotCertified(f"Gelu node {node.name}: no input range")
        return [gelu_tanh(x, np.asarray(c, dtype=np.float64), ball)]


@register_local
class SignedLayerNormRule(LocalRule):
    """LayerNormalization by the rule of enclosure/rules.py, its telescoped term also in the signed
    form (remainders/signed_adjoints.py, docs/local-second-order.md "Signed adjoints")."""

    types: ClassVar[tuple[str, ...]] = ("LayerNormalization",)

    def __init__(self) -> None:
        self.base = _base("LayerNormalization")

    def apply(self, node: Node, args: list[Arg], centers: list[np.ndarray | None],
              ball: Ball) -> Out:
        outs = self.base.apply(node, args, centers, ball)
        y, x, g = outs[0], args[0], args[1]
        rem = y.remainder if isinstance(y, LocalValue) else None
        parts = None if rem is None else rem.parts
        if isinstance(y, LocalValue) and isinstance(x, LocalValue) and \
                isinstance(g, np.ndarray) and rem is not None and parts is not None:
            d = x.shape[-1]
            gam = np.broadcast_to(np.asarray(g, dtype=np.float64), (d,))
            eps = decimal_attr(float(node.attrs.get("epsilon", 1e-5)))
            fn, sec = layernorm_rules(x, gam, eps, center_margin(x.center), ball)
            # the same op's term, signed: its opnorm rule stays; remainders/second_order.py's rule
            # on the inf-ball
            y.remainder = OpRemainder(SignedTerm(rem.term, parts, fn), parts, rem.opnorm,
                                      sec if ball.norm == "inf" else None)
        return outs
