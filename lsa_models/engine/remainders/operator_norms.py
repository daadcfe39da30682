"""Operator-norm remainders for the 2-ball (docs/local-second-order.md, "Operator-norm
telescoping").

The telescoped remainder of the output's Jacobian is a sum of terms
`T_k = G_k (D_k(X) - D_k(X0)) J_in_k(X)` (remainders/telescope.py). The entrywise bounds take
absolute values of G_k, of the change of D_k and of J_in_k, which in the 2-norm costs up to the
square root of the dimensions (for a random n x m matrix W, || |W| ||_2 is about sqrt(nm)/(sqrt n +
sqrt m) times ||W||_2). Here each term is bounded in the operator 2-norm instead,
    ||T_k||_2 <= ||G_k B_k||_2 * ||C_k||_2 * sup ||J_in_k(X)||_2,
with the op's Jacobian change factored as B_k C_k where B_k is a diagonal or block-diagonal
scaling whose blocks are known in norm. The signs of the adjoint G_k are kept.

A rule attaches `fn` as `OpRemainder.opnorm` (values.py), next to the term it bounds:
`fn(G)` bounds sup ||G (D(X) - D(X0)) J_in(X)||_2 over the ball for the signed adjoint G
(K, *S). A rule that replaces a value's term builds a new OpRemainder, without it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import numpy as np

from lsa_models.bounds.numerics import U, add_up, frobenius_upper, mul_up, spectral_norm_upper
from lsa_models.engine.values import Ball, LocalValue, center_margin, gamma, widen_up

OpNorm = Callable[[np.ndarray], float]


def jacobian_norm(jc: np.ndarray, jr: np.ndarray, known: float | None = None
                  ) -> Callable[[], float]:
    """A lazily computed bound on sup ||J(X)||_2 for J(X) in jc +- jr entrywise:
    ||jc||_2 + ||jr||_2 (|E| <= jr entrywise gives ||E||_2 <= ||jr||_2), or `known` (the
    value's telescoped `jnorm`) when smaller."""
    cache: list[float] = []

    def get() -> float:
        if not cache:
            p = jc.shape[-1]
            plain = add_up(spectral_norm_upper(jc.reshape(-1, p)),
                           spectral_norm_upper(jr.reshape(-1, p)))
            cache.append(plain if known is None else min(plain, known))
        return cache[0]
    return get


def rows_norm(g: np.ndarray) -> float:
    """||G||_2 of the adjoint, reshaped (K, n), certified."""
    return spectral_norm_upper(g.reshape(g.shape[0], -1)) * (1 + 4 * U)


def nonneg_block_norms(blocks: np.ndarray) -> np.ndarray:
    """Upper bounds on ||A||_2 of nonnegative square blocks (..., n, n): the smaller of the
    Frobenius norm and sqrt(||A||_1 ||A||_inf) (Hoelder), rounded up."""
    n = blocks.shape[-1]
    fro = np.sqrt(widen_up(np.square(blocks).sum(axis=(-1, -2)), n * n))
    one = widen_up(blocks.sum(axis=-2).max(axis=-1), n)
    inf = widen_up(blocks.sum(axis=-1).max(axis=-1), n)
    return np.minimum(fro, np.sqrt(widen_up(one * inf, 1))) * (1 + 4 * U)


def sigma_max_upper(jc: np.ndarray) -> np.ndarray:
    """Certified upper bounds on the largest singular value of each matrix of a batch
    (T, m, p), from the smaller Gram matrix: LAPACK's top eigenvalue plus its backward error
    64 k u |lam| and the Gram's forming error gamma_inner ||jc||_F^2 (Weyl, as
    numerics._eigvalsh_upper), capped by the Frobenius norm."""
    _, m, p = jc.shape
    fro = widen_up(np.square(jc).sum(axis=(1, 2)), m * p)
    k = min(m, p)
    gram = jc @ jc.transpose(0, 2, 1) if m <= p else jc.transpose(0, 2, 1) @ jc
    lam = np.linalg.eigvalsh(gram)[:, -1]
    lam_up = widen_up(np.maximum(lam, 0.0) + 64 * k * U * np.abs(lam)
                      + gamma(max(m, p)) * fro, 4)
    return np.minimum(np.sqrt(lam_up), np.sqrt(fro)) * (1 + 4 * U)


def group_radius(v: LocalValue, ball: Ball, axes: int) -> np.ndarray:
    """For the groups formed by the last `axes` axes of v (a token: 1; a matrix: 2): an upper
    bound on the Frobenius norm ||v_S(X) - v_S(X0)||_F of each group over the 2-ball, for the
    true X0 (..., ): eps (sigma_max(jc_S) + ||jr_S||_F) by the mean value form, the smaller
    of it and ||rad_S||_F from the entrywise box, plus twice the centre's margin (the box and
    the form are both around the computed centre)."""
    shape = v.shape
    lead = shape[:len(shape) - axes]
    m = int(np.prod(shape[len(shape) - axes:]))
    p = v.jc.shape[-1]
    if not (np.all(np.isfinite(v.jc)) and np.all(np.isfinite(v.jr))):
        return np.full(lead, np.inf)
    jc = v.jc.reshape(-1, m, p)
    jr = v.jr.reshape(-1, m, p)
    sig = sigma_max_upper(jc)
    jrf = np.sqrt(widen_up(np.square(jr).sum(axis=(1, 2)), m * p)) * (1 + 4 * U)
    form = widen_up(ball.eps * (sig + jrf), 4)
    box = np.sqrt(widen_up(np.square(v.rad.reshape(-1, m)).sum(axis=1), m)) * (1 + 4 * U)
    mg = center_margin(v.center).reshape(-1, m)
    mn = np.sqrt(widen_up(np.square(mg).sum(axis=1), m)) * (1 + 4 * U)
    best = np.minimum(form, box)
    if v.tok_true is not None and v.tok_true.size * shape[-1] == v.center.size:
        # the tokens' (last axis rows') telescoped radii (telescope.Telescope.tighten): the group's
        # Frobenius change is the root sum of its rows' squared changes
        t = v.tok_true.reshape(-1, m // shape[-1])
        best = np.minimum(best, np.sqrt(widen_up(np.square(t).sum(axis=1), t.shape[1]))
                          * (1 + 4 * U))
    return widen_up(best + 2 * mn, 2).reshape(lead)


def elementwise(g_scale: np.ndarray, jc_in: np.ndarray, jr_in: np.ndarray,
                known: float | None = None, curv: np.ndarray | None = None,
                eps: float = 0.0) -> OpNorm:
    """y = f(x) entrywise with |f'(x(X)) - f'(x(X0))| <= s (g_scale, x's shape):
    G diag(delta) = G diag(s) diag(delta / s) and ||diag(delta / s)||_2 <= 1, so
    ||G diag(delta) J_x(X)||_2 <= ||G diag(s)||_2 sup ||J_x||_2.
    With `curv` (kappa >= |f''| between x(X0) and x(X), entrywise) on a 2-ball of radius eps:
    |delta_b| <= kappa_b |x_b(X) - x_b(X0)| and ||x(X) - x(X0)||_2 <= eps sup ||J_x||_2, so
    ||G diag(delta)||_2 <= ||G diag(delta)||_F <= max_b (||G_:b||_2 kappa_b) eps sup ||J_x||
    (the relational form: the entries of x cannot all reach their box ends at once)."""
    ln = jacobian_norm(jc_in, jr_in, known)
    s = g_scale.reshape(-1)
    kap = None if curv is None else curv.reshape(-1)

    def fn(g: np.ndarray) -> float:
        g2 = g.reshape(g.shape[0], -1)
        gs = g2 * s
        box = mul_up(spectral_norm_upper(gs) * (1 + 4 * U), ln()) \
            if np.all(np.isfinite(gs)) else math.inf
        if kap is None or not np.all(np.isfinite(kap)):
            return box
        cols = np.sqrt(widen_up(np.square(g2).sum(axis=0), g2.shape[0])) * (1 + 4 * U)
        peak = float(np.max(cols * kap)) * (1 + 4 * U)
        return min(box, mul_up(peak, eps, ln(), ln()))
    return fn


def blockwise(block_bound: float, jc_in: np.ndarray, jr_in: np.ndarray,
              scale: np.ndarray | None = None, known: float | None = None,
              blocks: np.ndarray | None = None) -> OpNorm:
    """D(X) - D(X0) = diag(scale) blockdiag(E_t) with ||E_t||_2 <= block_bound for every
    block (LayerNorm per token, softmax per row: the blocks are the last axis's rows):
    ||G diag(scale) blockdiag(E)||_2 <= ||G diag(scale)||_2 max_t ||E_t||_2 (G reshaped with
    the blocks' entries as columns, a permutation of them, which keeps the norm). With
    `blocks` (one bound per block, (*S[:-1],)): G blockdiag(E) = [G_1 E_1, ..., G_T E_T] has
    norm <= sqrt(sum_t ||G_t||_2^2 ||E_t||_2^2) (||[A_1 ... A_T]||^2 <= sum ||A_t||^2),
    whichever is smaller."""
    ln = jacobian_norm(jc_in, jr_in, known)

    def fn(g: np.ndarray) -> float:
        gs = g if scale is None else g * scale
        out = mul_up(rows_norm(gs), block_bound, ln())
        if blocks is not None and blocks.size * gs.shape[-1] * gs.shape[0] == gs.size:
            k, d = gs.shape[0], gs.shape[-1]
            gt = np.moveaxis(gs.reshape(k, -1, d), 1, 0)  # (T, K, D)
            sq = np.square(sigma_max_upper(gt) * blocks.reshape(-1) * (1 + 4 * U))
            out = min(out, mul_up(math.sqrt(float(widen_up(sq.sum(), sq.size)))
                                  * (1 + 4 * U), ln()))
        return out
    return fn


def matmul(a: LocalValue | np.ndarray, b: LocalValue | np.ndarray, out_shape: tuple[int, ...],
           ball: Ball) -> OpNorm | None:
    """y = a @ b with both batch shapes equal to the output's (no broadcasting): per batch
    D(X) - D(X0) maps (da, db) to da (B(X) - B(X0)) + (A(X) - A(X0)) db, whose parts have
    norms max_b ||dB_b||_2 and max_b ||dA_b||_2 (<= the Frobenius group radii), so
    ||G (D(X) - D(X0)) J_in(X)||_2 <= ||G||_2 (max ||dB_b|| sup||J_a|| + max ||dA_b||
    sup||J_b||). None: broadcast operands (left to the entrywise term)."""
    batch = out_shape[:-2]
    parts: list[tuple[float, Callable[[], float]]] = []
    for x, other in ((a, b), (b, a)):
        if not isinstance(x, LocalValue):
            continue
        if tuple(x.shape[:-2]) != tuple(batch):
            return None
        if isinstance(other, LocalValue):
            if tuple(other.shape[:-2]) != tuple(batch):
                return None
            d_other = float(group_radius(other, ball, 2).max())
        else:
            continue  # a constant operand: no change of D through it
        parts.append((d_other, jacobian_norm(x.jc, x.jr, x.jnorm)))
    if not parts:
        return None

    def fn(g: np.ndarray) -> float:
        ng = rows_norm(g)
        total = 0.0
        for d_other, ln in parts:
            total = add_up(total, mul_up(ng, d_other, ln()))
        return total
    return fn


def set_token_radius(v: LocalValue, true: np.ndarray) -> None:
    """v.tok_true = `true` (>= ||T_t(X) - T_t(X0)||_2 per token, (*S[:-1], 1)), v.tok_rad
    the same around the computed centre (plus the centre's margin), and every entry of a
    token within its token's radius of the centre."""
    d = v.shape[-1]
    mg = center_margin(v.center).reshape(-1, d)
    mn = (np.sqrt(widen_up(np.square(mg).sum(axis=1), d)) * (1 + 4 * U)).reshape(true.shape)
    v.tok_true = true
    v.tok_rad = widen_up(true + mn, 2)
    v.lo = np.minimum(np.maximum(v.lo, v.center - v.tok_rad), v.center)
    v.hi = np.maximum(np.minimum(v.hi, v.center + v.tok_rad), v.center)


def integrated_tokens(v: LocalValue, h: LocalValue, ball: Ball) -> None:
    """Token radii by the integrated form: for X in the ball, X0 + d/2 lies in the half
    ball, so ||T_t(X) - T_t(X0)|| <= h.tok_true + ||T_t(X) - T_t(X0 + d/2)||
    <= h.tok_true + (eps/2) sup ||J_t||."""
    if v.tok_jn is None or v.tok_true is None or h.tok_true is None \
            or h.tok_true.shape != v.tok_true.shape:
        return
    cand = widen_up(h.tok_true + 0.5 * ball.eps * v.tok_jn, 2)
    set_token_radius(v, np.minimum(v.tok_true, cand))


def rows_bound(terms: list, rnd: np.ndarray, groups: list[np.ndarray], margin: float,
               plain_of: Callable[[LocalValue, np.ndarray], np.ndarray] | None = None
               ) -> np.ndarray | None:
    """Per group of rows (index arrays) of the telescoped tensor: ||rounding rows||_2 plus,
    per op, the smaller of the 2-norm of its entrywise term (the terms are row by row, so
    one evaluation serves every group) and its opnorm rule on the group's signed adjoint
    rows plus the adjoint's rounding margin (`margin` (|g| + max|g|)) through the entrywise
    term (Frobenius). A term that overflowed counts as inf; None where a group's total is
    not finite. `plain_of(u, ga)`: u.term(ga) (a caller's memo of it)."""
    out = _group_norms(rnd, groups)
    for ga, u, g in terms:
        assert u.remainder is not None
        term, op = u.remainder.term, u.remainder.opnorm
        plain = _finite(lambda: term(ga) if plain_of is None  # noqa: B023 (called at once)
                        else plain_of(u, ga))  # noqa: B023
        norms = np.full(len(groups), math.inf) if plain is None else _group_norms(plain, groups)
        live = op is not None
        err = _finite(lambda: term(margin * (np.abs(g) + float(np.abs(g).max())))) \
            if live else None  # noqa: B023
        for r, sl in enumerate(groups):
            best = float(norms[r])
            if live and op is not None and err is not None and np.all(np.isfinite(err[sl])):
                with contextlib.suppress(ValueError, np.linalg.LinAlgError):
                    best = min(best, add_up(op(g[sl]), frobenius_upper(err[sl])))
            out[r] = add_up(float(out[r]), best)
    if not np.all(np.isfinite(out)):
        return None
    return out


def _finite(f: Callable[[], np.ndarray]) -> np.ndarray | None:
    try:
        return f()
    except (ValueError, np.linalg.LinAlgError, FloatingPointError):
        return None


def _group_norms(m: np.ndarray, groups: list[np.ndarray]) -> np.ndarray:
    """Upper bounds on ||m[sl]||_2 per group (inf where an entry is not finite). Runs of
    consecutive groups of one size that are contiguous row ranges (a tensor's tokens) go
    through one batched eigensolver call (`sigma_max_upper`: the same LAPACK bound, 8 tokens
    x 16 rows: one call instead of eight); the rest one by one (`spectral_norm_upper`)."""
    out = np.full(len(groups), math.inf)
    contiguous = [g.size > 0 and g.size == int(g[-1]) - int(g[0]) + 1
                  and bool(np.all(np.diff(g) == 1)) for g in groups]
    i = 0
    while i < len(groups):
        j = i
        if contiguous[i]:
            size = groups[i].size
            while j + 1 < len(groups) and contiguous[j + 1] and groups[j + 1].size == size \
                    and int(groups[j + 1][0]) == int(groups[j][-1]) + 1:
                j += 1
        if j > i:  # groups i..j tile the rows groups[i][0] .. groups[j][-1]
            block = m[int(groups[i][0]):int(groups[j][-1]) + 1]
            block = block.reshape(j - i + 1, groups[i].size, -1)
            fin = np.all(np.isfinite(block), axis=(1, 2))
            if np.all(fin):
                with np.errstate(over="ignore", invalid="ignore"):
                    got = sigma_max_upper(block)
                out[i:j + 1] = np.where(np.isfinite(got), got, math.inf)
            else:
                for r in range(i, j + 1):
                    out[r] = _norm_or_inf(m, groups[r])
        else:
            out[i] = _norm_or_inf(m, groups[i])
        i = j + 1
    return out


def _norm_or_inf(m: np.ndarray | None, sl: np.ndarray) -> float:
    if m is None or not np.all(np.isfinite(m[sl])):
        return math.inf
    return spectral_norm_upper(m[sl])
