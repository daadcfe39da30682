"""Structured output norms (docs/local-enclosure.md, "Structured output norms").

The telescoped remainder J(X) - J(X0) = sum_k T_k, T_k = G_k (D_k(X) - D_k(X0)) J_in_k(X), is
bounded entrywise by M_k = c_k |J_in_k| (c_k = |G_k| R_k >= 0, R_k an entrywise bound on the
op's Jacobian change); taking |J_in_k| loses the signs of J_in_k. Each row i of T_k is
sum_b beta_b J_in,b(X) with |beta_b| <= c_ib, so
  sum_p |T_k,ip|  <= ||diag(c_i) jc_in||_{inf->1} + c_i . rowsum(jr_in),
      ||B||_{inf->1} = max_{s, t = +-1} t^T B s <= min(sum |B|, sqrt(n P) ||B||_2);
  ||T_k,i||_2     <= ||c_i||_2 (||jc_in||_2 + ||jr_in||_2);
  ||T_k||_2       <= ||c_k||_2 (||jc_in||_2 + ||jr_in||_2)   (||G dD||_2 <= || |G| R ||_2).
Per row (and for the whole matrix) every term takes the smaller of its entrywise and its
factored bound; the entrywise ones are summed first (their sum's norm), the factored ones
added. All quantities are nonnegative sums, rounded up (widen_up / numerics).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lsa_models.bounds.numerics import (
    U,
    add_up,
    frobenius_upper,
    mul_up,
    spectral_norm_upper,
    sqrt_up,
)
from lsa_models.engine.values import Parts, box_to_two, widen_up


@dataclass
class Structured:
    rows_inf: np.ndarray  # (m,) bound on sum_p |J_ip(X) - jc_ip|
    rows_two: np.ndarray  # (m,) bound on ||J_i(X) - jc_i||_2
    mat_two: float  # bound on ||J(X) - jc||_2
    # (m,) bound on sup ||J_i(X)||_1 itself (inf-ball, the signs of J_i kept:
    # remainders/signed_adjoints.py)
    rows_abs: np.ndarray | None = None


class PartsChoice(list):
    """Alternative decompositions of one op's term (each a list of Parts, every one valid):
    a bound takes the smallest it gets from any of them (primitives.elementwise offers the
    factored Jacobian deviation of its input, LocalValue.jfac, beside the entrywise one)."""


def alternatives(parts: list) -> list[list[Parts]]:
    return list(parts) if isinstance(parts, PartsChoice) else [parts]


# the box's l2 bound in _inf_to_one costs an eigenvalue problem per row and part: kept for
# parts of at most this many entries (n P), small classifiers' (<= 3.3e4); on HF GPT-2
# (parts up to 2.6e5) it took 7 of 47 s, and 5 of 27 s with a 1e5 cap
BOX_MAX_ENTRIES = 40_000


def _inf_to_one(c: np.ndarray, jc: np.ndarray, plain: float) -> float:
    """A bound on max over |beta_b| <= c_b of ||sum_b beta_b jc_b||_1: the smallest of plain,
    sqrt(n P) ||diag(c) jc||_2 and sqrt(P) box_to_two((diag(c) jc)^T) (the box's l2 bound:
    ||v||_1 <= sqrt(P) ||v||_2), n, P the nonzero rows and columns."""
    rows = c > 0
    if not rows.any():
        return 0.0
    b = c[rows, None] * jc[rows]
    cols = np.abs(b).max(axis=0) > 0
    n, p = int(rows.sum()), int(cols.sum())
    if p == 0:
        return 0.0
    bc = b[:, cols]
    out = plain
    # the box bound is at least its largest row's norm (e one-hot): skip it when that cannot
    # win (it costs an eigenvalue problem per row)
    top = float(np.sqrt(np.square(b).sum(axis=1).max()))
    if math.sqrt(p) * top < plain and n * p <= BOX_MAX_ENTRIES:
        # b = fl(c jc) is within u |c jc| entrywise of the exact product E: sup ||E^T e||_2
        # over the box is at most u || |b|^T 1 ||_2 (1 + u)
        err = mul_up(2 * U, float(np.sqrt(np.square(np.abs(bc).sum(axis=0)).sum())))
        box = add_up(float(box_to_two(bc.T[None])[0]), err)
        out = min(plain, mul_up(sqrt_up(float(p)), box))
    # ||B||_2 >= its largest row norm: skip the spectral certificate when it cannot win
    if math.sqrt(n * p) * top >= out:
        return out
    # || |E| ||_2 <= ||E||_F <= u ||b||_F (1 + u)
    s = add_up(spectral_norm_upper(bc), mul_up(2 * U, frobenius_upper(bc)))
    return min(out, mul_up(sqrt_up(float(n * p)), s))


def row_two_bounds(terms: list[tuple[np.ndarray, list[Parts] | None]], zr: np.ndarray
                   ) -> np.ndarray:
    """Only `Structured.rows_two` (cheap: no per-row spectral norms), for value ranges."""
    m, p = zr.shape
    plain = zr.copy()
    fact = np.zeros(m)
    for mk, parts in terms:
        if parts is None:
            plain += mk
            continue
        two_f = np.full(m, np.inf)
        for alt in alternatives(parts):
            tf = np.zeros(m)
            for c, jc, jr in alt:
                nj = add_up(spectral_norm_upper(jc), spectral_norm_upper(jr))
                tf += np.sqrt(widen_up(np.square(c).sum(axis=1), c.shape[1])) * (1 + 4 * U) \
                    * nj * (1 + 2 * U)
            two_f = np.minimum(two_f, widen_up(tf, 4 * len(alt)))
        own = np.sqrt(np.square(mk).sum(axis=1))
        use = two_f < own
        fact += np.where(use, two_f, 0.0)
        plain += np.where(use[:, None], 0.0, mk)
    rows = np.sqrt(widen_up(np.square(widen_up(plain, 2 * len(terms) + 2)).sum(axis=1), p)) \
        * (1 + 4 * U)
    return widen_up(rows + fact, 2 * len(terms) + 2)


def _factored(alts: list[list[Parts]], m: int, p: int) -> tuple[np.ndarray, np.ndarray, float]:
    """(rows' l1, rows' l2, matrix 2-norm) bounds of one op's term from its decompositions:
    each alternative's sums over its parts, the smallest per quantity."""
    best_inf, best_two, best_mat = np.full(m, np.inf), np.full(m, np.inf), math.inf
    for alt in alts:
        inf_f = np.zeros(m)
        two_f = np.zeros(m)
        mat_f = 0.0
        for c, jc, jr in alt:
            njc, njr = spectral_norm_upper(jc), spectral_norm_upper(jr)
            nj = add_up(njc, njr)
            jr_rows = widen_up(jr.sum(axis=1), p)
            ajc_rows = widen_up(np.abs(jc).sum(axis=1), p)
            n = c.shape[1]
            for i in range(m):
                plain = float(widen_up(c[i] @ ajc_rows, n)[()])
                inf_f[i] += _inf_to_one(c[i], jc, plain) + float(widen_up(c[i] @ jr_rows, n))
                two_f[i] += mul_up(frobenius_upper(c[i]), nj)
            mat_f = add_up(mat_f, mul_up(spectral_norm_upper(c), nj))
        best_inf = np.minimum(best_inf, widen_up(inf_f, 4 * len(alt)))
        best_two = np.minimum(best_two, widen_up(two_f, 4 * len(alt)))
        best_mat = min(best_mat, mat_f)
    return best_inf, best_two, best_mat


