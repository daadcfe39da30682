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


def l2_mha_two_bound(wq: ArrayLike, wv: ArrayLike, wo: ArrayLike, n: int) -> float:
    """Theorem 3.2, 2-norm, unmasked, N >= 2 (corrected, see `_two_norm_weights`):
    `sqrt(N)/sqrt(d) (4 phi^{-1}(N-1) + 1)
    sqrt(sum_h ||W^{Q,h}||_2^4 ||W^{V,h}||_2^2) ||W^O||_2`."""
    return mul_up(_two_norm_lead(max(int(n), 2)), _two_norm_weights(wq, wv, wo))


def l2_mha_bound(
    wq: ArrayLike, wv: ArrayLike, wo: ArrayLike, n: int, norm: str, causal: bool = False
) -> float:
    """Theorem 3.2, with the causal (masked) extension of docs/bounds.md.

    Causal: row i of the output is row i of unmasked attention on the prefix x_1..x_i, so the
    Jacobian's block-row i is a block-row of the prefix map's Jacobian. inf-norm: each scalar
    row sum is at most the prefix bound U_inf(i) <= U_inf(N) (the bound grows with N). 2-norm:
    ||J||_2^2 <= sum_i ||J_i||_2^2 <= sum_i U_2(max(i, 2))^2.
    """
    if norm == "inf":
        return l2_mha_inf_bound(wq, wv, wo, n)
    if norm != "2":
        raise ValueError(f"unknown norm {norm!r}; use '2' or 'inf'")
    if not causal:
        return l2_mha_two_bound(wq, wv, wo, n)
    leads = [_two_norm_lead(max(i, 2)) for i in range(1, int(n) + 1)]
    total = add_up(*(mul_up(c, c) for c in leads))
    return mul_up(sqrt_up(total), _two_norm_weights(wq, wv, wo))


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
    g = np.abs(np.asarray(gamma.detach().double().cpu() if isinstance(gamma, torch.Tensor)
                          else gamma, dtype=np.float64))
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
                   bq: ArrayLike | None) -> list[float]:
    """Per-head `sqrt(N)||W^V|| + s (||W^V|| R) ||W^K|| (R ||W^Q|| + sqrt(N) Qmax)`,
    `Qmax = R ||W^Q|| + ||b^Q||` (docs/bounds.md, "Dot-product attention on a ball")."""
    heads = len(norms.q)
    root_n = sqrt_up(n)
    terms = []
    for h in range(heads):
        sq, sk, sv = norms.q[h], norms.k[h], norms.v[h]
        bq_norm = 0.0 if bq is None else frobenius_upper(_head_bias(bq, h, heads))
        q_max = add_up(mul_up(sq, radius), bq_norm)
        sigma_v = mul_up(sv, radius)
        logit = mul_up(scale, sigma_v, sk, add_up(mul_up(radius, sq), mul_up(root_n, q_max)))
        terms.append(add_up(mul_up(root_n, sv), logit))
    return terms


def _head_bias(b: ArrayLike, h: int, heads: int) -> np.ndarray:
    arr = np.asarray(b.detach().double().cpu() if isinstance(b, torch.Tensor) else b,
                     dtype=np.float64)
    return arr.reshape(heads, -1)[h]


def dp_mha_ball(wq: ArrayLike, wk: ArrayLike, wv: ArrayLike, wo: ArrayLike, n: int,
                radius: float, norm: str, scale: float | None = None,
                bq: ArrayLike | None = None, bv: ArrayLike | None = None,
                bo: ArrayLike | None = None) -> tuple[float, float]:
    """(`dp_mha_radius_bound`, `dp_mha_out_radius`) of one layer, every weight's spectral
    norm computed once for both."""
    _check_radius(radius)
    norms = _DpNorms.of(wq, wk, wv, wo)
    return (_dp_lip(norms, wq.shape, n, radius, norm, scale, bq),
            _dp_out_radius(norms.v, norms.o, radius, bv, bo))


def _check_radius(radius: float) -> None:
    if not radius >= 0 or not math.isfinite(radius):
        raise ValueError(f"radius must be finite and >= 0, got {radius}")


def dp_mha_radius_bound(wq: ArrayLike, wk: ArrayLike, wv: ArrayLike, wo: ArrayLike, n: int,
                        radius: float, norm: str, scale: float | None = None,
                        bq: ArrayLike | None = None) -> float:
    """Certified Lipschitz bound of dot-product MHA on `{X : ||x_i||_2 <= R for every i}`.

    Per head, logits `s (x_i W^Q_h + b^Q_h).(x_j W^K_h + b^K_h)` (any constant additive mask,
    causal included, and any key bias), values `x_j W^V_h + b^V_h`; output
    `[f^1, ..., f^H] W^O + b^O`. With `J_h` from `_dp_head_terms`:
    `Lip_2 <= ||W^O||_2 sqrt(sum_h J_h^2)` and `Lip_inf <= sqrt(N D) Lip_2`.
    Weights (H, D, d) and `W^O` (D, D) in the row-vector convention; `scale` defaults to
    1/sqrt(d). Derivation: docs/bounds.md.
    """
    _check_radius(radius)
    return _dp_lip(_DpNorms.of(wq, wk, wv, wo), wq.shape, n, radius, norm, scale, bq)


def _dp_lip(norms: _DpNorms, shape: tuple[int, ...], n: int, radius: float, norm: str,
            scale: float | None, bq: ArrayLike | None) -> float:
    heads, dim, d = shape
    s = inv_sqrt_up(d) if scale is None else abs(float(scale))
    terms = _dp_head_terms(norms, max(int(n), 1), float(radius), s, bq)
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
    return add_up(out, 0.0 if bo is None else frobenius_upper(
        np.asarray(bo.detach().double().cpu() if isinstance(bo, torch.Tensor) else bo)))
