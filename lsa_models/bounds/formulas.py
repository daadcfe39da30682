"""The certified formulas of docs/theory.md on raw float64 weights.

Shared by the native-model rules and the ONNX rules, so a model gets the same number whichever
way it arrives. Weights are in the paper's row-vector convention: per-head matrices
`W^{Q,h}, W^{V,h}` of shape (H, D, d) and `W^O` of shape (D, D).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .numerics import (
    _TINY,
    U,
    _as_float64,
    add_up,
    div_up,
    frobenius_upper,
    inf_norm_upper,
    inv_sqrt_up,
    mul_up,
    one_norm_upper,
    phi_inv_upper,
    spectral_norm_upper,
    sqrt_up,
)

ArrayLike = torch.Tensor | np.ndarray


def l2_mha_inf_bound(wq: ArrayLike, wv: ArrayLike, wo: ArrayLike, n: int) -> float:
    """Theorem 3.2, inf-norm, unmasked, N >= 2:
    `(4 phi^{-1}(N-1) + 1/sqrt(d)) ||W^{O T}||_inf max_h ||W^{Q,h}||_inf ||W^{Q,h T}||_inf
    max_h ||W^{V,h T}||_inf`."""
    n = max(int(n), 2)  # the N = 1 map is a restriction of the N = 2 one (see docs/bounds.md)
    heads, _, d = wq.shape
    lead = add_up(mul_up(4.0, phi_inv_upper(n - 1)), inv_sqrt_up(d))
    wo_t_inf = one_norm_upper(wo)  # ||W^{O T}||_inf = ||W^O||_1
    q_term = max(mul_up(inf_norm_upper(wq[h]), one_norm_upper(wq[h])) for h in range(heads))
    v_term = max(one_norm_upper(wv[h]) for h in range(heads))  # ||W^{V,h T}||_inf
    return mul_up(lead, wo_t_inf, q_term, v_term)


def _two_norm_lead(n: int) -> float:
    """`sqrt(N) (4 phi^{-1}(N-1) + 1)`, rounded up; N >= 2."""
    return mul_up(sqrt_up(n), add_up(mul_up(4.0, phi_inv_upper(n - 1)), 1.0))


def _two_norm_weights(wq: ArrayLike, wv: ArrayLike, wo: ArrayLike) -> float:
    """`(1/sqrt(d)) sqrt(sum_h ||W^{Q,h}||_2^4 ||W^{V,h}||_2^2) ||W^O||_2`, rounded up.

    The fourth power is not a typo. The paper (as commonly printed) writes
    `||W^{Q,h}||_2^2` here, but that statement is unsound: scaling W^Q by t scales the map as
    F_t(X) = t G(tX), so its Lipschitz constant grows like t^2 while the stated bound grows like
    t. The proof bounds each head's Jacobian by `sqrt(N) (4 phi^{-1}(N-1) + 1) ||A_h||_2` with
    `A_h = W^{Q,h} W^{Q,h T} / sqrt(d)`, and `||A_h||_2 = ||W^{Q,h}||_2^2 / sqrt(d)`, which gives
    the square of `||W^{Q,h}||_2^2 ||W^{V,h}||_2` under the root. The property test
    (tests/test_bounds_soundness.py) finds counterexamples to the stated form (D = H = 1, N = 2)
    and none to this one.
    """
    heads, _, d = wq.shape
    terms = []
    for h in range(heads):
        sq, sv = spectral_norm_upper(wq[h]), spectral_norm_upper(wv[h])
        terms.append(mul_up(sq, sq, sq, sq, sv, sv))
    return mul_up(inv_sqrt_up(d), sqrt_up(add_up(*terms)), spectral_norm_upper(wo))


def _gamma_up(k: int) -> float:
    """`gamma_k = k u / (1 - k u)` rounded up: the relative error of a k-term dot product."""
    return div_up(mul_up(float(k), U), math.nextafter(1.0 - k * U, 0.0))


def _chain_upper(mats: list[np.ndarray], norm: str) -> float:
    """Upper bound on `||A_1 A_2 ... A_k||` (norm "2": spectral, "1": largest column sum) of
    the exact product, from the float64 product formed left to right.

    `P_j = fl(P_{j-1} A_j)` satisfies `|P_j - P_{j-1} A_j| <= gamma_m |P_{j-1}| |A_j|` (m the
    inner dimension; any summation order, FMA or not). With `nu` the Frobenius norm (for the
    2-norm) or the 1-norm, both absolute and submultiplicative, the exact product `T_j`
    satisfies `nu(P_j - T_j) <= nu(P_{j-1} - T_{j-1}) nu(A_j) + gamma_m nu(P_{j-1}) nu(A_j)`,
    and `||T|| <= ||P_k|| + nu(P_k - T_k)` (spectral <= Frobenius). `_TINY` covers gradual
    underflow. A product that overflows gives inf (the caller then uses another bound).
    """
    nu = frobenius_upper if norm == "2" else one_norm_upper
    top = spectral_norm_upper if norm == "2" else one_norm_upper
    p = mats[0]
    err = 0.0
    for a in mats[1:]:
        na = nu(a)
        err = add_up(mul_up(err, na), mul_up(_gamma_up(a.shape[0]), nu(p), na), _TINY)
        with np.errstate(over="ignore", invalid="ignore"):
            p = p @ a
        if not np.isfinite(p).all():
            return math.inf
    return add_up(top(p), err)


@dataclass(frozen=True)
class _L2Parts:
    """The exact composed matrices of one tied L2-MHA layer, in float64.

    `q[h] = W^Q_h` (D, d); `qv[h] = W^{Q T}_h W^V_h` (d, d), so `M_h = qv[h] / sqrt(d)`;
    `o[h] = W^O_h` (dv, D), the rows of W^O that head h's output meets; `q_all` (D, H d) the
    concatenated query projection."""

    q: list[np.ndarray]
    v: list[np.ndarray]
    o: list[np.ndarray]
    wo: np.ndarray
    q_all: np.ndarray
    d: int

    @staticmethod
    def of(wq: ArrayLike, wv: ArrayLike, wo: ArrayLike) -> _L2Parts:
        q, v, o = _as_float64(wq), _as_float64(wv), _as_float64(wo)
        heads, dim, d = q.shape
        dv = v.shape[-1]  # head h's output (N, dv) meets rows h dv .. (h + 1) dv of W^O
        return _L2Parts([q[h] for h in range(heads)], [v[h] for h in range(heads)],
                        [o[h * dv:(h + 1) * dv] for h in range(heads)], o,
                        np.ascontiguousarray(q.transpose(1, 0, 2).reshape(dim, heads * d)), d)


def g_lipschitz(n: int, norm: str, d: int, causal: bool = False) -> float:
    """Certified Lipschitz constant of `G(Q) = P(Q) Q` on N tokens of dimension d, with
    `P_ij = softmax_j(-||q_i - q_j||^2 / sqrt(d))` (causal: row i over j <= i).

    G is `sqrt(d)` times the one-head L2 attention with identity weights (`A = I / sqrt(d)`),
    so Theorem 3.2 gives `sqrt(N) (4 phi^{-1}(N-1) + 1)` (2-norm; causal: the root sum of
    squares of the prefix values) and `sqrt(d) (4 phi^{-1}(N-1) + 1/sqrt(d))` (inf-norm, for
    causal too: the prefix bounds grow with N). docs/certification.md has the derivation.
    """
    n = max(int(n), 1)
    if norm == "2":
        if not causal:
            return _two_norm_lead(max(n, 2))
        leads = [_two_norm_lead(max(i, 2)) for i in range(1, n + 1)]
        return sqrt_up(add_up(*(mul_up(c, c) for c in leads)))
    if norm == "inf":
        lead = add_up(mul_up(4.0, phi_inv_upper(max(n, 2) - 1)), inv_sqrt_up(d))
        return mul_up(sqrt_up(d), lead)
    raise ValueError(f"unknown norm {norm!r}; use '2' or 'inf'")


def l2_mha_candidates(wq: ArrayLike, wv: ArrayLike, wo: ArrayLike, n: int, norm: str,
                      causal: bool = False) -> dict[str, float]:
    """Every certified bound on the L2-MHA layer's Lipschitz constant, by name.

    `theorem_3_2`: the paper's bound (causal extension included). The others write the layer
    as `F(X) = sum_h G(X W^Q_h) B_h` with `B_h = M_h W^O_h`, `M_h = W^{Q T}_h W^V_h / sqrt(d)`
    and chain `g_lipschitz` through the exact composed matrices (docs/certification.md):
    `per_head` (2: `L ||W^O|| sqrt(sum_h (||W^Q_h|| ||M_h||)^2)`, inf: `L ||W^O||_1 max_h
    ||W^Q_h||_1 ||M_h||_1`; never above theorem_3_2), `concat` (`L ||[W^Q_1..W^Q_H]||
    ||[B_1; ..; B_H]||`) and, in the 2-norm, `head_sum` (`L sum_h ||W^Q_h|| ||B_h||`).
    """
    if norm not in ("2", "inf"):
        raise ValueError(f"unknown norm {norm!r}; use '2' or 'inf'")
    out = {"theorem_3_2": _theorem_3_2(wq, wv, wo, n, norm, causal)}
    parts = _L2Parts.of(wq, wv, wo)
    p = "2" if norm == "2" else "1"
    lip = g_lipschitz(n, norm, parts.d, causal)
    root_d = inv_sqrt_up(parts.d)
    qn = [_norm(a, p) for a in parts.q]
    mn = [mul_up(_chain_upper([a.T, b], p), root_d) for a, b in zip(parts.q, parts.v, strict=True)]
    wo_n = _norm(parts.wo, p)
    if norm == "2":
        bn = [mul_up(_chain_upper([a.T, b, o], p), root_d)
              for a, b, o in zip(parts.q, parts.v, parts.o, strict=True)]
        squares = (mul_up(a, b, a, b) for a, b in zip(qn, mn, strict=True))
        out["per_head"] = mul_up(lip, wo_n, sqrt_up(add_up(*squares)))
        out["head_sum"] = mul_up(lip, add_up(*(mul_up(a, b) for a, b in zip(qn, bn, strict=True))))
    else:
        out["per_head"] = mul_up(lip, wo_n, max(mul_up(a, b) for a, b in zip(qn, mn, strict=True)))
    out["concat"] = mul_up(lip, _norm(parts.q_all, p), _stacked_upper(parts, p))
    return out


def _norm(a: np.ndarray, p: str) -> float:
    return spectral_norm_upper(a) if p == "2" else one_norm_upper(a)


def _stacked_upper(parts: _L2Parts, p: str) -> float:
    """Upper bound on `||[B_1; ..; B_H]||` (Hd, D): the float64 blocks stacked, plus their
    rounding errors (Frobenius: root sum of squares; 1-norm: their sum)."""
    blocks, errs = [], []
    for a, b, o in zip(parts.q, parts.v, parts.o, strict=True):
        qv = a.T @ b  # (d, d)
        blk = qv @ o  # (d, D)
        if not (np.isfinite(qv).all() and np.isfinite(blk).all()):
            return math.inf
        # The same recursion as `_chain_upper`, keeping the error apart from the norm.
        nu = frobenius_upper if p == "2" else one_norm_upper
        e1 = add_up(mul_up(_gamma_up(a.shape[0]), nu(a), nu(b)), _TINY)
        errs.append(add_up(mul_up(e1, nu(o)), mul_up(_gamma_up(o.shape[0]), nu(qv), nu(o)),
                           _TINY))
        blocks.append(blk)
    err = (sqrt_up(add_up(*(mul_up(e, e) for e in errs))) if p == "2" else add_up(*errs))
    return mul_up(add_up(_norm(np.concatenate(blocks, axis=0), p), err), inv_sqrt_up(parts.d))


def _theorem_3_2(wq: ArrayLike, wv: ArrayLike, wo: ArrayLike, n: int, norm: str,
                 causal: bool) -> float:
    """Theorem 3.2 (2-norm corrected, see `_two_norm_weights`): `g_lipschitz`'s lead times
    the weight term, `sqrt(N)/sqrt(d) (4 phi^{-1}(N-1) + 1) sqrt(sum_h ||W^{Q,h}||_2^4
    ||W^{V,h}||_2^2) ||W^O||_2` unmasked."""
    if norm == "inf":
        return l2_mha_inf_bound(wq, wv, wo, n)
    return mul_up(g_lipschitz(n, "2", 1, causal), _two_norm_weights(wq, wv, wo))


def l2_mha_bound(
    wq: ArrayLike, wv: ArrayLike, wo: ArrayLike, n: int, norm: str, causal: bool = False
) -> float:
    """Certified Lipschitz bound of tied L2-MHA: the smallest of `l2_mha_candidates` (each
    one certified, so their minimum is too; never above Theorem 3.2).

    Causal: row i of the output is row i of unmasked attention on the prefix x_1..x_i, so the
    Jacobian's block-row i is a block-row of the prefix map's Jacobian. inf-norm: each scalar
    row sum is at most the prefix bound U_inf(i) <= U_inf(N) (the bound grows with N). 2-norm:
    ||J||_2^2 <= sum_i ||J_i||_2^2 <= sum_i U_2(max(i, 2))^2. The same holds for G, which
    the sharper candidates chain through (docs/certification.md).
    """
    return min(l2_mha_candidates(wq, wv, wo, n, norm, causal).values())


def linear_bound(weight: ArrayLike, norm: str) -> float:
    """Operator norm of the token map `x -> x W^T` for a torch weight (out, in).

    2-norm: largest singular value. inf-norm (row-vector convention): `||W||_inf` of the torch
    weight, i.e. its largest absolute row sum.
    """
    if norm == "2":
        return spectral_norm_upper(weight)
    if norm == "inf":
        return inf_norm_upper(weight)
    raise ValueError(f"unknown norm {norm!r}; use '2' or 'inf'")


def layernorm_bound(gamma: ArrayLike, eps: float, norm: str) -> float:
    """`max|gamma| / sqrt(eps)` (2-norm) and `max|gamma| (D^2 - 2) / D / sqrt(eps)` (inf-norm).

    For D = 1 the output is the constant beta, so the constant is 0.
    """
    g = np.abs(_as_float64(gamma))
    if not eps > 0:
        raise ValueError("LayerNorm with eps <= 0 is not Lipschitz")
    dim = g.size
    if dim <= 1:
        return 0.0
    gmax = float(g.max())
    base = mul_up(gmax, inv_sqrt_up(eps))
    if norm == "2":
        return base
    if norm == "inf":
        return mul_up(base, div_up(dim * dim - 2, dim))
    raise ValueError(f"unknown norm {norm!r}; use '2' or 'inf'")




@dataclass(frozen=True)
class _DpNorms:
    """Certified spectral norms of one DP-MHA layer's matrices, each computed once."""

    q: list[float]
    k: list[float]
    v: list[float]
    o: float

    @staticmethod
    def of(wq: ArrayLike, wk: ArrayLike, wv: ArrayLike, wo: ArrayLike) -> _DpNorms:
        heads = wq.shape[0]
        return _DpNorms([spectral_norm_upper(wq[h]) for h in range(heads)],
                        [spectral_norm_upper(wk[h]) for h in range(heads)],
                        [spectral_norm_upper(wv[h]) for h in range(heads)],
                        spectral_norm_upper(wo))


