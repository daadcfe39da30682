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


# Underflow (gradual, to subnormals) adds an absolute error of at most 2^-1074 per operation;
# every bound below performs far fewer than 2^74 operations per quantity, so this absolute
# allowance covers all of them together.
_TINY = 2.0**-1000
# Matrices whose largest entry lies outside [2^-400, 2^400] are scaled by a power of two
# first, so squares neither overflow nor vanish next to the absolute allowance.
_SMALL = 2.0**-400
_LARGE = 2.0**400


def _sum_sq(v: np.ndarray) -> float:
    """Upper bound on sum(v**2): one BLAS dot (no temporary), any summation order, FMA or not:
    |error| <= gamma_n sum(v**2), within `_sum_margin(n) + 2u`."""
    flat = v.ravel(order="K")  # a view for any contiguous layout, C or Fortran
    sq = float(np.dot(flat, flat))
    return add_up(mul_up(sq, _sum_margin(flat.size) + 2 * U), _TINY)


def _peak(a: np.ndarray) -> float:
    """max |a_ij| without a temporary array (large temporaries cost page faults); NaN or inf
    anywhere raises."""
    lo, hi = float(a.min()), float(a.max())  # NaN propagates through min/max
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError("weights contain NaN or infinity: no finite bound exists")
    return max(hi, -lo)


def _pow2_scale(a: np.ndarray, peak: float) -> tuple[np.ndarray, int]:
    """(a 2^-e, e) with the peak of a 2^-e in [0.5, 1) when the peak is out of range, else
    (a, 0). Scaling up is exact; scaling down may round entries that become subnormal, by at
    most 2^-1075 each, which moves any of our norms by less than `_TINY` (added by callers)."""
    if peak == 0.0 or _SMALL <= peak <= _LARGE:
        return a, 0
    e = math.frexp(peak)[1]
    half = e // 2  # two steps: 2^-e alone can overflow for subnormal peaks
    return a * math.ldexp(1.0, -half) * math.ldexp(1.0, half - e), e


def _unscale(x: float, e: int) -> float:
    """An upper bound on x 2^e (exact unless it under- or overflows)."""
    return x if e == 0 else up(math.ldexp(x, e))


def frobenius_upper(w: torch.Tensor | np.ndarray) -> float:
    a = _as_float64(w)
    if a.size == 0:
        return 0.0
    peak = _peak(a)
    if peak == 0.0:
        return 0.0
    a, e = _pow2_scale(a, peak)
    return _unscale(add_up(sqrt_up(_sum_sq(a)), _TINY), e)


# Below this Gram size LAPACK's full symmetric eigensolver is cheap (< 2 ms); above it the
# certificate is one Cholesky factorisation (k^3/3 flops instead of ~4k^3/3).
_CHOLESKY_MIN = 256
# Relative shifts above the Lanczos estimate tried in turn before falling back to eigvalsh.
_SHIFTS = (1e-11, 1e-8, 1e-5, 1e-2)


def spectral_norm_upper(w: torch.Tensor | np.ndarray) -> float:
    """Certified upper bound on the largest singular value of W.

    Form the Gram matrix G = W^T W (the smaller side, k x k) in float64:
    |fl(G) - G| <= gamma_n |W|^T |W| elementwise (n the inner dimension), so
    ||fl(G) - G||_2 <= gamma_n ||W||_F^2. Then bound lambda_max(fl(G)) (`_gram_lambda_upper`),
    add the forming error, take the square root rounded up, and cap by ||W||_F.
    Matrices with extreme entries are scaled by a power of two first; underflow is covered
    by `_TINY`.
    """
    a = _as_float64(w)
    if a.ndim != 2:
        raise ValueError(f"spectral_norm_upper needs a matrix, got shape {a.shape}")
    peak = 0.0 if a.size == 0 else _peak(a)
    if peak == 0.0:
        return 0.0
    a, e = _pow2_scale(a, peak)
    m, n = a.shape
    g = a.T @ a if n <= m else a @ a.T  # (k, k), k = min(m, n)
    inner = max(m, n)
    fro_sq = _sum_sq(a)
    gamma = (inner * U) / (1.0 - inner * U)
    form_err = add_up(mul_up(gamma, fro_sq), _TINY)
    lam_up = add_up(_gram_lambda_upper(g), form_err)
    return _unscale(add_up(min(sqrt_up(lam_up), sqrt_up(fro_sq)), _TINY), e)


def _gram_lambda_upper(g: np.ndarray) -> float:
    """Upper bound on the largest eigenvalue of the symmetric matrix held in g's lower
    triangle (what LAPACK reads). Small k: `_eigvalsh_upper`; larger k: a Lanczos estimate
    lam, then the certificate `mu I - g` positive definite for mu slightly above lam
    (`_cholesky_certifies`), widening the shift when the estimate was short."""
    k = g.shape[0]
    if k >= _CHOLESKY_MIN:
        lam = _lanczos_top(g)
        if lam > 0:
            for shift in _SHIFTS:
                mu = up(lam * (1.0 + shift))
                bound = _cholesky_certifies(g, mu)
                if bound is not None:
                    return bound
    return _eigvalsh_upper(g)


