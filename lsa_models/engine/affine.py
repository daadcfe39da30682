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
the symbol budget, the margins' lower bounds and the per-token radii; affine_rules.py the
rules, one node at a time, and the standalone walk.

driver._walk runs the rules in lockstep with the Jacobian enclosure (each op's inputs narrowed
to the enclosure's ranges, the enclosure's outputs intersected with the forms'); alone they
bound the classification margins on a ball, the certified radius's second route (local.py).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..bounds.numerics import U
from .values import Ball, box_to_two, dual_row_norms, gamma, widen_up

# relative outward allowance of libm values (exp, erf, tanh) and of a handful of roundings
_REL = 1e-12
TINY = 1e-300


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
    # probability 0); every other rule refuses a masked form (affine_rules._masks)
    masked: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.c.shape)


def _up(x: np.ndarray, k: int = 4) -> np.ndarray:
    return widen_up(np.asarray(x, dtype=np.float64), k)


# Noise symbols: the columns of `a` past the input's P entries are error terms
# e_q in [-1, 1] created by the nonlinear ops (one per entry whose remainder is nonzero), shared
# by everything computed from them, so their signs survive later linear maps (a box would go
# through |W|: measured, at eps 1e-4 on the 1-layer Transformer the box reached 37% of the
# linear part at the logits). SPACE holds the walk's count of symbols; past MAX_SYMBOLS, or
# where a form would exceed MAX_FORM_ENTRIES, new errors go to the box instead.
MAX_SYMBOLS = 20_000
MAX_FORM_ENTRIES = 30_000_000
SPACE: ContextVar[list[int] | None] = ContextVar("affine_symbols", default=None)


# Pair symbols (tangent.py, the inf-ball): psi_pq = d_p s_q / eps in [-1, 1] for the input's
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
# + sum_p eps^2 M_pp / 2 sigma_pp (affine_rules._to_quad), instead of a fresh symbol per
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
    before = np.cumsum(ws, axis=-1) - ws
    frac = np.clip((1.0 - before) / ws, 0.0, 1.0)
    return (cs * frac).sum(axis=-1) * (1 + 1e-10)


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
        blk = np.abs(a[..., g0:g1])
        total = total + np.minimum(blk.sum(axis=-1), knapsack(blk, w))
        cur = g1
    return total + abs_sum(a, cur, hi)


def quad_size(p: int) -> int:
    """Columns of the second-order symbols for an input of p entries."""
    return p * (p + 1) // 2


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


@functools.lru_cache(maxsize=8)
def quad_cols(p: int) -> tuple[np.ndarray, np.ndarray]:
    """For the P(P+1)/2 second-order symbols (row-major upper triangle): each one's flat
    index p * P + q in a P x P matrix, and the positions of the diagonal ones."""
    iu, ju = np.triu_indices(p)
    return iu * p + ju, np.flatnonzero(iu == ju)


def quad_two(c: np.ndarray, p: int) -> np.ndarray:
    """On the 2-ball, >= |sum c_pq sigma_pq| for the second-order symbols' coefficients c
    (..., P(P+1)/2): the sum is d^T Q d / eps^2 - sum_p c_pp with Q_pp = 2 c_pp,
    Q_pq = Q_qp = c_pq / 2, and |d^T Q d| <= ||Q||_2 ||d||^2 <= ||Q||_F eps^2, where
    ||Q||_F^2 = 4 sum c_pp^2 + 2 sum_{p<q} (c_pq / 2)^2 = 3.5 sum c_pp^2 + 0.5 sum_all c^2."""
    cd = c[..., quad_cols(p)[1]]
    return _up(_quad_fro(c, p) + np.abs(cd.sum(axis=-1)), p + 2)


# The margins' lower bounds read the input's linear part and the second-order symbols together
# (`quad_low`): both are functions of the one change d, and bounding them apart
# (`li` + the quadratic part's own bound) gives each its worst d. Forms up to this many input
# entries (one symmetric eigenproblem of that size per margin).
JOINT_MAX_P = 1024
JOINT_STEPS = 200


def triu_pack_sym(m: np.ndarray) -> np.ndarray:
    """The row-major upper triangle of m + m^T (..., P(P+1)/2) (`quad_cols`' order; the
    diagonal holds 2 m_ii), row by row without forming m + m^T: row i is m[i, i:] +
    m[i:, i] (contiguous copies: a gather through flat indices took 10x longer)."""
    p = m.shape[-1]
    out = np.empty((*m.shape[:-2], quad_size(p)))
    off = 0
    for i in range(p):
        np.add(m[..., i, i:], m[..., i:, i], out=out[..., off:off + p - i])
        off += p - i
    return out