def _dp_head_terms(norms: _DpNorms, n: int, radius: float, scale: float,
                   bq: ArrayLike | None, bk: ArrayLike | None, replaced: bool) -> list[float]:
    """Per-head `sqrt(N)||W^V|| + s (||W^V|| R) ||W^K|| (R ||W^Q|| + sqrt(N) Qmax)`,
    `Qmax = R ||W^Q|| + ||b^Q||` (docs/bounds.md, "Dot-product attention on a ball"); with
    logits replaced by constants on a fixed set of entries, `sqrt(N)||W^V|| + s (||W^V|| R)
    (||W^Q|| Kmax + sqrt(N) Qmax ||W^K||)`, `Kmax = R ||W^K|| + ||b^K||` (docs/bounds.md,
    "Logits replaced by a constant")."""
    heads = len(norms.q)
    root_n = sqrt_up(n)
    terms = []
    for h in range(heads):
        sq, sk, sv = norms.q[h], norms.k[h], norms.v[h]
        bq_norm = 0.0 if bq is None else frobenius_upper(_head_bias(bq, h, heads))
        q_max = add_up(mul_up(sq, radius), bq_norm)
        sigma_v = mul_up(sv, radius)
        if replaced:
            bk_norm = 0.0 if bk is None else frobenius_upper(_head_bias(bk, h, heads))
            k_max = add_up(mul_up(sk, radius), bk_norm)
            logit = mul_up(scale, sigma_v, add_up(mul_up(sq, k_max), mul_up(root_n, q_max, sk)))
        else:
            logit = mul_up(scale, sigma_v, sk, add_up(mul_up(radius, sq), mul_up(root_n, q_max)))
        terms.append(add_up(mul_up(root_n, sv), logit))
    return terms


