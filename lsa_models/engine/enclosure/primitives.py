"""Enclosure arithmetic shared by the local rules: linear maps, elementwise functions with
derivative ranges, bilinear products, softmax. Every function takes `LocalValue`s and returns
one; derivations in docs/local-enclosure.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from lsa_models.bounds.numerics import U, add_up
from lsa_models.engine.enclosure.elementwise_ranges import (
    LIBM_REL,
    Deriv,
    Kind,
    derivative,
    value_range,
)
from lsa_models.engine.remainders import operator_norms
from lsa_models.engine.remainders.second_order import (
    Curv2,
    elementwise_second,
    matmul_second,
    mul_second,
    softmax_second,
)
from lsa_models.engine.remainders.signed_adjoints import SignedFn, SignedTerm
from lsa_models.engine.remainders.structured_norms import PartsChoice
from lsa_models.engine.values import (
    FLOOR,
    Ball,
    LocalNotCertified,
    LocalValue,
    OpRemainder,
    Parts,
    center_margin,
    dual_row_norms,
    enclose,
    gamma,
    widen_up,
)
from lsa_models.operators.softmax import Softmax


def linear(v_out_center: np.ndarray, jc: np.ndarray, jr_abs: np.ndarray,
           jc_abs: np.ndarray, k: int, ball: Ball,
           lo: np.ndarray | None = None, hi: np.ndarray | None = None) -> LocalValue:
    """Output of a map linear in its inputs: `jc = L(jc_in)`, `jr_abs = |L|(jr_in)`,
    `jc_abs = |L|(|jc_in|)` (for the rounding of jc); k bounds the terms per entry."""
    jr = widen_up(jr_abs + gamma(k) * jc_abs, k)
    return enclose(v_out_center, jc, jr, ball, lo, hi)


# the factored Jacobian deviation's M (numel^2 of the elementwise op) is kept up to this size
MAX_JFAC_ENTRIES = 4_000_000


def elementwise(v: LocalValue, kind: Kind, out_center: np.ndarray, ball: Ball,
                exponent: float = 2.0, deriv: Deriv | None = None,
                values: tuple[np.ndarray, np.ndarray] | None = None,
                curv: Callable[[np.ndarray, np.ndarray], np.ndarray | None] | None = None,
                curv2: Curv2 | None = None) -> LocalValue:
    """y = f(x) entrywise: dy = f'(x) dx with f'(x) in [dlo, dhi] over the input's range.
    `deriv` and `values` (f's range) override the built-in ones (fused chains); `curv(lo, hi)`
    bounds |f''| on [lo, hi] entrywise (the 2-ball's relational operator-norm form), `curv2`
    encloses f'' with its sign (the inf-ball's second-order rows, remainders/second_order.py)."""
    d, rng = deriv if deriv is not None else derivative(kind, v.lo, v.hi, exponent)
    dc = d(v.center)  # (*S,)
    dlo, dhi = rng(v.lo, v.hi)
    pad = LIBM_REL * np.maximum(np.abs(dlo), np.abs(dhi)) + FLOOR
    dr = np.maximum(np.maximum(dhi - dc, dc - dlo), 0.0) + pad  # (*S,)
    # the true f'(x(X0)) may differ from dc: by at most the range over the centre's margin
    mc = center_margin(v.center)
    d0lo, d0hi = rng(v.center - mc, v.center + mc)
    dr0 = np.maximum(np.maximum(d0hi - dc, dc - d0lo), 0.0) + pad
    adc = np.abs(dc)[..., None]
    ajc = np.abs(v.jc)
    jc = dc[..., None] * v.jc  # (*S, P)
    jr = widen_up(adc * v.jr + dr[..., None] * (ajc + v.jr) + gamma(2) * adc * ajc, 4)
    lo, hi = values if values is not None else value_range(kind, v.lo, v.hi, exponent)
    out = enclose(out_center, jc, jr, ball, lo, hi)
    upstream = ajc + v.jr  # (*S, P)

    def term(g: np.ndarray) -> np.ndarray:  # sum_s |G_s| dr_s |J_in(X)|_s
        k = g.shape[0]
        flat = upstream.reshape(-1, upstream.shape[-1])
        return (np.abs(g).reshape(k, -1) * (dr + dr0).reshape(-1)) @ flat

    def parts(g: np.ndarray) -> list[Parts]:
        k, p = g.shape[0], v.jc.shape[-1]
        c = np.abs(g).reshape(k, -1) * (dr + dr0).reshape(-1)
        base = [(c, v.jc.reshape(-1, p), v.jr.reshape(-1, p))]
        if v.jfac is None:
            return base
        # J_x(X) = jc + M diag(delta) src + R (LocalValue.jfac): sum_b beta_ib J_x,b(X) =
        # sum_b beta_ib (jc_b + R_b) + sum_s gamma_is src_s, |gamma_is| <= (c |M|)_is dmb_s
        fm, dmb, src, frest = v.jfac
        n = v.center.size
        c2 = widen_up((c @ np.abs(fm.reshape(n, -1))) * dmb, n + 2)
        split = [(c, v.jc.reshape(-1, p), frest.reshape(-1, p)), (c2, src, np.zeros_like(src))]
        # the bounds take the better (remainders/structured_norms.py)
        return PartsChoice([base, split])
    sec = op = None
    if ball.norm == "inf":
        sec = elementwise_second(v, dr + dr0, mc, curv2)
        b = v.center.size
        if b * b <= MAX_JFAC_ENTRIES:
            # J_y(X) - jc_y = delta (jc_x + R_x) + dc R_x + (dc jc_x - fl(dc jc_x)), |delta| <= dr
            out.jfac = (np.eye(b).reshape(*v.shape, b), dr.reshape(-1), v.jc.reshape(b, -1),
                        widen_up(adc * v.jr + dr[..., None] * v.jr + gamma(2) * adc * ajc, 4))
    if ball.norm == "2":
        kap = None
        if curv is not None:  # |f''| over both x(X) and x(X0): the range and the centre's
            kap = curv(np.minimum(v.lo, v.center - mc), np.maximum(v.hi, v.center + mc))
        op = operator_norms.elementwise(dr + dr0, v.jc, v.jr, v.jnorm, kap, ball.eps)
    out.remainder = OpRemainder(term, parts, op, sec)
    return out


def _t(x: np.ndarray) -> np.ndarray:
    """(*S, P) -> (P, *S): tangents leading, for products on the trailing axes."""
    return np.moveaxis(x, -1, 0)


def _b(x: np.ndarray) -> np.ndarray:
    return np.moveaxis(x, 0, -1)


def product(a: LocalValue | np.ndarray, b: LocalValue | np.ndarray, out_center: np.ndarray,
            ball: Ball, matmul: bool) -> LocalValue:
    """y = a * b (broadcast) or a @ b, at least one input-dependent:
    dy = da b + a db, each term an interval product
    (Jc +- Jr)(Bc +- Br) in Jc Bc +- (|Jc| Br + Jr |Bc| + Jr Br)."""
    p = ball.size

    def unpack(x: LocalValue | np.ndarray) -> tuple[np.ndarray, ...]:
        if isinstance(x, LocalValue):
            return x.center, x.rad, x.jc, x.jr, center_margin(x.center)
        c = np.asarray(x, dtype=np.float64)
        z = np.zeros((*c.shape, p))
        return c, np.zeros_like(c), z, z, np.zeros_like(c)

    ac, ar, ajc, ajr, am = unpack(a)
    bc, br, bjc, bjr, bm = unpack(b)
    if matmul:
        def mul(x: np.ndarray, y: np.ndarray, xt: bool, yt: bool) -> np.ndarray:
            # one of x, y is a tangent array (*S, P)
            return _b((_t(x) if xt else x) @ (_t(y) if yt else y))
        k = int(ac.shape[-1])
    else:
        def mul(x: np.ndarray, y: np.ndarray, xt: bool, yt: bool) -> np.ndarray:
            return (x if xt else x[..., None]) * (y if yt else y[..., None])
        k = 2
    aajc, abjc = np.abs(ajc), np.abs(bjc)
    jc = mul(ajc, bc, True, False) + mul(ac, bjc, False, True)
    rad = (mul(aajc, br, True, False) + mul(ajr, np.abs(bc), True, False)
           + mul(ajr, br, True, False) + mul(np.abs(ac), bjr, False, True)
           + mul(ar, abjc, False, True) + mul(ar, bjr, False, True))
    err = gamma(k) * (mul(aajc, np.abs(bc), True, False) + mul(np.abs(ac), abjc, False, True))
    jr = widen_up(rad + err, 8 * k)
    shape = out_center.shape
    jc = np.broadcast_to(jc, (*shape, p))
    jr = np.broadcast_to(jr, (*shape, p))
    vlo, vhi = _product_values(ac, ar, ajr, am, bc, br, bjr, bm, jc, out_center, ball, matmul,
                               k)
    out = enclose(out_center, np.ascontiguousarray(jc), np.ascontiguousarray(jr), ball,
                  vlo, vhi)
    ua, ub = aajc + ajr, abjc + bjr  # |J_a(X)|, |J_b(X)| bounds (*S_a, P), (*S_b, P)

    def term(g: np.ndarray) -> np.ndarray:
        # G (D(X) - D(X0)) J(X) with D(X) - D(X0) = [(.)(B(X) - B(X0)), (A(X) - A(X0))(.)];
        # |B(X) - B(X0)| <= br + the centre's margin (B(X0) is known to within it)
        k, ag = g.shape[0], np.abs(g)
        br2, ar2 = br + bm, ar + am
        if matmul:
            h1 = ag @ np.swapaxes(br2, -1, -2)  # (K, ..., n, k)
            h2 = np.swapaxes(ar2, -1, -2) @ ag  # (K, ..., k, m)
            t1 = h1.reshape(k, -1) @ np.broadcast_to(ua, (*h1.shape[1:], p)).reshape(-1, p)
            t2 = h2.reshape(k, -1) @ np.broadcast_to(ub, (*h2.shape[1:], p)).reshape(-1, p)
            return t1 + t2
        t1 = (ag * np.broadcast_to(br2, shape)).reshape(k, -1) @ \
            np.broadcast_to(ua, (*shape, p)).reshape(-1, p)
        t2 = (ag * np.broadcast_to(ar2, shape)).reshape(k, -1) @ \
            np.broadcast_to(ub, (*shape, p)).reshape(-1, p)
        return t1 + t2

    def parts(g: np.ndarray) -> list[Parts]:
        # the same two products with the operands' Jacobians signed: (c, jc, jr) per operand
        k, ag = g.shape[0], np.abs(g)
        br2, ar2 = br + bm, ar + am
        if matmul:
            h1 = ag @ np.swapaxes(br2, -1, -2)  # (K, ..., n, k): weights on a's entries
            h2 = np.swapaxes(ar2, -1, -2) @ ag  # (K, ..., k, m): on b's entries
            s1, s2 = h1.shape[1:], h2.shape[1:]
        else:
            h1, h2 = ag * np.broadcast_to(br2, shape), ag * np.broadcast_to(ar2, shape)
            s1 = s2 = shape

        def flat(x: np.ndarray, s: tuple[int, ...]) -> np.ndarray:
            return np.broadcast_to(x, (*s, p)).reshape(-1, p)
        return [(h1.reshape(k, -1), flat(ajc, s1), flat(ajr, s1)),
                (h2.reshape(k, -1), flat(bjc, s2), flat(bjr, s2))]
    out.remainder = _product_rules(OpRemainder(term, parts), out.shape, a, b, ball, matmul,
                                   ar + am, br + bm)
    return out


def _product_rules(rem: OpRemainder, shape: tuple[int, ...], a: LocalValue | np.ndarray,
                   b: LocalValue | np.ndarray, ball: Ball, matmul: bool, ar2: np.ndarray,
                   br2: np.ndarray) -> OpRemainder:
    """A product's remainder `rem` (term and parts) with its signed, second-order (inf-ball)
    and operator-norm (2-ball) forms; `ar2`, `br2` bound the operands' moves."""
    term, parts = rem.term, rem.parts
    assert parts is not None
    if isinstance(a, LocalValue) and isinstance(b, LocalValue):
        if not matmul:
            if ball.norm == "inf":
                rem = replace(rem, second=mul_second(a, b, shape, ar2, br2, term))
        elif a.center.ndim == b.center.ndim == len(shape) >= 2 \
                and a.shape[:-2] == b.shape[:-2] == shape[:-2]:
            rem = OpRemainder(SignedTerm(term, parts, _matmul_signed(a, b, br2, ar2, ball)),
                              parts)
            if ball.norm == "inf":
                rem = replace(rem, second=matmul_second(a, b, ar2, br2, term))
    if ball.norm == "2":
        fn = operator_norms.matmul(a, b, shape, ball) if matmul else _mul_opnorm(a, b, shape)
        if fn is not None:
            rem = replace(rem, opnorm=fn)
    return rem


def _mul_opnorm(a: LocalValue | np.ndarray, b: LocalValue | np.ndarray,
                shape: tuple[int, ...]) -> operator_norms.OpNorm | None:
    """y = a * b entrywise, both of the output's shape (no broadcasting): D(X) - D(X0) maps
    (da, db) to da (b(X) - b(X0)) + (a(X) - a(X0)) db, diagonal scalings by changes bounded
    entrywise by the other operand's radius plus its centre margin (operator_norms.elementwise)."""
    fns = []
    for x, other in ((a, b), (b, a)):
        if not isinstance(x, LocalValue) or not isinstance(other, LocalValue):
            continue
        if x.shape != shape or other.shape != shape:
            return None
        fns.append(operator_norms.elementwise(other.rad + center_margin(other.center), x.jc, x.jr,
                                      x.jnorm))
    if not fns:
        return None

    def fn(g: np.ndarray) -> float:
        total = 0.0
        for f in fns:
            total = add_up(total, f(g))
        return total
    return fn


# entries of the largest intermediate (rows x ... x k x P) one chunk of `_matmul_signed`'s
# adjoint rows may hold (~4 MB: x-transformers one row at a time, 20x faster than all 128)
SIGNED_CHUNK_ENTRIES = 500_000


def _matmul_signed(a: LocalValue, b: LocalValue, br2: np.ndarray, ar2: np.ndarray,
                   ball: Ball) -> SignedFn:
    """The signed bound for a product y = A B of two input-dependent tensors
    (docs/local-second-order.md, "Signed adjoints"): the term's weight on J_A,nk is
    sum_m G_nm (B(X) - B(X0))_km, a linear functional of B's row k, bounded by the box
    sum_m |G_nm| (br + bm)_km or by its mean value form with B's Jacobian enclosure
    eps ||sum_m G_nm jc_B,km||_q + eps sum_m |G_nm| ||jr_B,km||_1; likewise on J_B,km."""
    pdim = a.jc.shape[-1]
    eps = ball.eps
    bjrow = np.swapaxes(widen_up(b.jr.sum(axis=-1), pdim), -1, -2)  # (..., m, k)
    ajrow = np.swapaxes(widen_up(a.jr.sum(axis=-1), pdim), -1, -2)  # (..., k, n)
    bjabs = np.swapaxes(widen_up(np.abs(b.jc).sum(axis=-1), pdim), -1, -2)
    ajabs = np.swapaxes(widen_up(np.abs(a.jc).sum(axis=-1), pdim), -1, -2)
    brt, art = np.swapaxes(br2, -1, -2), np.swapaxes(ar2, -1, -2)
    rnd = 1e-12 * (1.0 + math.sqrt(pdim))
    # the operands' Jacobians laid out for batched BLAS products with G (einsum's loops were
    # the bound's hot path on GPT-2): jc_B as (..., m, k P), jc_A as (..., n, k P)
    kb = b.shape[-2]
    bjm = np.ascontiguousarray(np.swapaxes(b.jc, -3, -2)).reshape(*b.shape[:-2], b.shape[-1],
                                                                  kb * pdim)
    ka = a.shape[-1]
    ajn = a.jc.reshape(*a.shape[:-1], ka * pdim)

    def signed(g: np.ndarray, ga: np.ndarray) -> list[np.ndarray]:
        # the adjoint rows in chunks: each row's bound is computed alone, and the (rows, ...,
        # k, P) intermediates of a whole batch are memory-bound (x-transformers' attention:
        # 128 rows -> 268 MB per product)
        k = g.shape[0]
        batch = int(np.prod(g.shape[1:-2]))
        per_row = batch * max(g.shape[-2] * kb, g.shape[-1] * ka) * pdim  # lin_a, lin_b
        step = max(1, SIGNED_CHUNK_ENTRIES // max(per_row, 1))
        if k <= step:
            return one(g, ga)
        parts = [one(g[i:i + step], ga[i:i + step]) for i in range(0, k, step)]
        return [np.concatenate([p[j] for p in parts]) for j in range(2)]

    def one(g: np.ndarray, ga: np.ndarray) -> list[np.ndarray]:
        k = g.shape[0]
        ag = np.abs(g)
        e = np.maximum(ga - ag, 0.0)
        m_a = g.shape[-1]
        n_b = g.shape[-2]
        # on A's entries (n, k): sum_m G_nm dB_km
        lin_a = (g @ bjm).reshape(*g.shape[:-1], kb, pdim)  # (Z, ..., n, k, P)
        mv_a = eps * (dual_row_norms(np.abs(lin_a), ball.norm) + ag @ bjrow
                      + rnd * (ag @ bjabs))
        c_a = widen_up(np.minimum(ag @ brt, widen_up(mv_a, m_a + 4)) + e @ brt, m_a + 4)
        # on B's entries (k, m): sum_n G_nm dA_nk
        lin_b = (np.swapaxes(g, -1, -2) @ ajn).reshape(*g.shape[:-2], m_a, ka, pdim)
        mv_b = eps * (np.swapaxes(dual_row_norms(np.abs(lin_b), ball.norm), -1, -2)
                      + ajrow @ ag
                      + rnd * (ajabs @ ag))
        c_b = widen_up(np.minimum(art @ ag, widen_up(mv_b, n_b + 4)) + art @ e, n_b + 4)
        return [c_a.reshape(k, -1), c_b.reshape(k, -1)]

    return signed


def _product_values(ac: np.ndarray, ar: np.ndarray, ajr: np.ndarray, am: np.ndarray,
                    bc: np.ndarray, br: np.ndarray, bjr: np.ndarray, bm: np.ndarray,
                    jc: np.ndarray, out_center: np.ndarray, ball: Ball, matmul: bool, k: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The second-order value form of a product (docs/local-enclosure.md): with a(X) = ac + da,
    da = jc_a d + e_a, |e_a| <= jr_a |d| + m_a (likewise b),
    ab - ac bc = (ac jc_b + jc_a bc) d + (ac e_b + e_a bc) + da db, so
    |ab - ac bc| <= eps ||jc row|| + eps ||(|ac| jr_b + jr_a |bc|) row|| + |ac| m_b + m_a |bc|
                   + |a - ac| |b - bc|, the last one an interval product of the radii."""
    if matmul:
        def mm(x: np.ndarray, y: np.ndarray) -> np.ndarray:
            return x @ y

        def mt(x: np.ndarray, y: np.ndarray, xt: bool) -> np.ndarray:  # one tangent operand
            return _b((_t(x) if xt else x) @ (y if xt else _t(y)))
    else:
        def mm(x: np.ndarray, y: np.ndarray) -> np.ndarray:
            return x * y

        def mt(x: np.ndarray, y: np.ndarray, xt: bool) -> np.ndarray:
            return (x * y[..., None]) if xt else (x[..., None] * y)
    aac, abc = np.abs(ac), np.abs(bc)
    pc = mm(ac, bc)
    lin = dual_row_norms(np.abs(jc), ball.norm)
    cross = dual_row_norms(np.broadcast_to(mt(aac, bjr, False) + mt(ajr, abc, True),
                                           jc.shape), ball.norm)
    rest = mm(aac, bm) + mm(am, abc) + mm(ar, br) + np.abs(out_center - pc) \
        + gamma(k) * mm(aac, abc)
    rad = widen_up(ball.eps * (lin + cross) + rest, 8 * k)
    return out_center - rad, out_center + rad


# the softmax's ranges and Jacobian entries (lsa_models/operators/softmax.py; the axis is moved
# last here)
SOFTMAX = Softmax("Softmax")


def softmax(v: LocalValue, axis: int, out_center: np.ndarray, ball: Ball) -> LocalValue:
    """p = softmax(l) along `axis`: J = diag(p) - p p^T per row, its entries enclosed from
    the probability ranges that the logit ranges allow (`Softmax.jacobian_ranges`)."""
    ax = axis % len(v.shape)
    lo, hi = np.moveaxis(v.lo, ax, -1), np.moveaxis(v.hi, ax, -1)  # (..., n)
    pc = np.moveaxis(out_center, ax, -1)
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
        raise LocalNotCertified("Softmax of logits with infinite entries (a mask) has no "
                                "local rule yet")
    n = lo.shape[-1]
    sc = SOFTMAX.jacobian_center(pc)
    plo, phi, sr = SOFTMAX.jacobian_ranges(lo, hi, pc, sc)
    # |S(X) - S(X0)| for the true centre S(X0): sr plus the centre's own uncertainty (the
    # same ranges over the forward margin of the logits)
    lc = np.moveaxis(v.center, ax, -1)
    mc = np.moveaxis(center_margin(v.center), ax, -1)
    _, _, sr0 = SOFTMAX.jacobian_ranges(lc - mc, lc + mc, pc, sc)
    jc_in = np.moveaxis(v.jc, ax, -2)  # (..., n, P)
    jr_in = np.moveaxis(v.jr, ax, -2)
    ajc = np.abs(jc_in)
    jc = sc @ jc_in
    asc = np.abs(sc)
    jr = widen_up(asc @ jr_in + sr @ (ajc + jr_in) + gamma(n) * (asc @ ajc), 4 * n)
    jc, jr = np.moveaxis(jc, -2, ax), np.moveaxis(jr, -2, ax)
    out = enclose(out_center, np.ascontiguousarray(jc), np.ascontiguousarray(jr), ball,
                  np.moveaxis(plo, -1, ax), np.moveaxis(phi, -1, ax))
    upstream = ajc + jr_in  # (..., n, P)

    def term(g: np.ndarray) -> np.ndarray:  # sum_ij |G_i| sr_ij |J_in(X)|_j
        k = g.shape[0]
        h = (np.moveaxis(np.abs(g), ax + 1, -1)[..., None, :] @ (sr + sr0))[..., 0, :]
        return h.reshape(k, -1) @ upstream.reshape(-1, upstream.shape[-1])

    def parts(g: np.ndarray) -> list[Parts]:
        k, p = g.shape[0], jc_in.shape[-1]
        h = (np.moveaxis(np.abs(g), ax + 1, -1)[..., None, :] @ (sr + sr0))[..., 0, :]
        return [(h.reshape(k, -1), jc_in.reshape(-1, p), jr_in.reshape(-1, p))]
    sfn = _softmax_signed(out, ax, pc, sr + sr0, ball)
    rem = OpRemainder(SignedTerm(term, parts, sfn), parts)
    if ball.norm == "inf" and ax == len(v.shape) - 1:
        rem = replace(rem, second=softmax_second(v, plo, phi, pc, mc, term, sfn))
    if ball.norm == "2":
        rows = _softmax_block(plo, phi, sr + sr0)
        last = ax == len(v.shape) - 1
        if last:
            rows = np.minimum(rows, _softmax_derivative_block(v, ball))
        rem = replace(rem, opnorm=operator_norms.blockwise(
            float(rows.max()), v.jc, v.jr, known=v.jnorm, blocks=rows if last else None))
    out.remainder = rem
    return out


def _softmax_derivative_block(v: LocalValue, ball: Ball) -> np.ndarray:
    """Per row (...,) a bound on ||S(z(X)) - S(z(X0))||_2 (softmax over the last axis, S =
    diag(p) - p p^T the Hessian of log-sum-exp) by the mean value inequality in the logits:
    DS[dz] is symmetric with u^T DS[dz] u = E_p[(dz - E_p dz)(u - E_p u)^2] = Cov_p(A, B^2)
    (A = dz - E dz, B = u - E u: the third cumulant), and by Grüss's inequality
    |Cov(A, B^2)| <= (1/4) range(A) range(B^2) <= (1/4) sqrt(2) ||dz|| 2 ||u||^2 (a vector's
    range is at most sqrt 2 times its 2-norm; B^2 lies in [0, range(u)^2]), so
    ||DS[dz]||_2 <= ||dz||_2 / sqrt(2) (the two-point sup is sqrt(2/27) = 0.272 of it);
    ||dz||_2 <= the row's token radius (telescoped in the operator norm, Telescope.tighten) or
    its group radius."""
    rad = v.tok_rad if v.tok_rad is not None else \
        operator_norms.group_radius(v, ball, 1)[..., None]
    return widen_up(rad[..., 0] * (math.sqrt(0.5) * (1 + 1e-15)), 2)


def _softmax_block(plo: np.ndarray, phi: np.ndarray, srs: np.ndarray) -> np.ndarray:
    """Per row (...,) a bound on ||S(X) - S(X0)||_2, S = diag(p) - p p^T: with
    dp = phi - plo >= |p(X) - p(X0)| (both in the range), Delta S = diag(Delta p)
    - Delta p p^T - p0 Delta p^T, so ||Delta S||_2 <= max|dp| + 2 ||dp||_2 (||p||_2 <= 1);
    or the nonnegative majorant srs of its entries, whichever is smaller."""
    n = plo.shape[-1]
    dp = widen_up(phi - plo, 2)
    analytic = widen_up(dp.max(axis=-1) + 2 * np.sqrt(widen_up(np.square(dp).sum(axis=-1), n))
                        * (1 + 4 * U), 2)
    return np.minimum(analytic, operator_norms.nonneg_block_norms(srs)) * (1 + 4 * U)


def _softmax_signed(out: LocalValue, ax: int, pc: np.ndarray, srs: np.ndarray, ball: Ball
                    ) -> SignedFn:
    """The signed bound for softmax's term (docs/local-second-order.md, "Signed adjoints"): for an
    adjoint row G (on one softmax row), phi_j = sum_i G_i S_ij = p_j (G_j - G . p), so with
    dp = p(X) - p(X0) (sum 0), |phi_j(p) - phi_j(p0)| = |dp_j (G_j - G . p) - p0_j G . dp|
    <= |dp_j| (|G_j - G . p0| + B) + p0_j B, B >= |G . dp| = |(G - G . p0) . dp|: the box
    sum_i |G_i - G . p0| |dp_i| or the mean value form with p's Jacobian enclosure."""
    n = pc.shape[-1]
    mc = np.moveaxis(center_margin(out.center), ax, -1)
    prad = widen_up(np.moveaxis(out.rad, ax, -1) + mc, 2)  # |p - p0| for the true p0 (..., n)
    p0 = pc + mc  # >= p0
    jcp = np.moveaxis(out.jc, ax, -2)  # (..., n, P)
    jrp = np.moveaxis(out.jr, ax, -2)
    pdim = jcp.shape[-1]
    jrow = widen_up(np.abs(jcp).sum(axis=-1), pdim)  # (..., n)
    jrrow = widen_up(jrp.sum(axis=-1), pdim)

    def signed(g: np.ndarray, ga: np.ndarray) -> np.ndarray:
        k = g.shape[0]
        gm = np.moveaxis(g, ax + 1, -1)  # (K, ..., n)
        em = np.moveaxis(np.maximum(ga - np.abs(g), 0.0), ax + 1, -1)
        kap = (gm * pc).sum(axis=-1, keepdims=True)  # G . p0 (computed; any constant works)
        gk = gm - kap
        agk = widen_up(np.abs(gk) + 1e-12 * (np.abs(gm) + np.abs(kap)), 2)  # >= |G_j - kap|
        box = widen_up((agk * prad).sum(axis=-1, keepdims=True), n)
        if ball.norm in ("inf", "2"):
            lin = np.einsum("...i,...ip->...p", gk, jcp)  # (K, ..., P)
            err = 1e-12 * ((np.abs(gm) + np.abs(kap)) * jrow).sum(axis=-1, keepdims=True)
            mv = widen_up(ball.eps * (dual_row_norms(np.abs(lin)[..., None, :], ball.norm)
                                      + (agk * jrrow).sum(axis=-1, keepdims=True))
                          + ball.eps * err * (1 + math.sqrt(pdim))
                          + (agk * mc).sum(axis=-1, keepdims=True), n + 4)
            bnd = np.minimum(box, mv)
        else:
            bnd = box
        # |G_j - G . p| <= |G_j - kap| + |G . dp| (sum dp = 0)
        c = widen_up(prad * (agk + bnd) + p0 * bnd, 4)
        c = c + (em[..., None, :] @ srs)[..., 0, :] * (1 + 1e-12)  # the adjoint's error
        return c.reshape(k, -1)

    return signed
