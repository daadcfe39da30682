"""The certified formulas of science.md on raw float64 weights.

Shared by the native-model rules and the ONNX rules, so a model gets the same number whichever
way it arrives. Weights are in the paper's row-vector convention: per-head matrices
`W^{Q,h}, W^{V,h}` of shape (H, D, d) and `W^O` of shape (D, D).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .numerics import (
    add_up,
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
    """`(1/sqrt(d)) sqrt(sum_h ||W^{Q,h}||_2^2 ||W^{V,h}||_2^2) ||W^O||_2`, rounded up."""
    heads, _, d = wq.shape
    terms = []
    for h in range(heads):
        sq, sv = spectral_norm_upper(wq[h]), spectral_norm_upper(wv[h])
        terms.append(mul_up(sq, sq, sv, sv))
    return mul_up(inv_sqrt_up(d), sqrt_up(add_up(*terms)), spectral_norm_upper(wo))


def l2_mha_two_bound(wq: ArrayLike, wv: ArrayLike, wo: ArrayLike, n: int) -> float:
    """Theorem 3.2, 2-norm, unmasked, N >= 2:
    `sqrt(N)/sqrt(d) (4 phi^{-1}(N-1) + 1) sqrt(sum_h ||W^{Q,h}||_2^2 ||W^{V,h}||_2^2) ||W^O||_2`."""
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
        return mul_up(base, up_ratio(dim * dim - 2, dim))
    raise ValueError(f"unknown norm {norm!r}; use '2' or 'inf'")


def up_ratio(a: float, b: float) -> float:
    return math.nextafter(a / b, math.inf)