def _head_bias(b: ArrayLike, h: int, heads: int) -> np.ndarray:
    return _as_float64(b).reshape(heads, -1)[h]


def dp_mha_ball(wq: ArrayLike, wk: ArrayLike, wv: ArrayLike, wo: ArrayLike, n: int,
                radius: float, norm: str, scale: float | None = None,
                bq: ArrayLike | None = None, bv: ArrayLike | None = None,
                bo: ArrayLike | None = None, bk: ArrayLike | None = None,
                replaced: bool = False) -> tuple[float, float]:
    """(`dp_mha_radius_bound`, `dp_mha_out_radius`) of one layer, every weight's spectral
    norm computed once for both."""
    _check_radius(radius)
    norms = _DpNorms.of(wq, wk, wv, wo)
    return (_dp_lip(norms, wq.shape, n, radius, norm, scale, bq, bk, replaced),
            _dp_out_radius(norms.v, norms.o, radius, bv, bo))


def _check_radius(radius: float) -> None:
    if not radius >= 0 or not math.isfinite(radius):
        raise ValueError(f"radius must be finite and >= 0, got {radius}")


def dp_mha_radius_bound(wq: ArrayLike, wk: ArrayLike, wv: ArrayLike, wo: ArrayLike, n: int,
                        radius: float, norm: str, scale: float | None = None,
                        bq: ArrayLike | None = None, bk: ArrayLike | None = None,
                        replaced: bool = False) -> float:
    """Certified Lipschitz bound of dot-product MHA on `{X : ||x_i||_2 <= R for every i}`.

    Per head, logits `s (x_i W^Q_h + b^Q_h).(x_j W^K_h + b^K_h)` (any constant additive mask,
    causal included, and any key bias), values `x_j W^V_h + b^V_h`; output
    `[f^1, ..., f^H] W^O + b^O`. With `J_h` from `_dp_head_terms`:
    `Lip_2 <= ||W^O||_2 sqrt(sum_h J_h^2)` and `Lip_inf <= sqrt(N D) Lip_2`.
    Weights (H, D, d) and `W^O` (D, D) in the row-vector convention; `scale` defaults to
    1/sqrt(d). `replaced`: some logits are replaced by input-independent constants
    (`masked_fill` with a finite value) on a fixed set of entries; the key bias `bk` then
    counts (`_dp_head_terms`). Derivation: docs/bounds.md.
    """
    _check_radius(radius)
    return _dp_lip(_DpNorms.of(wq, wk, wv, wo), wq.shape, n, radius, norm, scale, bq, bk,
                   replaced)