def _quad_upper(c: np.ndarray, p: int) -> np.ndarray:
    """Q's upper triangle (..., P, P), zeros below the diagonal (see `_quad_matrix`): LAPACK's
    symmetric solvers read one triangle (`UPLO="U"`). Row by row from the row-major upper
    triangle of c (the layout `triu_pack_sym` writes): contiguous copies (a scatter through
    flat indices into a zeroed P x P array took 30x longer, the largest cost of the 2-ball's
    eigenvalue stage)."""
    lead = c.shape[:-1]
    m = np.zeros((*lead, p, p))
    off = 0
    for i in range(p):
        m[..., i, i:] = c[..., off:off + p - i]
        off += p - i
    m *= 0.5  # exact: a power of two
    idx = np.arange(p)
    m[..., idx, idx] = 2.0 * c[..., quad_cols(p)[1]]
    return m


def _quad_matrix(c: np.ndarray, p: int) -> np.ndarray:
    """Q (..., P, P) with sum_k c_k sigma_k = z^T Q z - sum_p c_pp for z = d / eps (`QUAD`'s
    symbols: sigma_pq = z_p z_q, sigma_pp = 2 z_p^2 - 1) for coefficients c (..., P(P+1)/2):
    Q_pp = 2 c_pp, Q_pq = Q_qp = c_pq / 2, exact (scalings by powers of two)."""
    m = _quad_upper(c, p)
    idx = np.arange(p)
    d = m[..., idx, idx].copy()
    m = m + np.swapaxes(m, -1, -2)  # the diagonal twice, set back below
    m[..., idx, idx] = d
    return m


def _quad_fro(c: np.ndarray, p: int) -> np.ndarray:
    """>= ||Q||_F from the coefficients: ||Q||_F^2 = 4 sum c_pp^2 + 2 sum_{p<q} (c_pq / 2)^2 =
    3.5 sum c_pp^2 + 0.5 sum_all c^2, rounded up."""
    cd = c[..., quad_cols(p)[1]]
    sd = np.square(cd).sum(axis=-1)
    sa = np.einsum("...i,...i->...", c, c)
    return np.sqrt(_up(3.5 * sd + 0.5 * sa, c.shape[-1] + 2)) * (1 + 4 * U)


