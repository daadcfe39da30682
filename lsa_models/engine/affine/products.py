"""The affine forms' products of two forms (Mul, MatMul): the linear parts' cross terms as
an exact quadratic form, pair symbols or a rank-one bound, each the narrowest it can be;
derivations in docs/local-affine.md, "Affine value forms"."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from lsa_models.bounds.numerics import U
from lsa_models.engine.affine.form import (
    _REL,
    GROUPS,
    PAIRS,
    QUAD,
    TINY,
    Aff,
    NotAffine,
    _cols,
    _split_lin,
    _up,
    _width,
    dev,
    extreme_eigs,
    fresh,
    fresh_fill,
    input_radius,
    lin,
    quad_cols,
    reference,
    split_lin,
    symbol_radius,
    triu_pack_sym,
)
from lsa_models.engine.values import Ball, gamma

# --- products of two forms ---

# the exact quadratic form of a MatMul's two linear parts is formed while it holds at most
# this many entries (output entries x P^2), else its terms are bounded one by one
MAX_QUAD_ENTRIES = 8_000_000


def _quadratic(ux: np.ndarray, uy: np.ndarray, ball: Ball, bound: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray] | None:
    """An enclosure of sum_j (ux_ij . d)(uy_jk . d) over the ball for every (i, k): d^T M d
    with M = sum_j ux_ij uy_jk^T (P x P). inf-ball: the diagonal's terms are one-sided
    (d_p^2 in [0, eps^2]), the rest bounded by sum |M_pq| eps^2; 2-ball: the extreme
    eigenvalues of M's symmetric part times eps^2 (LAPACK's are exact for a matrix within
    c P u ||M||_F of it: Weyl's inequality, the slack added). `bound` (the terms' product
    bound, sum_j li_x li_y) scales the rounding of M's sums."""
    p = ux.shape[-1]
    n_out = int(np.prod(np.broadcast_shapes(ux.shape[:-3], uy.shape[:-3]))) * \
        ux.shape[-3] * uy.shape[-2]
    if n_out * p * p > MAX_QUAD_ENTRIES:
        return None
    m = np.einsum("...ijp,...jkq->...ikpq", ux, uy)
    e2 = ball.eps * ball.eps
    k = ux.shape[-2]
    if ball.norm == "inf":
        diag = np.diagonal(m, axis1=-2, axis2=-1)  # (..., i, k, P)
        off = np.maximum(np.abs(m).sum(axis=(-2, -1)) - np.abs(diag).sum(axis=-1), 0.0)
        off = _up(off, p * p + 2)
        lo = e2 * (np.minimum(diag, 0.0).sum(axis=-1) - off)
        hi = e2 * (np.maximum(diag, 0.0).sum(axis=-1) + off)
        slack = _REL * (np.abs(lo) + np.abs(hi)) + gamma(k + p * p) * bound
    else:
        sym = 0.5 * (m + np.swapaxes(m, -1, -2))
        # per support: the first attention's q k^T entries read two tokens' inputs
        w_lo, w_hi = extreme_eigs(sym.reshape(-1, p, p))
        fro = np.sqrt(np.square(sym).sum(axis=(-2, -1)))
        lo = e2 * np.minimum(w_lo.reshape(sym.shape[:-2]), 0.0)
        hi = e2 * np.maximum(w_hi.reshape(sym.shape[:-2]), 0.0)
        slack = e2 * 64 * p * U * fro + gamma(k + p) * bound + _REL * (np.abs(lo) + np.abs(hi))
    return lo - slack - TINY, hi + slack + TINY


