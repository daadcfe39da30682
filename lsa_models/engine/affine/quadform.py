"""The second-order symbols' quadratic forms (`affine.QUAD`): their coefficients' sizes on the
2-ball (Frobenius, eigenvalues), and a margin's input linear part and quadratic part bounded
together (`quad_low`); the shared roundings (`_up`, `_REL`, `TINY`) of the affine forms
(docs/local-affine.md, "Affine value forms")."""

from __future__ import annotations

import functools
from typing import Literal

import numpy as np

from lsa_models.bounds.numerics import U
from lsa_models.engine.values import Ball, gamma, widen_up

# relative outward allowance of libm values (exp, erf, tanh) and of a handful of roundings
_REL = 1e-12
TINY = 1e-300


def _up(x: np.ndarray, k: int = 4) -> np.ndarray:
    return widen_up(np.asarray(x, dtype=np.float64), k)


def quad_size(p: int) -> int:
    """Columns of the second-order symbols for an input of p entries."""
    return p * (p + 1) // 2


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


# eigenproblems solved per batch (`quad_two_eig`)
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