def structured_bounds(terms: list[tuple[np.ndarray, list[Parts] | None]], zr: np.ndarray,
                      norm: str) -> Structured:
    """terms: (M_k (m, P), parts_k or None) per op; zr (m, P): the rounding of jc."""
    m, p = zr.shape
    plain_sum = zr.copy()  # entrywise majorants of the terms kept entrywise (whole matrix)
    fact_two = 0.0
    rows_inf = widen_up(zr.sum(axis=1), p)
    rows_plain = [zr.copy() for _ in range(m)] if norm == "2" else []
    rows_fact = np.zeros(m)
    for mk, parts in terms:
        plain_rows = widen_up(mk.sum(axis=1), p)  # (m,)
        if parts is None:
            rows_inf = rows_inf + plain_rows
            plain_sum = plain_sum + mk
            for i in range(len(rows_plain)):
                rows_plain[i] += mk[i]
            continue
        inf_f, two_f, mat_f = _factored(alternatives(parts), m, p)
        rows_inf = rows_inf + np.minimum(plain_rows, inf_f)
        if norm == "2":
            for i in range(m):
                if two_f[i] < float(np.sqrt(np.square(mk[i]).sum())):
                    rows_fact[i] += two_f[i]
                else:
                    rows_plain[i] += mk[i]
        if mat_f < spectral_norm_upper(mk):
            fact_two = add_up(fact_two, mat_f)
        else:
            plain_sum = plain_sum + mk
    rows_inf = widen_up(rows_inf, 2 * len(terms) + 2)
    if norm == "2":
        rows_two = np.array([add_up(frobenius_upper(widen_up(rows_plain[i], 2 * len(terms) + 2)),
                                    float(rows_fact[i]))
                             for i in range(m)]) * (1 + 4 * len(terms) * U)
    else:
        rows_two = np.full(m, np.inf)
    mat_two = add_up(spectral_norm_upper(widen_up(plain_sum, 2 * len(terms) + 2)), fact_two)
    return Structured(rows_inf, rows_two, mat_two * (1 + 4 * len(terms) * U))