def _support_groups(m: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Rows of a stack of upper triangles (n, P, P) grouped by their support (the indices p
    whose row or column holds a nonzero): [(rows, support indices)], support ascending. A
    matrix that vanishes outside S x S has the eigenvalues of its S x S block and zeros."""
    nz = m != 0
    supp = nz.any(axis=-1) | nz.any(axis=-2)  # (n, P)
    keys = np.packbits(supp, axis=-1)
    _, inverse = np.unique(keys, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    return [(rows, np.flatnonzero(supp[rows[0]]))
            for g in range(int(inverse.max()) + 1 if inverse.size else 0)
            for rows in (np.flatnonzero(inverse == g),)]


def extreme_eigs(m: np.ndarray, uplo: Literal["L", "U"] = "L"
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The smallest and largest eigenvalues (LAPACK's) of each symmetric matrix in a stack
    (n, P, P) (`uplo`: the triangle LAPACK reads), each solved on its support
    (`_support_groups`): a matrix that vanishes outside S x S has the eigenvalues of its
    S x S block and zeros, and a zero matrix both ends 0; the callers clip the ends at 0, so
    the zeros never matter. An eigenproblem costs P^3, and before attention mixes the tokens
    an entry reads one or two tokens' inputs (16 or 32 of 128 in an 8-token, D = 16 model)."""
    lam_lo, lam_hi = np.zeros(m.shape[0]), np.zeros(m.shape[0])
    for rows, sup in _support_groups(m):
        if sup.size == 0:
            continue
        sub = m[rows] if sup.size == m.shape[-1] else m[np.ix_(rows, sup, sup)]
        lam = np.linalg.eigvalsh(sub, UPLO=uplo)
        lam_lo[rows], lam_hi[rows] = lam[:, 0], lam[:, -1]
    return lam_lo, lam_hi


def _eig_allowance(fro: np.ndarray | float, p: int) -> np.ndarray:
    """LAPACK's symmetric eigenvalues are those of a matrix within 64 P u ||Q||_F of Q (the
    allowance `input_radius` takes too): each computed eigenvalue is within this of Q's."""
    return _up(np.asarray(64 * p * U * np.asarray(fro)), 4) + TINY


def _box_minimiser(g: np.ndarray, q: np.ndarray, mu: float, top: float) -> np.ndarray:
    """An approximate minimiser of g . z + z^T (Q + mu I) z over the box [-1, 1]^P (convex):
    FISTA from the corner -sign(g), gradient g + 2 M z, step 1 / (2 lambda_max(M))."""
    step = 0.99 / max(2.0 * top, TINY)
    z = -np.sign(g)
    yk, tk = z, 1.0
    for _ in range(JOINT_STEPS):
        zn = np.clip(yk - step * (g + 2.0 * (q @ yk + mu * yk)), -1.0, 1.0)
        tn = 0.5 * (1.0 + np.sqrt(1.0 + 4.0 * tk * tk))
        yk = zn + ((tk - 1.0) / tn) * (zn - z)
        z, tk = zn, tn
    return z


def _sphere_minimiser(g: np.ndarray, lam: np.ndarray, vecs: np.ndarray, mu0: float
                      ) -> tuple[float, np.ndarray]:
    """The trust-region problem min g . z + z^T Q z over |z| <= 1 (Q = V diag(lam) V^T): the
    multiplier nu >= mu0 (>= -lambda_min) with |z(nu)| = 1, z(nu) = -(Q + nu I)^-1 g / 2, by
    bisection (|z(nu)| decreases in nu; nu = mu0 when z(mu0) is inside), and z(nu). At that
    nu the dual value of `quad_low` is the problem's minimum (the S-lemma); the bound holds
    for any nu >= mu0 and any y, so the numerics only set how close it is."""
    gh = vecs.T @ g

    def norm_z(nu: float) -> float:
        den = 2.0 * (lam + nu)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return float(np.sqrt(np.square(np.where(den > 0, gh / den, np.inf)).sum()))
    lo = mu0
    if norm_z(lo) > 1.0:
        hi = max(mu0, 0.5 * float(np.linalg.norm(g)) - float(lam[0])) * 2.0 + TINY
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            if norm_z(mid) > 1.0:
                lo = mid
            else:
                hi = mid
        lo = hi  # |z(hi)| <= 1
    den = 2.0 * (lam + lo)
    z = vecs @ -np.where(den > 0, gh / np.where(den > 0, den, 1.0), 0.0)
    return lo, z


def _dual_value(g: np.ndarray, q: np.ndarray, mu: float, y: np.ndarray, box: bool) -> float:
    """||g + 2 M y||_dual + y^T M y + mu R for M = Q + mu I, rounded up (each computed
    quantity widened by gamma of its number of terms; g's own rounding, one product, too)."""
    p = g.size
    ay = np.abs(y)
    qy = q @ y
    aqy = np.abs(q) @ ay
    w = g + 2.0 * (qy + mu * y)
    werr = gamma(p + 4) * (np.abs(g) + 2.0 * (aqy + mu * ay)) + U * np.abs(g)
    aw = np.abs(w) + werr
    wn = float(_up(np.array(aw.sum() if box else np.sqrt(np.square(aw).sum())), p + 4))
    yy = float(y @ y)
    ymy = float(y @ qy) + mu * yy + gamma(2 * p + 4) * (float(ay @ aqy) + mu * yy)
    big_r = float(p) if box else 1.0
    return float(_up(np.array(wn + max(ymy, 0.0) + mu * big_r * (1 + 2 * U)), 4))


def quad_low(lin_in: np.ndarray, c: np.ndarray, ball: Ball) -> float | None:
    """A lower bound on min over the ball of l . d + sum_k c_k sigma_k (the input's linear part
    l = lin_in and the second-order symbols' coefficients c of one form entry), or None.

    With z = d / eps (the unit box or ball), g = eps l and Q from `_quad_matrix`, the quantity
    is g . z + z^T Q z - sum_p c_pp. For mu >= 0 with M = Q + mu I positive semidefinite and
    any y, (z - y)^T M (z - y) >= 0 gives z^T M z >= 2 y^T M z - y^T M y, so
        g . z + z^T Q z = g . z + z^T M z - mu |z|^2 >= (g + 2 M y) . z - y^T M y - mu R
                        >= -||g + 2 M y||_dual - y^T M y - mu R
    (R = max |z|^2: P on the box, 1 on the ball; the dual norm l1 / l2). This is the Lagrangian
    dual of the problem (the box's or ball's constraints |z_p|^2 <= 1 or |z|^2 <= 1 with one
    multiplier mu), and with y the minimiser of the convex g . z + z^T M z over the domain it
    equals that convex minimum less mu R: exact where the minimiser lies on a corner of the
    box or on the sphere, as the margins' do (the linear part dominates). mu: the computed
    smallest eigenvalue less LAPACK's error allowance 64 P u ||Q||_F (as `input_radius`), so M
    is PSD (on the ball the trust-region multiplier, `_sphere_minimiser`, which is at least
    that); y: the convex problem's minimiser (`_box_minimiser`, `_sphere_minimiser`; any y is
    sound, it only sets the value). Every computed quantity is widened by its rounding (gamma
    of its number of terms)."""
    p = lin_in.size
    if p > JOINT_MAX_P or c.size != quad_size(p):
        return None
    q = _quad_matrix(c, p)
    cd = c[quad_cols(p)[1]]
    g = ball.eps * lin_in
    if not (np.all(np.isfinite(q)) and np.all(np.isfinite(g))):
        return None
    lam, vecs = np.linalg.eigh(q)
    fro = float(np.sqrt(np.square(q).sum()))
    shift = float(_eig_allowance(fro, p)) - float(lam[0])
    mu = 0.0 if shift <= 0 else float(_up(np.array(shift), 2))
    box = ball.norm == "inf"
    if box:
        y = _box_minimiser(g, q, mu, float(lam[-1]) + mu)
    else:
        mu, y = _sphere_minimiser(g, lam, vecs, mu)
    total = _dual_value(g, q, mu, y, box)
    # - sum_p c_pp, rounded down
    trc = float(cd.sum())
    trc_up = trc + gamma(p) * float(np.abs(cd).sum())
    low = -total - trc_up
    low -= _REL * (abs(low) + total + abs(trc)) + TINY
    return low if np.isfinite(low) else None


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
# walks that set QUAD_EIG (the radius search's last stage, local.py), for the
# entries whose Frobenius bound is at least QUAD_EIG_SHARE of their whole size: one P x P
# eigenvalue problem per entry makes a walk ~4x slower.
QUAD_EIG: ContextVar[bool] = ContextVar("quad_eig", default=False)
QUAD_EIG_SHARE = 0.02
QUAD_EIG_BATCH = 512


def quad_two_eig(c: np.ndarray, p: int) -> np.ndarray:
    """On the 2-ball, >= |sum c_pq sigma_pq| for coefficient rows c (n, P(P+1)/2), from the
    quadratic form's extreme eigenvalues: the sum is z^T Q z - tr (z = d / eps, |z| <= 1,
    tr = sum_p c_pp), and z^T Q z lies in [min(lam_min, 0), max(lam_max, 0)], so
    |sum| <= max(|min(lam_min, 0) - tr|, |max(lam_max, 0) - tr|): at most `quad_two`'s
    ||Q||_F + |tr|, and a fraction of it where the eigenvalues spread on both sides of tr / P.
    LAPACK's eigenvalues are those of a matrix within 64 P u ||Q||_F of Q (as `input_radius`
    allows), so each end is moved out by that; the trace by gamma_P sum |c_pp|."""
    diag = quad_cols(p)[1]
    out = np.empty(c.shape[0])
    for s0 in range(0, c.shape[0], QUAD_EIG_BATCH):
        cc = c[s0:s0 + QUAD_EIG_BATCH]
        n = cc.shape[0]
        # per support (before attention mixes the tokens an entry reads one or two tokens' inputs)
        lam_lo, lam_hi = extreme_eigs(_quad_upper(cc, p), "U")
        err = _eig_allowance(_quad_fro(cc, p), p)
        cd = cc[:, diag]
        tr = cd.sum(axis=1)
        tr_err = gamma(p) * np.abs(cd).sum(axis=1)
        lo = np.minimum(lam_lo - err, 0.0) - tr
        hi = np.maximum(lam_hi + err, 0.0) - tr
        out[s0:s0 + n] = _up(np.maximum(np.abs(lo), np.abs(hi)) + tr_err, 4)
    return out


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