def _eigvalsh_upper(g: np.ndarray) -> float:
    """LAPACK's symmetric eigensolver is backward stable: the computed eigenvalue is exact for
    g + E with ||E||_2 <= p(k) u ||g||_2; we take p(k) = 64 k, far above LAPACK's bound, and
    Weyl's inequality gives lambda_max(g) <= lam + 64 k u |lam|."""
    k = g.shape[0]
    lam = float(np.linalg.eigvalsh(g)[-1])
    return add_up(max(lam, 0.0), mul_up(64.0 * k * U, abs(lam)), _TINY)


def _lanczos_top(g: np.ndarray, max_steps: int = 160, tol: float = 1e-14) -> float:
    """Estimate of lambda_max(g) by Lanczos with full reorthogonalisation from a fixed random
    start. Only an estimate: soundness comes from the Cholesky certificate, never from here."""
    k = g.shape[0]
    steps = min(max_steps, k)
    start = np.asarray(np.random.default_rng(0).standard_normal(k))
    q = start / float(np.linalg.norm(start))
    basis = np.empty((steps, k))
    alphas: list[float] = []
    betas: list[float] = []
    prev = math.nan
    for j in range(steps):
        basis[j] = q
        r = g @ q
        alphas.append(float(q @ r))
        r -= basis[: j + 1].T @ (basis[: j + 1] @ r)  # full reorthogonalisation, twice:
        r -= basis[: j + 1].T @ (basis[: j + 1] @ r)  # keeps the basis orthogonal to ~u
        peak = float(np.max(np.abs(r)))
        beta = peak * float(np.linalg.norm(r / peak)) if peak > 0 else 0.0  # no overflow
        if (j + 1) % 10 == 0 or beta == 0.0 or j + 1 == steps:
            t = np.diag(alphas) + np.diag(betas, 1) + np.diag(betas, -1)
            top = float(np.linalg.eigvalsh(t)[-1])
            if beta == 0.0 or abs(top - prev) <= tol * abs(top):
                return top
            prev = top
        betas.append(beta)
        q = r / beta
    return prev


def _cholesky_certifies(g: np.ndarray, mu: float) -> float | None:
    """An upper bound on lambda_max(g) from a successful Cholesky factorisation of
    A = fl(mu I - g), or None when it breaks down.

    Forming A: off-diagonal entries are exact negations; each diagonal entry is rounded once,
    A = mu I - g + D with |D_ii| <= u |A_ii|. Cholesky runs to completion only on a matrix it
    treats as positive definite, and its computed factor satisfies R^T R = A + dA with
    |dA| <= gamma_c |R|^T |R| (Higham, Accuracy and Stability, Thm 10.3, for any order of the
    inner products; we take c = 4k + 8 to cover LAPACK's blocked variant and its triangular
    solves by reciprocal). R^T R is positive semidefinite, so lambda_min(A) >= -||dA||_2 and
    ||dA||_2 <= gamma_c || |R|^T |R| ||_inf (the 2-norm of a nonnegative symmetric matrix is
    at most its largest row sum). Hence
    lambda_max(g) <= mu + max |D_ii| + gamma_c || |R|^T |R| ||_inf.
    """
    k = g.shape[0]
    a = -g
    a[np.diag_indices(k)] += mu
    try:
        r = np.linalg.cholesky(a)  # lower: A = L L^T, L = R^T
    except np.linalg.LinAlgError:
        return None
    if not np.all(np.isfinite(r)):
        return None
    diag_err = mul_up(2 * U, float(np.max(np.abs(np.diagonal(a)))))
    absr = np.abs(r)  # (k, k), |L|
    # || |L| |L|^T ||_inf = max row of |L| (|L|^T 1): two products of nonnegative numbers,
    # each with relative error <= gamma_k (two of them within _sum_margin(2k))
    row = float(np.max(absr @ (absr.T @ np.ones(k))))
    rr = mul_up(row, _sum_margin(2 * k))
    c = 4 * k + 8
    gamma_c = (c * U) / (1.0 - c * U)
    return add_up(mu, diag_err, mul_up(gamma_c, rr), _TINY)


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


# sup_x |d/dx GELU(x)| = Phi(sqrt 2) + sqrt 2 phi(sqrt 2) = 1.128904... (exact GELU) and
# 1.128993... for the tanh approximation (GPT-2's): one constant above both.
GELU_LIPSCHITZ = 1.1290
# The one table of these factors: the native models' layer graph reads it here and the
# registry's classes (operators/activation.py, global_factor) read theirs from it, since
# operators/ imports bounds/ and so bounds/ cannot read the classes.
ACTIVATION_LIPSCHITZ: dict[str, float] = {
    "relu": 1.0,
    "tanh": 1.0,
    "sigmoid": 0.25,
    "gelu": GELU_LIPSCHITZ,
}
# sup |silu'| = 1.0998393... (at x = 2.39936...; inf silu' = -0.0998393... at -2.39936...),
# rounded up (docs/bounds.md, "Gated MLPs (SwiGLU)"); |silu(x)| <= |x| coordinate-wise.
SILU_LIPSCHITZ = 1.0999
# The activations the layer graph's Activation layers name (SiLU only in recognised ONNX
# composites, so it is not one of the native/contractive activations above).
LAYER_ACTIVATION_LIPSCHITZ: dict[str, float] = {**ACTIVATION_LIPSCHITZ, "silu": SILU_LIPSCHITZ}
