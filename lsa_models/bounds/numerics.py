"""Floating-point arithmetic that rounds upward, so a certified bound is never below the truth.

Every quantity here is a non-negative upper bound. Each elementary float64 operation is
correctly rounded (IEEE 754), so stepping its result one ulp towards +inf (`math.nextafter`)
gives a number >= the exact result. Matrix norms computed by LAPACK/BLAS carry a bounded
backward error; we add an explicit relative margin for it (documented per function).
"""

from __future__ import annotations

import math

import numpy as np
import torch

U = 2.0**-53  # unit roundoff of float64


def up(x: float) -> float:
    return math.nextafter(float(x), math.inf)


def mul_up(*xs: float) -> float:
    out = 1.0
    for x in xs:
        if x < 0:
            raise ValueError("mul_up works on non-negative bounds only")
        out = up(out * x)
    return out


def add_up(*xs: float) -> float:
    out = 0.0
    for x in xs:
        out = up(out + x)
    return out


def div_up(a: float, b: float) -> float:
    if b <= 0 or a < 0:
        raise ValueError("div_up works on a >= 0, b > 0")
    return up(a / b)


def sqrt_up(x: float) -> float:
    return up(math.sqrt(x))


def inv_sqrt_up(x: float) -> float:
    """An upper bound on 1/sqrt(x), x > 0: sqrt rounded down, then the division rounded up."""
    lo = math.nextafter(math.sqrt(x), 0.0)
    return div_up(1.0, lo)


def _as_float64(w: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(w, torch.Tensor):
        w = w.detach().to(device="cpu", dtype=torch.float64).numpy()
    # float32/bfloat16/float16 -> float64 is exact.
    return np.asarray(w, dtype=np.float64)


def _sum_margin(n: int) -> float:
    """Relative bound on the rounding error of a float64 sum of n non-negative terms, with slack."""
    return 1.0 + 2.0 * (n + 1) * U


def inf_norm_upper(w: torch.Tensor | np.ndarray) -> float:
    """Upper bound on ||W||_inf = max_i sum_j |W_ij| (largest absolute row sum)."""
    a = np.abs(_as_float64(w))
    if a.size == 0:
        return 0.0
    if a.ndim == 1:
        a = a[None, :]
    return mul_up(float(a.sum(axis=1).max()), _sum_margin(a.shape[1]))


def one_norm_upper(w: torch.Tensor | np.ndarray) -> float:
    """Upper bound on ||W||_1 = ||W^T||_inf (largest absolute column sum)."""
    return inf_norm_upper(_as_float64(w).T)


def frobenius_upper(w: torch.Tensor | np.ndarray) -> float:
    a = _as_float64(w)
    sq = float(np.square(a).sum())
    return sqrt_up(mul_up(sq, _sum_margin(a.size) + 2 * U))


def spectral_norm_upper(w: torch.Tensor | np.ndarray) -> float:
    """Certified upper bound on the largest singular value of W.

    Method: form the Gram matrix G = W^T W (the smaller side) in float64 and take its largest
    eigenvalue with LAPACK's symmetric solver. Two error sources, both bounded and added:
    - forming G: |fl(G) - G| <= gamma_n |W|^T |W| elementwise (gamma_n = n u / (1 - n u)),
      so ||fl(G) - G||_2 <= gamma_n ||W||_F^2;
    - the eigensolver is backward stable: the computed eigenvalue is exact for fl(G) + E with
      ||E||_2 <= p(n) u ||fl(G)||_2; we take p(n) = 64 n, far above LAPACK's bound.
    Weyl's inequality then gives lambda_max(G) <= lam_hat + 64 n u |lam_hat| + gamma_n ||W||_F^2,
    and sigma_max = sqrt(lambda_max(G)). The result is also capped by ||W||_F, itself a bound.
    """
    a = _as_float64(w)
    if a.ndim != 2:
        raise ValueError(f"spectral_norm_upper needs a matrix, got shape {a.shape}")
    if a.size == 0 or not np.any(a):
        return 0.0
    if not np.all(np.isfinite(a)):
        raise ValueError("weights contain NaN or infinity: no finite bound exists")
    m, n = a.shape
    g = a.T @ a if n <= m else a @ a.T  # (k, k), k = min(m, n)
    k = g.shape[0]
    inner = max(m, n)
    lam = float(np.linalg.eigvalsh(g)[-1])
    fro = frobenius_upper(a)
    gamma = (inner * U) / (1.0 - inner * U)
    form_err = mul_up(gamma, fro, fro)
    eig_err = mul_up(64.0 * k * U, abs(lam))
    lam_up = add_up(max(lam, 0.0), eig_err, form_err)
    return min(sqrt_up(lam_up), fro)


def lambert_w0_upper(x: float) -> float:
    """Upper bound on the principal branch W0(x) for x >= 0, i.e. the w >= 0 with w e^w = x.

    Halley's iteration gives w to a few ulps; then w is pushed up until the float64 value of
    w e^w, reduced by a 4-ulp allowance for the rounding of exp and the product, is still
    >= x. Since w e^w is increasing on [0, inf), that certifies w >= W0(x).
    """
    if x < 0 or not math.isfinite(x):
        raise ValueError(f"lambert_w0_upper needs a finite x >= 0, got {x}")
    if x == 0:
        return 0.0
    w = math.log1p(x) if x < 3 else math.log(x) - math.log(math.log(x))
    w = max(w, 0.0)
    for _ in range(100):
        ew = math.exp(w)
        f = w * ew - x
        fp = ew * (w + 1.0)
        step = f / (fp - (w + 2.0) * f / (2.0 * w + 2.0))
        w_new = max(w - step, 0.0)
        if abs(w_new - w) <= 4 * U * max(1.0, abs(w)):
            w = w_new
            break
        w = w_new
    w = up(w)
    while w * math.exp(w) * (1.0 - 8 * U) < x:
        w = up(w + 2 * U * w)
    return w


def phi_inv_upper(n_minus_1: float) -> float:
    """Upper bound on phi^{-1}(N - 1) = W0((N - 1)/e), phi(x) = x e^{x+1}.

    math.e is below the true e, so (N-1)/math.e rounded up is above (N-1)/e, and W0 is
    increasing.
    """
    if n_minus_1 < 0:
        raise ValueError("N must be >= 1")
    return lambert_w0_upper(up(n_minus_1 / math.e))


# sup_x |d/dx GELU(x)| = Phi(sqrt 2) + sqrt 2 phi(sqrt 2) = 1.12897..., rounded up generously.
GELU_LIPSCHITZ = 1.1290
ACTIVATION_LIPSCHITZ: dict[str, float] = {
    "relu": 1.0,
    "tanh": 1.0,
    "sigmoid": 0.25,
    "gelu": GELU_LIPSCHITZ,
}