def _quad_matrix(ux: np.ndarray, uy: np.ndarray, matmul: bool) -> np.ndarray | None:
    """M with (u_x . d)(u_y . d) summed = d^T M d per output entry, (*out, P, P): MatMul
    sum_j ux_ij uy_jk^T, elementwise ux uy^T (broadcast); None past MAX_QUAD_ENTRIES."""
    p = ux.shape[-1]
    if matmul:
        n_out = int(np.prod(np.broadcast_shapes(ux.shape[:-3], uy.shape[:-3]))) * \
            ux.shape[-3] * uy.shape[-2]
    else:
        n_out = int(np.prod(np.broadcast_shapes(ux.shape[:-1], uy.shape[:-1])))
    if n_out * p * p > MAX_QUAD_ENTRIES:
        return None
    if matmul:
        return np.einsum("...ijp,...jkq->...ikpq", ux, uy)
    return ux[..., :, None] * uy[..., None, :]


def _to_quad(m: np.ndarray, ball: Ball, bound: np.ndarray, k: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """d^T M d on the second-order symbols (affine.QUAD): the coefficients (*out, P(P+1)/2),
    the offset eps^2 / 2 tr M and the error: M's own rounding (each entry a sum of k products,
    within gamma_k of sum_j |ux_jp| |uy_jq|, whose eps^2-weighted sum over p, q is `bound` =
    sum_j li_x li_y) plus 1e-12 of the coefficients' and offset's magnitudes (the scalings)."""
    p = m.shape[-1]
    e2 = ball.eps * ball.eps
    diag = quad_cols(p)[1]
    coef = triu_pack_sym(m)  # (M_pq + M_qp) for p <= q; the diagonal holds 2 M_pp
    coef *= e2  # p < q: eps^2 (M_pq + M_qp)
    coef[..., diag] *= 0.25  # p = q: eps^2 M_pp / 2 = (eps^2 2 M_pp) / 4
    off = 0.5 * e2 * np.trace(m, axis1=-2, axis2=-1)
    err = gamma(k + 2) * bound + _REL * (np.abs(off) + np.abs(coef).sum(axis=-1))
    return coef, off, _up(err, p * p + 2)


def _put_quad(a: np.ndarray, o: np.ndarray, m: np.ndarray, base: int, ball: Ball,
              bound: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """d^T M d added to the form's linear part a (on the second-order symbols from column
    `base`) and offset o (`_to_quad`); returns them and the error: M's rounding and one
    rounding of every summed coefficient (1e-12 of their sizes, far above u)."""
    coef, off, err = _to_quad(m, ball, bound, k)
    t = coef.shape[-1]
    a = _cols(a, base + t)
    a[..., base:base + t] += coef
    return a, o + off, err + _REL * np.abs(a[..., base:base + t]).sum(axis=-1)


def _cross_budget(x: Aff, y: Aff, lix: np.ndarray, liy: np.ndarray, lsx: np.ndarray,
                  lsy: np.ndarray, ball: Ball, matmul: bool) -> float:
    """>= the sum over a product's entries of |Ix Sy + Sx Iy + Sx Sy| (I the input parts, S
    the noise symbols' parts; |I| <= li, |S| <= ls entrywise): each of the three terms the
    smaller of its entries' sizes summed (what the box pays) and Cauchy-Schwarz over the
    whole (broadcast) tensors with ||I||_F <= `_input_norm` and ||S||_F <= `_symbol_norm`.
    Elementwise: sum_i |Ix_i Sy_i| <= ||Ix|| ||Sy||. MatMul (n, k) @ (k, m):
    sum_ij |sum_k Ix_ik Sy_kj| <= sum_ik |Ix_ik| c_k (c_k = sum_j ls_y,kj) <= sqrt(n) ||c||
    ||Ix||, and <= sum_ij ||Ix_i:|| ||Sy_:j|| <= sqrt(n m) ||Ix|| ||Sy||; likewise the others;
    batches by Cauchy-Schwarz once more.

    The whole-tensor `_symbol_norm` (a Gram matrix's eigenvalues) is formed only where it can
    change the result, with the same numbers: `_symbol_low` gives lo <= the float it would
    return, and a product of nonnegative floats is monotone in each factor when rounded, so
    fl(fl(c sx) sy) >= fl(fl(c lo_x) lo_y); where that is already >= the term's cheap
    entries, the min of them all is the min of the cheap ones (a float min's value does not
    depend on which of equal entries it picks) and the norm is not read. The cheaper norm
    is formed first where a term needs it, and the other's need judged with it."""
    if matmul:
        batch = np.broadcast_shapes(x.c.shape[:-2], y.c.shape[:-2])
        xs = (*batch, *x.c.shape[-2:])
        ys = (*batch, *y.c.shape[-2:])
    else:
        xs = ys = np.broadcast_shapes(x.c.shape, y.c.shape)
    bx, by = np.broadcast_to(lsx, xs), np.broadcast_to(lsy, ys)
    ix, iy = _input_norm(x, xs, ball), _input_norm(y, ys, ball)
    lox, sx_ = _symbol_low(x, xs, bx, ball)
    loy, sy_ = _symbol_low(y, ys, by, ball)
    if matmul:
        n, m = xs[-2], ys[-1]
        c = math.sqrt(n * m)
        cheap1 = min(float((lix @ lsy).sum()), math.sqrt(n) * _norm2(by.sum(axis=-1)) * ix)
        cheap2 = min(float((lsx @ liy).sum()), math.sqrt(m) * _norm2(bx.sum(axis=-2)) * iy)
        cheap3 = float((bx @ by).sum())
    else:
        c = 1.0
        cheap1 = float((lix * lsy).sum())
        cheap2 = float((lsx * liy).sum())
        cheap3 = float((bx * by).sum())
    sx, sy = lox, loy

    def needs() -> tuple[bool, bool, bool]:
        # the products below with the bounds at hand (lower bounds or the norms)
        return (not c * ix * sy >= cheap1, not c * sx * iy >= cheap2,
                not c * sx * sy >= cheap3)
    x_first = _gram_cost(x) <= _gram_cost(y)
    for x_turn in (x_first, not x_first):  # the cheaper norm first, the other seen with it
        need1, need2, need3 = needs()
        if x_turn and (need2 or need3):
            sx = sx_()
        elif not x_turn and (need1 or need3):
            sy = sy_()
    # a term still needed had its norms formed at their turns (at a turn the other factor
    # was at most its final value, so the check was no easier than now)
    need1, need2, need3 = needs()
    # elementwise c = 1: fl(1 u) = u, the products Cauchy-Schwarz gives there
    t1 = min(cheap1, c * ix * sy) if need1 else cheap1
    t2 = min(cheap2, c * sx * iy) if need2 else cheap2
    t3 = min(cheap3, c * sx * sy) if need3 else cheap3
    return _up(np.asarray(t1 + t2 + t3), 4).item() * (1 + 1e-10)


def _gram_cost(f: Aff) -> int:
    """The size of the whole-tensor symbol norm's work for f: rows x columns x the smaller."""
    d, q = int(np.prod(f.a.shape[:-1])), f.a.shape[-1]
    return d * q * min(d, q)


def _norm2(v: np.ndarray) -> float:
    """>= the Frobenius norm of v."""
    return float(np.sqrt(_up(np.square(v).sum(), v.size + 2))) * (1 + 4 * U)


def _copies(v: float, f: Aff, shape: tuple[int, ...]) -> float:
    """v, a Frobenius-norm bound of f's own entries, for f broadcast to `shape` (rounded up):
    broadcasting repeats every entry the same k = |shape| / |f| times, so a broadcast
    tensor's Frobenius norm is sqrt(k) times its own at every point (and so is its sup over
    the ball and the symbols: the bounds are taken on f's own rows and scaled, not on k
    copies of them)."""
    k = int(np.prod(shape)) // max(1, int(np.prod(f.a.shape[:-1])))
    scale = 1.0 if k <= 1 else math.sqrt(k) * (1 + 4 * U)
    return _up(np.asarray(v * scale), 2).item()


def _input_norm(f: Aff, shape: tuple[int, ...], ball: Ball) -> float:
    """>= sup ||I(X)||_F over the ball for f's input part broadcast to `shape`
    (`affine.input_radius` of all its own rows as one block, times `_copies`)."""
    p = ball.size
    return _copies(float(input_radius(f.a[..., :p].reshape(1, -1, p), ball)[0]), f, shape)


def _symbol_norm(f: Aff, shape: tuple[int, ...], ls: np.ndarray, ball: Ball) -> float:
    """>= sup ||S||_F for f's symbols' part broadcast to `shape`: the smaller of the root
    sum of the entries' sizes `ls` and `affine.symbol_radius` of the whole tensor as one
    block (f's own rows, times `_copies`)."""
    whole = float(symbol_radius(f.a.reshape(1, -1, f.a.shape[-1]), ball)[0])
    return min(_norm2(ls), _copies(whole, f, shape))


def _symbol_low(f: Aff, shape: tuple[int, ...], ls: np.ndarray, ball: Ball
                ) -> tuple[float, Callable[[], float]]:
    """lo <= `_symbol_norm`(f, shape, ls, ball) without its Gram matrix, and what computes
    that norm (the same float; the Gram skipped where lo shows the min is the root sum).
    lo = min(_norm2(ls), _copies(w)) with w <= ||A e||_2 for one e that is 0 on the groups'
    and the second-order symbols' columns and +-1 on the others: `symbol_radius` bounds the
    sup over a set holding every such e (the box on those columns; its second-order and
    group parts add nonnegative terms or take the min with the box), so w <= the float it
    returns, and `_copies` and min are monotone."""
    cheap = _norm2(ls)
    w = _sign_low(f.a.reshape(-1, f.a.shape[-1]), ball)
    lo = min(cheap, _copies(w, f, shape))
    if lo >= cheap:  # the whole tensor's norm is >= the root sum: the min is the latter
        return lo, lambda: cheap
    return lo, lambda: _symbol_norm(f, shape, ls, ball)


# sign steps of `_sign_low`'s ascent (each two products with the (D, |F|) block)
SIGN_STEPS = 4


def _sign_low(a: np.ndarray, ball: Ball) -> float:
    """<= max ||A_F e||_2 over a few sign vectors e (e_q = sign((A_F^T y)_q), y the rows' l1
    sizes, then y = A_F e) on the free symbol columns F (P on, not a group's, not a
    second-order symbol's): the computed A e is within
    gamma_|F| r_i of the true one per row and its norm within gamma_(D+2) (Higham), both far
    below the 1e-9 taken off while |F| + D < 1e6 (else 0)."""
    p, q = ball.size, a.shape[-1]
    free = np.zeros(q, dtype=bool)
    free[p:] = True
    base = QUAD.get()
    if base is not None:
        free[base:base + ball.size * (ball.size + 1) // 2] = False
    for g0, g1, _ in GROUPS.get() or []:
        free[g0:g1] = False
    if not np.any(free) or int(free.sum()) + a.shape[0] >= 1_000_000:
        return 0.0
    af = a[:, free]
    r = np.abs(af).sum(axis=-1)
    y = r
    best = 0.0
    for _ in range(SIGN_STEPS):  # ascent: ||A e'|| >= <A e, A e'> / ||A e|| >= ||A e||
        y = af @ np.sign(af.T @ y)
        best = max(best, float(np.sqrt(np.square(y).sum())))
    lo = best * (1 - 1e-9) - 1e-9 * float(np.sqrt(np.square(r).sum()))
    return lo if math.isfinite(lo) and lo > 0.0 else 0.0


# entries of one block of the row-blocked helpers below (as affine.ABS_SUM_BLOCK: ~2 MB)
_BLOCK = 1 << 18


def _lin_of_sum(u: np.ndarray, v: np.ndarray, n: int, sub: bool, ball: Ball) -> np.ndarray:
    """`lin` of the coefficients u + v (`sub`: u - v, `_sum_cols`) for entries without a box
    or offset, a block of rows at a time (`lin` is a function of each row alone: the sum is
    never held whole)."""
    shape = np.broadcast_shapes(u.shape[:-1], v.shape[:-1])
    if reference() or u.shape[:-1] != shape or v.shape[:-1] != shape:
        c = np.zeros(shape)
        return lin(Aff(c, c, c, _sum_cols(u, v, n, sub), c), ball)
    rows = int(np.prod(shape))
    uf, vf = u.reshape(rows, u.shape[-1]), v.reshape(rows, v.shape[-1])
    out = np.empty(rows)
    step = max(1, _BLOCK // max(1, n))
    for i in range(0, rows, step):
        blk = _sum_cols(uf[i:i + step], vf[i:i + step], n, sub)
        z = np.zeros(blk.shape[0])
        li, ls = _split_lin(Aff(z, z, z, blk, z), ball)  # not memoised: a temporary
        out[i:i + step] = _up(li + ls, 2)  # as `lin`
    return out.reshape(shape)


def _rank_one(x: Aff, y: Aff, ball: Ball, lx: np.ndarray, ly: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """An enclosure of Lx Ly = (ax . z)(ay . z) over the ball and the symbols, entrywise
    (broadcast; z = (d, e)): it is ((ax + ay) . z)^2 / 4 - ((ax - ay) . z)^2 / 4, so within
    [-lin(ax - ay)^2 / 4, lin(ax + ay)^2 / 4], and within +-lin(ax) lin(ay)."""
    n = _width(x, y)
    sp = _lin_of_sum(x.a, y.a, n, False, ball)
    sm = _lin_of_sum(x.a, y.a, n, True, ball)
    ii = np.broadcast_to(lx * ly, sp.shape)
    lo = np.maximum(-_up(0.25 * sm * sm, 2), -ii)
    hi = np.minimum(_up(0.25 * sp * sp, 2), ii)
    return lo, hi


def _pairs(x: Aff, y: Aff, ball: Ball, matmul: bool) -> np.ndarray | None:
    """The bilinear part (u_x . d)(v_y . s) + (v_x . s)(u_y . d) of Lx Ly as coefficients of
    the pair symbols psi_pq = d_p s_q / eps (affine.PAIRS), (*out, P, P); None when pairs are
    off or neither operand depends on the direction s."""
    spec = PAIRS.get()
    if spec is None:
        return None
    p = ball.size
    sx = x.a[..., p:2 * p] if x.a.shape[-1] > p else None
    sy = y.a[..., p:2 * p] if y.a.shape[-1] > p else None
    if (sx is None or not np.any(sx)) and (sy is None or not np.any(sy)):
        return None
    sx = np.zeros(x.a.shape[:-1] + (p,)) if sx is None or sx.shape[-1] < p else sx
    sy = np.zeros(y.a.shape[:-1] + (p,)) if sy is None or sy.shape[-1] < p else sy
    ux, uy = x.a[..., :p], y.a[..., :p]
    if matmul:
        out = np.einsum("...ijp,...jkq->...ikpq", ux, sy) + \
            np.einsum("...jkp,...ijq->...ikpq", uy, sx)
    else:
        out = ux[..., :, None] * sy[..., None, :] + uy[..., :, None] * sx[..., None, :]
    return out * ball.eps


def _with_pairs(x: Aff, y: Aff, ball: Ball, matmul: bool, a: np.ndarray, pairs: np.ndarray,
                quad: tuple[np.ndarray, np.ndarray] | None,
                mul: Callable[[np.ndarray, np.ndarray], np.ndarray]
                ) -> tuple[np.ndarray, np.ndarray]:
    """Lx Ly with the pair symbols: with Lx = u_x . d + v_x . s + r_x . e (input, direction,
    the other symbols), Lx Ly - pairs = (u_x . d)(u_y . d) + (v_x . s)(v_y . s)
    + (u_x . d + v_x . s)(r_y . e) + (r_x . e) Ly, the first by the quadratic form (MatMul) or
    the identity of `_rank_one` on the input parts, the rest by their sizes. Returns the
    linear part with the pairs' coefficients added and the rest's half width."""
    p = ball.size
    base = PAIRS.get()[1]  # type: ignore[index]

    def sizes(f: Aff) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        li = _up(ball.eps * np.abs(f.a[..., :p]).sum(axis=-1), p + 2)
        ls = _up(np.abs(f.a[..., p:2 * p]).sum(axis=-1), p + 2)
        lr = _up(np.abs(f.a[..., 2 * p:]).sum(axis=-1), f.a.shape[-1] + 2)
        return li, ls, lr
    lix, lsx, lrx = sizes(x)
    liy, lsy, lry = sizes(y)
    if quad is None:
        if matmul:
            ii = mul(lix, liy)
            quad = (-ii, ii)
        else:
            ux, uy = np.broadcast_arrays(x.a[..., :p], y.a[..., :p])
            sp = _up(ball.eps * np.abs(ux + uy).sum(axis=-1), p + 2)
            sm = _up(ball.eps * np.abs(ux - uy).sum(axis=-1), p + 2)
            ii = np.broadcast_to(lix * liy, sp.shape)
            quad = (np.maximum(-_up(0.25 * sm * sm, 2), -ii),
                    np.minimum(_up(0.25 * sp * sp, 2), ii))
    qhw = np.maximum(np.abs(quad[0]), np.abs(quad[1]))  # symmetric: no offset kept
    err = qhw + mul(lsx, lsy) + mul(lix + lsx, lry) + mul(lrx, liy + lsy + lry)
    # the pairs' own rounding: each coefficient a sum of (MatMul: 2k) products times eps,
    # within gamma of the sum of their sizes, sum_pq eps |u_p| |v_q| = (eps |u|_1) |v|_1
    k = x.c.shape[-1] if matmul else 1
    err = err + gamma(2 * k + 3) * (mul(lix, lsy) + mul(lsx, liy))
    w = max(a.shape[-1], base + p * p)
    out = np.zeros(a.shape[:-1] + (w,))
    out[..., :a.shape[-1]] = a
    out[..., base:base + p * p] += pairs.reshape(pairs.shape[:-2] + (p * p,))
    return out, _up(err, 4)


def _sum_cols(u: np.ndarray, v: np.ndarray, n: int, sub: bool = False) -> np.ndarray:
    """_cols(u, n) + _cols(v, n) (broadcast; `sub`: u - v) into one new array: the columns
    both hold summed, the others copied (negated), the rest 0 (the same numbers without the
    widened copies)."""
    if reference():
        return _cols(u, n) - _cols(v, n) if sub else _cols(u, n) + _cols(v, n)
    out = np.empty((*np.broadcast_shapes(u.shape[:-1], v.shape[:-1]), n))
    _sum_into(u, v, out, sub)
    return out


def _sum_into(u: np.ndarray, v: np.ndarray, out: np.ndarray, sub: bool = False) -> None:
    """`_sum_cols` written into out (..., n)."""
    nu, nv = u.shape[-1], v.shape[-1]
    lo, hi = min(nu, nv), max(nu, nv)
    (np.subtract if sub else np.add)(u[..., :lo], v[..., :lo], out=out[..., :lo])
    if nu > nv:
        out[..., lo:hi] = u[..., lo:]
    elif sub:
        # negated into a new array, then copied: numpy 2.4's np.negative from a strided input
        # into a strided `out` view writes wrong entries (negation is exact: the same floats)
        out[..., lo:hi] = -v[..., lo:]
    else:
        out[..., lo:hi] = v[..., lo:]
    out[..., hi:] = 0.0


def _product_coefficients(x: Aff, y: Aff, wx: np.ndarray, wy: np.ndarray, matmul: bool
                          ) -> Callable[[np.ndarray], None]:
    """What writes the product's linear part wx Dy + Dx wy (`product`) into an array of the
    output's shape (*S, n >= both widths): MatMul as two BLAS products, elementwise as
    Dx wy then wx Dy added in place (a sum is the same either way round)."""
    def fill_matmul(out: np.ndarray) -> None:
        if reference():
            n = out.shape[-1]
            ay, ax = np.moveaxis(_cols(y.a, n), -1, 0), np.moveaxis(_cols(x.a, n), -1, 0)
            out[...] = np.moveaxis(np.matmul(wx, ay) + np.matmul(ax, wy), 0, -1)
            return
        ay = np.moveaxis(y.a, -1, 0)  # (P, ..., j, k)
        ax = np.moveaxis(x.a, -1, 0)  # (P, ..., i, j)
        _sum_into(np.moveaxis(np.matmul(wx, ay), 0, -1),
                  np.moveaxis(np.matmul(ax, wy), 0, -1), out)

    def fill_mul(out: np.ndarray) -> None:
        if reference():
            n = out.shape[-1]
            out[...] = wx[..., None] * _cols(y.a, n) + _cols(x.a, n) * wy[..., None]
            return
        nx, ny = x.a.shape[-1], y.a.shape[-1]
        np.multiply(x.a, wy[..., None], out=out[..., :nx])
        out[..., nx:] = 0.0
        out[..., :ny] += wx[..., None] * y.a
    return fill_matmul if matmul else fill_mul


def product(x: Aff, y: Aff, ball: Ball, matmul: bool, out_c: np.ndarray | None = None,
            out_m: np.ndarray | None = None) -> Aff:
    """x * y (broadcast) or x @ y. With x = x0 + Dx, x0 = cx + ex (|ex| <= mx) and
    Dx = ox + Lx + bx (Lx = ax z its linear part, |bx| <= its box):
      x y - x0 y0 = cx Dy + Dx cy + ex Dy + Dx ey + Dx Dy,
      Dx Dy = ox oy + ox Ly + Lx oy + Lx Ly + bx Dy + (ox + Lx) by.
    The linear terms stay linear; Lx Ly is the quadratic form of the input parts (MatMul:
    `_quadratic`) plus the products of the symbol parts' sizes; the rest goes to the box."""
    mul: Callable[[np.ndarray, np.ndarray], np.ndarray] = np.matmul if matmul else np.multiply
    if matmul and (x.c.ndim < 2 or y.c.ndim < 2):
        raise NotAffine("MatMul of a vector")
    ycx = y.c  # what x's change multiplies
    if matmul and x.stochastic:
        # sum_j Dx_ij = 0 for the true values, so Dx @ y0 = Dx @ (y0 - mu) for any row mu:
        # the middle of every column of y's centre
        ycx = y.c - 0.5 * (y.c.max(axis=-2, keepdims=True) + y.c.min(axis=-2, keepdims=True))
    lix, lsx = split_lin(x, ball)
    liy, lsy = split_lin(y, ball)
    lx, ly = _up(lix + lsx, 2), _up(liy + lsy, 2)  # lin(x), lin(y)
    dxlo, dxhi = dev(x, ball)
    dylo, dyhi = dev(y, ball)
    fx = np.maximum(np.abs(dxlo), np.abs(dxhi))
    fy = np.maximum(np.abs(dylo), np.abs(dyhi))
    n = _width(x, y)
    wx, wy = x.c + x.o, ycx + y.o  # what the other's linear part multiplies
    fill = _product_coefficients(x, y, wx, wy, matmul)
    k = x.c.shape[-1] if matmul else 2
    o = mul(x.c, y.o) + mul(x.o, ycx) + mul(x.o, y.o)
    a: np.ndarray | None = None  # made here where a rule below reads it, else in `fresh`

    def made() -> np.ndarray:
        shape = o.shape if matmul else np.broadcast_shapes(x.a.shape[:-1], y.a.shape[:-1])
        out = np.empty((*shape, n))
        fill(out)
        return out
    acx, acy = np.abs(x.c), np.abs(ycx)
    aox, aoy = np.abs(x.o), np.abs(y.o)
    g = gamma(k + 3)
    quad = None
    budget: float | None = None
    pp = ball.size
    qbase = QUAD.get()
    qm = None if qbase is None else _quad_matrix(x.a[..., :pp], y.a[..., :pp], matmul)
    if qm is None and matmul:
        quad = _quadratic(x.a[..., :pp], y.a[..., :pp], ball, mul(lix, liy))
    pairs = _pairs(x, y, ball, matmul)
    if pairs is not None:
        # the bilinear (d, s) part on the pair symbols; the (d, d) part on the second-order
        # symbols where they are on (its bound then 0 in the rest), else bounded there
        zq = None if qm is None else (np.zeros(qm.shape[:-2]), np.zeros(qm.shape[:-2]))
        a, err = _with_pairs(x, y, ball, matmul, made(), pairs, quad if zq is None else zq,
                             mul)
        qmid = np.zeros_like(err)
        if qm is not None and qbase is not None:
            a, o, qerr = _put_quad(a, o, qm, qbase, ball, mul(lix, liy), k)
            err = err + qerr
    elif qm is not None and qbase is not None:
        # the input parts' product on the second-order symbols (affine.QUAD); the rest of
        # Lx Ly (input part x the symbols', symbols' x symbols') by their sizes
        a, o, qerr = _put_quad(made(), o, qm, qbase, ball, mul(lix, liy), k)
        qmid = np.zeros_like(qerr)
        err = qerr + mul(lix, lsy) + mul(lsx, liy) + mul(lsx, lsy)
        if GROUPS.get() is not None:
            budget = float(qerr.sum()) + _cross_budget(x, y, lix, liy, lsx, lsy, ball, matmul)
    elif quad is None and not matmul:  # the whole linear parts, symbols included
        lo, hi = _rank_one(x, y, ball, lx, ly)
        qmid = 0.5 * (lo + hi)
        err = 0.5 * (hi - lo) + _REL * np.abs(qmid)
    else:
        if quad is None:
            ii = mul(lix, liy)
            quad = (-ii, ii)
        qmid = 0.5 * (quad[0] + quad[1])
        err = 0.5 * (quad[1] - quad[0]) + _REL * np.abs(qmid) + \
            mul(lix, lsy) + mul(lsx, liy) + mul(lsx, lsy)
    o = o + qmid
    b = mul(acx, y.b) + mul(x.b, acy) + mul(x.m, fy) + mul(fx, y.m) + \
        mul(x.b, aoy + ly + y.b) + mul(aox + lx, y.b)
    # rounding of the products and sums forming o and a (a's change over the ball <= its
    # entries' error times the ball, as for lin)
    b = b + g * (mul(acx + aox, ly) + mul(lx, acy + aoy) + mul(acx, aoy) + mul(aox, acy)
                 + mul(aox, aoy)) + g * np.abs(o)
    b = _up(b, k + 4)
    # Lx Ly: a symbol per output entry
    if a is None:
        a, b = fresh_fill(fill, n, b, _up(err, k + 4), budget)
    else:
        a, b = fresh(a, b, _up(err, k + 4), budget)
    if out_c is None:
        out_c = mul(x.c, y.c)
        out_m = _up(mul(acx, y.m) + mul(x.m, np.abs(y.c)) + mul(x.m, y.m)
                    + g * mul(acx, np.abs(y.c)),
                    k + 4) + TINY
    assert out_m is not None
    return Aff(out_c, out_m, o, a, b)
