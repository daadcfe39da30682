"""Relational value ranges over the ball: every input-dependent tensor as an affine form in the
input's change and in noise symbols, plus a box (docs/local-affine.md, "Affine value forms").

The Jacobian enclosure bounds a tensor's values by the mean value form, eps |jc + jr|_1: its
width grows with the Jacobian ranges, which grow with the value ranges (slopes over wider
intervals), and past eps ~ 3e-2 on a Transformer that loop runs away. These forms bound values
without Jacobian ranges (DeepZ / DeepT-style zonotopes): for every X in the ball, with
d = X - X0 and T0 = T(X0),

    T(X) - T0  in  o + a[:, :P] d + a[:, P:] e + [-b, b]     (entrywise, e in [-1, 1]^Q)

the symbols e created by the nonlinear ops (one per entry with a nonzero error) and shared by
everything computed from them. The computed centre c is within m of T0 (graph tensors: the
forward margin; a chain's intermediates: propagated). This module holds the form, its ranges,
the symbol budget, the margins' lower bounds and the per-token radii; affine/quadform.py the
second-order symbols' quadratic forms; affine/walk.py the rules, one node at a time, and the
standalone walk.

jacobian_walk.walk runs the rules in lockstep with the Jacobian enclosure (each op's inputs narrowed
to the enclosure's ranges, the enclosure's outputs intersected with the forms'); alone they
bound the classification margins on a ball, the certified radius's second route (routes/certify.py).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np

from lsa_models.bounds.numerics import U
from lsa_models.engine.affine.quadform import (  # noqa: F401  (the forms' public names: callers read affine.X)
    _REL,
    JOINT_MAX_P,
    JOINT_STEPS,
    QUAD_EIG_BATCH,
    TINY,
    _box_minimiser,
    _dual_value,
    _eig_allowance,
    _quad_fro,
    _quad_matrix,
    _quad_upper,
    _sphere_minimiser,
    _support_groups,
    _up,
    extreme_eigs,
    quad_cols,
    quad_low,
    quad_size,
    quad_two,
    quad_two_eig,
    triu_pack_sym,
)
from lsa_models.engine.values import Ball, box_to_two, dual_row_norms


class NotAffine(Exception):
    """An op this pass has no affine rule for: its outputs get the interval form."""


@dataclass
class Aff:
    c: np.ndarray  # (*S,) the computed centre
    m: np.ndarray  # (*S,) >= |T0 - c|
    o: np.ndarray  # (*S,) offset of the change
    a: np.ndarray  # (*S, P) linear part of the change
    b: np.ndarray  # (*S,) >= 0, the box
    # the true values are probabilities along the last axis (a softmax's output): every
    # row's change sums to 0, which products with it use
    stochastic: bool = False
    # entries an attention mask sets to -inf (or below MASKED_BELOW) everywhere on the ball:
    # their c, m, o, a, b are 0 and never read as values, only a Softmax reads the mask (as
    # probability 0); every other rule refuses a masked form (affine_masks._masks)
    masked: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.c.shape)


# Noise symbols: the columns of `a` past the input's P entries are error terms
# e_q in [-1, 1] created by the nonlinear ops (one per entry whose remainder is nonzero), shared
# by everything computed from them, so their signs survive later linear maps (a box would go
# through |W|: measured, at eps 1e-4 on the 1-layer Transformer the box reached 37% of the
# linear part at the logits). SPACE holds the walk's count of symbols; past MAX_SYMBOLS, or
# where a form would exceed MAX_FORM_ENTRIES, new errors go to the box instead.
MAX_SYMBOLS = 20_000
MAX_FORM_ENTRIES = 30_000_000
SPACE: ContextVar[list[int] | None] = ContextVar("affine_symbols", default=None)


# Pair symbols (derived/tangent.py, the inf-ball): psi_pq = d_p s_q / eps in [-1, 1] for the input's
# change d (columns [0, P)) and the tangent's direction s (columns [P, 2P)), at the columns
# [base, base + P^2) (row-major in (p, q)), or None. Products (affine_rules.product) put the
# bilinear part (u_x . d)(v_y . s) of a product on them exactly instead of a symbol per entry,
# so sums of such products keep their cancellations.
PAIRS: ContextVar[tuple[int, int] | None] = ContextVar("pair_symbols", default=None)

# Second-order symbols (the affine route's walks, `affine_rules.walk(quad=True)`):
# the P(P+1)/2 columns from QUAD's base hold, for p <= q in row-major upper-triangle order,
#     sigma_pq = d_p d_q / eps^2 (p < q)   and   sigma_pp = 2 d_p^2 / eps^2 - 1,
# both in [-1, 1] for every d in either ball (|d_p d_q| <= eps^2), so every rule treats them as
# any other noise symbol; they are functions of d alone, shared by every form of the walk.
# Products put the exact quadratic part (u_x . d)(u_y . d) = d^T M d of their input parts on
# them, d^T M d = eps^2 / 2 tr M + sum_{p<q} eps^2 (M_pq + M_qp) sigma_pq
# + sum_p eps^2 M_pp / 2 sigma_pp (affine_products._to_quad), instead of a fresh symbol per
# entry: later sums of such products keep their cancellations (the attention scores' and
# P @ V's quadratic terms feed every later layer).
QUAD: ContextVar[int | None] = ContextVar("quad_symbols", default=None)


# l1 groups of noise symbols (the products of the second-order walks, set by
# driver.margin_lower_bounds, either ball): an op whose errors e_i = err_i eta_i (one symbol per
# entry, |eta_i| <= 1) also satisfy sum_i |e_i| <= S (second-order errors: Cauchy-Schwarz over
# the whole tensor) records (first column, end column, w_i = err_i / S): the symbols then lie in
# {|eta_i| <= 1, sum_i w_i |eta_i| <= 1}, a subset of the box, so a rule that ignores the group
# stays sound, and sizes bound sum_i |c_i| |eta_i| over it by the fractional knapsack.
GROUPS: ContextVar[list[tuple[int, int, np.ndarray]] | None] = ContextVar(
    "symbol_groups", default=None)


def knapsack(c: np.ndarray, w: np.ndarray) -> np.ndarray:
    """max sum_q c_q t_q over 0 <= t_q <= 1, sum_q w_q t_q <= 1 for c (..., n) >= 0, w (n,) > 0:
    the items by c / w, largest first, the last one taken in part (an upper bound: 1e-10
    relative added for the sums' rounding)."""
    order = np.argsort(-(c / w), axis=-1)
    cs = np.take_along_axis(c, order, axis=-1)
    ws = w[order]
    # frac = clip((1 - (cumsum(ws) - ws)) / ws, 0, 1), the same operations in one buffer
    # (the temporaries were a fifth of the knapsack's time)
    frac = np.cumsum(ws, axis=-1)
    frac -= ws
    np.subtract(1.0, frac, out=frac)
    frac /= ws
    np.minimum(frac, 1.0, out=frac)
    np.maximum(frac, 0.0, out=frac)
    frac *= cs
    return frac.sum(axis=-1) * (1 + 1e-10)


# rows x columns of one block of `abs_sum` (~2 MB: the wide forms' |a| as one temporary was
# memory-bound, 7x slower on a (512, 20000) form)
ABS_SUM_BLOCK = 1 << 18


def abs_sum(a: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """sum_q |a_q| over columns [lo, hi) of every row of a (..., Q), the same numbers as
    np.abs(a[..., lo:hi]).sum(axis=-1), computed in blocks of rows through one buffer."""
    hi = min(hi, a.shape[-1])
    width = max(hi - lo, 0)
    rows = int(np.prod(a.shape[:-1]))
    if width == 0 or rows * width <= ABS_SUM_BLOCK:
        return np.abs(a[..., lo:hi]).sum(axis=-1)
    flat = a.reshape(rows, a.shape[-1])
    step = max(1, ABS_SUM_BLOCK // width)
    buf = np.empty((min(step, rows), width))
    out = np.empty(rows)
    for i in range(0, rows, step):
        blk = flat[i:i + step, lo:hi]
        b = buf[:blk.shape[0]]
        np.abs(blk, out=b)
        out[i:i + step] = b.sum(axis=-1)
    return out.reshape(a.shape[:-1])


def sym_sum(a: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """>= sum_q |a_q| |eta_q| over columns [lo, hi): the plain sum, each whole group inside
    the range by the smaller of its sum and its knapsack."""
    groups = GROUPS.get()
    hi = min(hi, a.shape[-1])
    if not groups:
        return abs_sum(a, lo, hi)
    total = np.zeros(a.shape[:-1])
    cur = lo
    for g0, g1, w in groups:
        if g0 < cur or g1 > hi:
            continue
        total = total + abs_sum(a, cur, g0)
        total = total + group_sum(np.abs(a[..., g0:g1]), w)
        cur = g1
    return total + abs_sum(a, cur, hi)


# groups up to this many symbols take `group_sum`'s shortcut (its rounding argument needs
# n u well below 1e-10; a walk's groups hold at most MAX_SYMBOLS)
FIT_MAX = 100_000


def group_sum(c: np.ndarray, w: np.ndarray) -> np.ndarray:
    """min(c.sum(axis=-1), knapsack(c, w)) for c (..., n) >= 0, w (n,) > 0, the same numbers,
    the knapsack solved only on the rows whose items do not all fit: where the weights of
    the nonzero items sum to at most 1 - 1e-9 (each then at most 1, so c / w > 0 and they
    sort first), every one is taken whole (1 - before >= w with room for the sums'
    rounding, n u << 1e-9), and the knapsack is their sum in another order times 1 + 1e-10,
    above the plain sum (the two orders differ by at most 2 n u of it): the minimum is the
    plain sum. A group's coefficients are mostly on a few rows' symbols (the other rows
    never met that op), so most rows fit."""
    plain = c.sum(axis=-1)
    n = c.shape[-1]
    if n > FIT_MAX or REFERENCE:
        return np.minimum(plain, knapsack(c, w))
    rows = c.reshape(-1, n)
    fit = (rows > 0) @ w <= 1 - 1e-9
    if np.all(fit):
        return plain
    out = plain.reshape(-1).copy()
    rest = ~fit
    out[rest] = np.minimum(out[rest], knapsack(rows[rest], w))
    return out.reshape(plain.shape)


# split_lin's last results by the identity of the form's coefficient array (held weakly, so a
# released form is not kept alive) and the ball: a product reads each operand's sizes twice
# (its own and through `dev`), and the forms are never written in place. Read-only arrays.
_LIN_MEMO: dict[tuple[int, float, str, int, int | None, bool, tuple[int, int] | None],
                tuple[weakref.ref[np.ndarray], np.ndarray, np.ndarray]] = {}
_LIN_MEMO_SIZE = 16
_LIN_LOCK = threading.Lock()  # the service walks in several threads at once


def _lin_key(x: Aff, ball: Ball) -> tuple[int, float, str, int, int | None, bool,
                                          tuple[int, int] | None]:
    groups = GROUPS.get()
    return (id(x.a), float(ball.eps), ball.norm, ball.size, QUAD.get(), QUAD_EIG.get(),
            None if groups is None else (id(groups), len(groups)))


def _lin_memo(x: Aff, key: tuple) -> tuple[np.ndarray, np.ndarray] | None:
    with _LIN_LOCK:
        hit = _LIN_MEMO.get(key)
    if hit is not None and hit[0]() is x.a:
        return hit[1], hit[2]
    return None


def split_lin(x: Aff, ball: Ball) -> tuple[np.ndarray, np.ndarray]:
    """(>= |a_in d| over the ball, >= sum_q |a_q| over the symbols), entrywise."""
    key = _lin_key(x, ball)
    hit = _lin_memo(x, key)
    if hit is not None:
        return hit
    li, ls = _split_lin(x, ball)
    li.flags.writeable = False
    ls.flags.writeable = False
    with _LIN_LOCK:
        if len(_LIN_MEMO) >= _LIN_MEMO_SIZE:
            _LIN_MEMO.pop(next(iter(_LIN_MEMO)), None)
        _LIN_MEMO[key] = (weakref.ref(x.a), li, ls)
    return li, ls


def _split_lin(x: Aff, ball: Ball) -> tuple[np.ndarray, np.ndarray]:
    p = ball.size
    li = _up(ball.eps * dual_row_norms(np.abs(x.a[..., :p]), ball.norm), 2)
    if x.a.shape[-1] > p:
        base = QUAD.get()
        if base is not None and ball.norm == "2" and x.a.shape[-1] > base:
            t = quad_size(p)
            c = x.a[..., base:base + t]
            rest = sym_sum(x.a, p, base) + sym_sum(x.a, base + t, x.a.shape[-1])
            qt = quad_two(c, p)
            if QUAD_EIG.get():
                qt = quad_two_best(c, p, li + rest + qt, qt)
            return li, _up(rest + qt, x.a.shape[-1] - p + 2)
        return li, _up(sym_sum(x.a, p, x.a.shape[-1]), x.a.shape[-1] - p + 2)
    return li, np.zeros_like(li)



def dev_low(x: Aff, ball: Ball) -> np.ndarray:
    """A lower bound on T(X) - T0 over the ball, per entry: `dev`'s, or, where the form has
    second-order symbols (a `QUAD` walk's), the larger of that and o - rest - b + the input's
    linear part and the quadratic part bounded together (`quad_low`)."""
    return _joint_low(x, ball, dev(x, ball)[0])


def _joint_low(x: Aff, ball: Ball, lo: np.ndarray) -> np.ndarray:
    """`dev_low` from `dev`'s lower end lo."""
    base = QUAD.get()
    p = ball.size
    if base is None or x.a.shape[-1] <= base or p > JOINT_MAX_P:
        return lo
    t = quad_size(p)
    a = _cols(x.a, base + t).reshape(x.c.size, -1)
    o = x.o.reshape(-1)
    b = x.b.reshape(-1)
    out = lo.reshape(-1).copy()
    for i in range(x.c.size):
        try:
            ql = quad_low(a[i, :p], a[i, base:base + t], ball)
        except (np.linalg.LinAlgError, FloatingPointError, ValueError):
            ql = None  # an optional refinement: `dev`'s bound stands
        if ql is None:
            continue
        rest = float(_up(sym_sum(a[i], p, base) + sym_sum(a[i], base + t, a.shape[-1])
                         + b[i], a.shape[-1] + 2))
        low = o[i] + ql - rest
        low -= _REL * (abs(o[i]) + abs(ql) + rest) + TINY
        out[i] = max(out[i], low)
    return out.reshape(lo.shape)


def range_low(x: Aff, ball: Ball) -> np.ndarray:
    """`ranges`' lower end, from `dev_low`."""
    lo, hi = dev(x, ball)
    lo = _joint_low(x, ball, lo)
    pad = _REL * (np.abs(x.c) + x.m + np.abs(lo) + np.abs(hi)) + TINY
    return x.c - x.m + lo - pad


# The 2-ball's second-order part by the quadratic form's eigenvalues (`quad_two_eig`), in the
# walks that set QUAD_EIG (the radius search's last stage, routes/certify.py), for the
# entries whose Frobenius bound is at least QUAD_EIG_SHARE of their whole size: one P x P
# eigenvalue problem per entry makes a walk ~4x slower.
QUAD_EIG: ContextVar[bool] = ContextVar("quad_eig", default=False)
QUAD_EIG_SHARE = 0.02


def quad_two_best(c: np.ndarray, p: int, size: np.ndarray, qt: np.ndarray) -> np.ndarray:
    """qt = `quad_two(c, p)`, and the smaller of it and `quad_two_eig` on the entries where qt
    is at least QUAD_EIG_SHARE of `size` (the entry's whole size, qt included)."""
    pick = (qt >= QUAD_EIG_SHARE * size) & (qt > 0)
    if not np.any(pick):
        return qt
    out = np.array(qt, dtype=np.float64, copy=True)
    rows = c.reshape(-1, c.shape[-1])
    flat_pick = pick.reshape(-1)
    eig = quad_two_eig(rows[flat_pick], p)
    out.reshape(-1)[flat_pick] = np.minimum(out.reshape(-1)[flat_pick], eig)
    return out


def lin(x: Aff, ball: Ball) -> np.ndarray:
    """>= |a d| + sum |a_q| over the ball and the symbols, entrywise."""
    li, ls = split_lin(x, ball)
    return _up(li + ls, 2)


def rough_lin(x: Aff, ball: Ball) -> np.ndarray:
    """`lin` for a term that only scales a rounding allowance (gamma_k times it): the sizes
    already computed when there are some, else without the eigenvalue stage (QUAD_EIG: any
    upper bound is sound there, and the eigenproblems of an entry read by linear ops alone
    were a third of an eigenvalue walk's time on a small Transformer)."""
    if not QUAD_EIG.get() or _lin_memo(x, _lin_key(x, ball)) is not None:
        return lin(x, ball)
    token = QUAD_EIG.set(False)
    try:
        return lin(x, ball)
    finally:
        QUAD_EIG.reset(token)


def _cols(a: np.ndarray, n: int) -> np.ndarray:
    """a with zero columns appended up to n (symbols it does not depend on)."""
    if a.shape[-1] >= n:
        return a
    return np.concatenate([a, np.zeros((*a.shape[:-1], n - a.shape[-1]))], axis=-1)


def _width(*xs: Aff) -> int:
    return max(x.a.shape[-1] for x in xs)


# The walk's arithmetic without its fast paths (widened copies, np.where over whole arrays,
# ops run column by column): the same numbers, slower; tests/test_affine_fast.py pins the
# fast paths against it.
REFERENCE = False


def reference() -> bool:
    """Whether the walk runs without its fast paths (`REFERENCE`, read when called)."""
    return REFERENCE


def fresh(a: np.ndarray, b: np.ndarray, err: np.ndarray, budget: float | None = None
          ) -> tuple[np.ndarray, np.ndarray]:
    """Adds the nonnegative errors err (*S,) as new symbols to the form (a, b): one column per
    entry with err > 0 (or to the box b when the symbol budget is spent)."""
    def fill(out: np.ndarray) -> None:
        out[...] = a.reshape(out.shape)
    return fresh_fill(fill, a.shape[-1], b, err, budget, a)


def fresh_fill(fill: Callable[[np.ndarray], None], n: int, b: np.ndarray, err: np.ndarray,
               budget: float | None = None, a: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """`fresh` for coefficients (*S, n) that `fill(out)` writes into the view out of the
    widened result (its first n columns): no copy of them into the wider array (the wide
    forms are memory-bound: a copy costs as much as the product that made them). `a`: the
    coefficients when already made (returned as they are where no column is added)."""
    space = SPACE.get()
    err = np.broadcast_to(err, b.shape)
    nz = np.flatnonzero(err > 0)
    w = 0
    if space is not None and nz.size:
        p, used = space[0], space[1]
        reserved = space[2] if len(space) > 2 else 0  # columns given out before the walk
        w = p + used + nz.size
        if used - reserved + nz.size > MAX_SYMBOLS or b.size * w > MAX_FORM_ENTRIES:
            w = 0
    if space is None or w == 0:
        if a is None:
            a = np.empty((*b.shape, n))
            fill(a)
        return a, b + err
    if REFERENCE:
        if a is None:
            a = np.empty((*b.shape, n))
            fill(a)
        out = np.zeros((b.size, w))
        out[:, :n] = a.reshape(b.size, -1)
    else:
        out = np.empty((b.size, w))
        fill(out[:, :n].reshape(*b.shape, n, copy=False))  # a view: raises rather than copy
        out[:, n:] = 0.0
    out[nz, p + used + np.arange(nz.size)] = err.reshape(-1)[nz]
    groups = GROUPS.get()
    if groups is not None and budget is not None and 0 < budget < float(err.sum()):
        # `budget` >= sum_i |e_i|: the weights rounded down keep the constraint implied
        wts = err.reshape(-1)[nz] / budget * (1 - 1e-12)
        groups.append((p + used, p + used + nz.size, wts))
    space[1] = used + nz.size
    return out.reshape(*b.shape, w), b


def dev(x: Aff, ball: Ball) -> tuple[np.ndarray, np.ndarray]:
    """An enclosure of T(X) - T0 over the ball."""
    r = _up(lin(x, ball) + x.b, 2)
    pad = _REL * (np.abs(x.o) + r) + TINY
    return x.o - r - pad, x.o + r + pad


def ranges(x: Aff, ball: Ball) -> tuple[np.ndarray, np.ndarray]:
    """An enclosure of T(X) over the ball."""
    lo, hi = dev(x, ball)
    pad = _REL * (np.abs(x.c) + x.m + np.abs(lo) + np.abs(hi)) + TINY
    return x.c - x.m + lo - pad, x.c + x.m + hi + pad


def interval(c: np.ndarray, m: np.ndarray, lo: np.ndarray, hi: np.ndarray, p: int) -> Aff:
    """The interval form of a tensor known to lie in [lo, hi]: T(X) - T0 in
    [lo - c - m, hi - c + m], its half width a new symbol per entry."""
    dlo, dhi = lo - c - m, hi - c + m
    pad = _REL * (np.abs(lo) + np.abs(hi) + np.abs(c) + m) + TINY
    o = 0.5 * (dlo + dhi)
    hw = _up(0.5 * (dhi - dlo) + pad + _REL * np.abs(o), 2)
    a, b = fresh(np.zeros((*c.shape, p)), np.zeros_like(hw), hw)
    return Aff(c, m, o, a, b)


def input_form(ball: Ball) -> Aff:
    c = ball.center.astype(np.float64)
    p = c.size
    z = np.zeros_like(c)
    return Aff(c, z, z.copy(), np.eye(p).reshape(*c.shape, p), z.copy())


# An entry's affine form is replaced by an interval only where the interval is this much
# narrower: an interval drops the entry's relation to the input, which products and sums
# downstream use (measured: with 1.0, the MLP's margins lost 90% of their certified radius).
COLLAPSE = 0.5


def select(x: Aff, y: Aff, ball: Ball, factor: float = 1.0) -> Aff:
    """Per entry, y where it is narrower than `factor` times x (same tensor, c, m)."""
    wx = lin(x, ball) + x.b
    wy = lin(y, ball) + y.b
    take = wy < factor * wx
    if not np.any(take):
        return x
    n = _width(x, y)
    if REFERENCE:
        return Aff(x.c, x.m, np.where(take, y.o, x.o),
                   np.where(take[..., None], _cols(y.a, n), _cols(x.a, n)),
                   np.where(take, y.b, x.b), x.stochastic)
    # row by row from the branch it takes (np.where over both widened arrays read and
    # wrote every coefficient three times)
    a = np.empty((*take.shape, n))
    for src, rows in ((x.a, ~take), (y.a, take)):
        w = src.shape[-1]
        np.copyto(a[..., :w], src, where=rows[..., None])
        np.copyto(a[..., w:], 0.0, where=rows[..., None])
    return Aff(x.c, x.m, np.where(take, y.o, x.o), a, np.where(take, y.b, x.b), x.stochastic)


def narrow(x: Aff, lo: np.ndarray | None, hi: np.ndarray | None, ball: Ball) -> Aff:
    """x, with the entries whose known range [lo, hi] is COLLAPSE times narrower than the
    form's replaced by that interval (new symbols only for those entries)."""
    if lo is None or hi is None:
        return x
    dlo, dhi = lo - x.c - x.m, hi - x.c + x.m
    pad = _REL * (np.abs(lo) + np.abs(hi) + np.abs(x.c) + x.m) + TINY
    mid = 0.5 * (dlo + dhi)
    hw = _up(0.5 * (dhi - dlo) + pad + _REL * np.abs(mid), 2)
    with np.errstate(invalid="ignore", over="ignore"):
        width = lin(x, ball) + x.b + np.abs(x.o) * 0.0
    # an entry whose form overflowed (inf, nan) takes the interval whatever its width
    take = (hw < COLLAPSE * width) | ~np.isfinite(width)
    if not np.any(take):
        return x
    b = np.where(take, 0.0, x.b)
    if REFERENCE:
        a, b = fresh(np.where(take[..., None], 0.0, x.a), b, np.where(take, hw, 0.0))
        return Aff(x.c, x.m, np.where(take, mid, x.o), a, b, x.stochastic)

    def fill(out: np.ndarray) -> None:  # the taken entries' rows zeroed, the rest kept
        out[...] = x.a
        out[take] = 0.0
    a, b = fresh_fill(fill, x.a.shape[-1], b, np.where(take, hw, 0.0))
    return Aff(x.c, x.m, np.where(take, mid, x.o), a, b, x.stochastic)


def margins(out: Aff, label: int, ball: Ball) -> dict[int, float]:
    """Lower bounds of f_label - f_j over the ball for every j != label, from the output's
    form: (c_l - c_j) - (m_l + m_j) + (o_l - o_j) - |(a_l - a_j) d| - (b_l + b_j), every
    term rounded down."""
    k = out.c.size
    c, m, o, b = (v.reshape(k) for v in (out.c, out.m, out.o, out.b))
    a = out.a.reshape(k, -1)
    res: dict[int, float] = {}
    for j in range(k):
        if j == label:
            continue
        diff = Aff(np.array([c[label] - c[j]]), np.array([m[label] + m[j]]),
                   np.array([o[label] - o[j]]), (a[label] - a[j])[None],
                   np.array([b[label] + b[j]]))
        lo = range_low(diff, ball)
        # the centre difference c_l - c_j is itself rounded: one more unit roundoff of it
        res[j] = float(lo[0] - 2 * U * abs(c[label] - c[j]) - TINY)
    return res


def _sym_two(a: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """>= sup ||sum_q a_q eta_q||_2 per token over the symbols of columns [lo, hi) (a: (..., D,
    Q)): `box_to_two` of them all, or where groups lie inside the range the smaller of that
    and `box_to_two` of the other columns plus, per group, the knapsack of its columns'
    norms (the triangle inequality: ||sum_q a_q eta_q|| <= sum_q ||a_q|| |eta_q|)."""
    hi = min(hi, a.shape[-1])
    if hi <= lo:
        return np.zeros(a.shape[:-2])
    inside = [(g0, g1, w) for g0, g1, w in GROUPS.get() or [] if lo <= g0 and g1 <= hi]
    if not inside:
        return box_to_two(a[..., lo:hi])
    keep = np.ones(hi - lo, dtype=bool)
    total = np.zeros(a.shape[:-2])
    for g0, g1, w in inside:
        cn = np.sqrt(_up(np.square(a[..., g0:g1]).sum(axis=-2), a.shape[-2])) * (1 + 4 * U)
        total = total + knapsack(cn, w)
        keep[g0 - lo:g1 - lo] = False
    whole = box_to_two(a[..., lo:hi])
    if np.all(total >= whole):  # the split is above `whole` already: skip its other Gram
        return whole
    rest = a[..., lo:hi][..., keep]
    split = _up(total + (box_to_two(rest) if rest.shape[-1] else 0.0), 2)
    return np.minimum(whole, split)


def input_radius(ain: np.ndarray, ball: Ball) -> np.ndarray:
    """>= sup ||ain d||_2 over the ball for every (..., D, P) block: eps sigma_max(ain) on the
    2-ball (LAPACK's SVD, exact for a matrix within c P u ||A||_F: 64 (P + D) u ||A||_F added),
    eps `box_to_two(ain)` on the inf-ball (d in eps [-1, 1]^P)."""
    d, p = ain.shape[-2], ain.shape[-1]
    if ball.norm == "inf":
        return _up(ball.eps * box_to_two(ain), 2)
    sig = np.linalg.norm(ain, ord=2, axis=(-2, -1))
    fro = np.sqrt(np.square(ain).sum(axis=(-2, -1)))
    return _up(ball.eps * (sig * (1 + 1e-12) + 64 * (p + d) * U * fro), 4)


def symbol_radius(a: np.ndarray, ball: Ball) -> np.ndarray:
    """>= sup ||a_sym e||_2 over the symbols (columns P on) for every (..., D, Q) block: on the
    2-ball the second-order symbols' part by its bound per entry (quad_two), whose root sum of
    squares bounds the block's; the other symbols by `_sym_two` (box_to_two, the groups)."""
    d, p = a.shape[-2], ball.size
    base = QUAD.get()
    if base is not None and ball.norm == "2" and a.shape[-1] > base:
        t = quad_size(p)
        qe = quad_two(a[..., base:base + t], p)  # (..., D)
        qn = np.sqrt(_up(np.square(qe).sum(axis=-1), d + 2)) * (1 + 4 * U)
        return _up(qn + _sym_two(a, p, base) + _sym_two(a, base + t, a.shape[-1]), 2)
    if a.shape[-1] > p:
        return _sym_two(a, p, a.shape[-1])
    return np.zeros(a.shape[:-2])


def token_radius(x: Aff, ball: Ball) -> np.ndarray:
    """A bound on ||T_t(X) - T_t(X0)||_2 per token t (the last axis), (*S[:-1], 1):
    ||o_t|| + sup ||a_in,t d|| (`input_radius`) + sup ||a_sym,t e|| (`symbol_radius`) +
    ||b_t||."""
    d = x.shape[-1]

    def norm2(v: np.ndarray) -> np.ndarray:
        return np.sqrt(_up(np.square(v).sum(axis=-1), d)) * (1 + 4 * U)
    out = _up(norm2(x.o) + input_radius(x.a[..., :ball.size], ball)
              + symbol_radius(x.a, ball) + norm2(x.b), 4)
    return out[..., None]