def _dp_lip(norms: _DpNorms, shape: tuple[int, ...], n: int, radius: float, norm: str,
            scale: float | None, bq: ArrayLike | None, bk: ArrayLike | None = None,
            replaced: bool = False) -> float:
    heads, dim, d = shape
    s = inv_sqrt_up(d) if scale is None else abs(float(scale))
    terms = _dp_head_terms(norms, max(int(n), 1), float(radius), s, bq, bk, replaced)
    lip2 = mul_up(norms.o, sqrt_up(add_up(*(mul_up(t, t) for t in terms))))
    if norm == "2":
        return lip2
    if norm == "inf":
        return mul_up(sqrt_up(mul_up(float(n), float(dim))), lip2)
    raise ValueError(f"unknown norm {norm!r}; use '2' or 'inf'")


def dp_mha_out_radius(wv: ArrayLike, wo: ArrayLike, radius: float,
                      bv: ArrayLike | None = None, bo: ArrayLike | None = None) -> float:
    """Token 2-norm bound of the DP-MHA output: each head's row is a convex combination of
    values, so `||f^h_i|| <= R ||W^V_h||_2 + ||b^V_h||`; then the output projection."""
    return _dp_out_radius([spectral_norm_upper(wv[h]) for h in range(wv.shape[0])],
                          spectral_norm_upper(wo), radius, bv, bo)


def _dp_out_radius(v_norms: list[float], o_norm: float, radius: float, bv: ArrayLike | None,
                   bo: ArrayLike | None) -> float:
    heads = len(v_norms)
    per_head = []
    for h in range(heads):
        vmax = add_up(mul_up(v_norms[h], radius),
                      0.0 if bv is None else frobenius_upper(_head_bias(bv, h, heads)))
        per_head.append(mul_up(vmax, vmax))
    out = mul_up(o_norm, sqrt_up(add_up(*per_head)))
    return add_up(out, 0.0 if bo is None else frobenius_upper(bo))
