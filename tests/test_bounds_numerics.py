"""The certified matrix norms: never below numpy's SVD, within 1e-9 of it, on every branch.

`spectral_norm_upper` takes LAPACK's eigensolver for small Gram matrices and a Lanczos estimate
certified by a Cholesky factorisation for large ones, widening the shift when the estimate is
short and falling back to the eigensolver when no shift certifies.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lsa_models.bounds import numerics
from lsa_models.bounds.numerics import frobenius_upper, spectral_norm_upper

REL = 1e-9


def _sigma(w: np.ndarray) -> float:
    return float(np.linalg.svd(w, compute_uv=False)[0])


def _with_singular_values(s: np.ndarray, m: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.standard_normal((m, len(s))))
    v, _ = np.linalg.qr(rng.standard_normal((n, len(s))))
    return (u * s) @ v.T  # (m, n)


def _assert_tight_above(bound: float, exact: float, rel: float = REL) -> None:
    assert bound >= exact
    assert bound <= exact * (1 + rel)


@pytest.mark.parametrize("shape", [(300, 300), (768, 256), (256, 1000), (3072, 768)])
def test_spectral_norm_upper_cholesky_path_is_above_svd_and_tight(
        shape: tuple[int, int]) -> None:
    assert min(shape) >= numerics._CHOLESKY_MIN
    w = np.random.default_rng(sum(shape)).normal(size=shape)
    _assert_tight_above(spectral_norm_upper(w), _sigma(w))


def test_spectral_norm_upper_takes_the_transposed_layout_too() -> None:
    w = np.random.default_rng(3).normal(size=(512, 300)).T  # Fortran-ordered view
    _assert_tight_above(spectral_norm_upper(w), _sigma(w))
    assert spectral_norm_upper(w) == spectral_norm_upper(np.ascontiguousarray(w))


def test_spectral_norm_upper_with_clustered_top_singular_values() -> None:
    s = np.linspace(0.5, 1.0, 300)
    s[-8:] = 1.0 - np.arange(8) * 1e-13  # eight nearly equal leading values
    w = _with_singular_values(s, 400, 300, seed=4)
    _assert_tight_above(spectral_norm_upper(w), _sigma(w))


def test_spectral_norm_upper_of_a_rank_one_matrix() -> None:
    rng = np.random.default_rng(5)
    w = np.outer(rng.normal(size=400), rng.normal(size=300))
    _assert_tight_above(spectral_norm_upper(w), _sigma(w))


def test_spectral_norm_upper_over_a_huge_dynamic_range() -> None:
    s = np.logspace(-100, 100, 300)
    w = _with_singular_values(s, 300, 300, seed=6)
    _assert_tight_above(spectral_norm_upper(w), _sigma(w))


@pytest.mark.parametrize("shape", [(5, 7), (300, 260)])
@pytest.mark.parametrize("exponent", [-1000, -600, 600])
def test_spectral_norm_upper_of_extreme_weights_is_scaled_not_rounded_or_overflowed(
        shape: tuple[int, int], exponent: int) -> None:
    """Squares of 2^-600 entries vanish and of 2^600 ones overflow: scaled first, the bound
    stays tight."""
    base = np.random.default_rng(7).normal(size=shape)
    w = base * math.ldexp(1.0, exponent)  # exact: every entry stays a normal number
    exact = math.ldexp(_sigma(base), exponent)
    assert 0 < exact < math.inf
    _assert_tight_above(spectral_norm_upper(w), exact)
    _assert_tight_above(frobenius_upper(w), math.ldexp(float(np.linalg.norm(base)), exponent))


def test_spectral_norm_upper_rejects_nan_and_infinity() -> None:
    for bad in (math.nan, math.inf):
        w = np.ones((300, 300))
        w[3, 4] = bad
        with pytest.raises(ValueError, match="NaN or infinity"):
            spectral_norm_upper(w)
        with pytest.raises(ValueError, match="NaN or infinity"):
            frobenius_upper(w)


def test_spectral_norm_upper_of_zero_and_empty_matrices_is_zero() -> None:
    assert spectral_norm_upper(np.zeros((300, 300))) == 0.0
    assert spectral_norm_upper(np.zeros((0, 4))) == 0.0
    assert frobenius_upper(np.zeros((0,))) == 0.0
    assert frobenius_upper(np.zeros((3,))) == 0.0  # no underflow allowance without entries


def _spy_cholesky(monkeypatch: pytest.MonkeyPatch) -> list[float | None]:
    calls: list[float | None] = []
    real = numerics._cholesky_certifies

    def spy(g: np.ndarray, mu: float) -> float | None:
        out = real(g, mu)
        calls.append(out)
        return out

    monkeypatch.setattr(numerics, "_cholesky_certifies", spy)
    return calls


def test_spectral_norm_upper_widens_the_shift_when_the_estimate_is_short(
        monkeypatch: pytest.MonkeyPatch) -> None:
    w = np.random.default_rng(8).normal(size=(400, 300))
    lam = _sigma(w) ** 2
    monkeypatch.setattr(numerics, "_lanczos_top", lambda g: lam * (1 - 1e-7))
    calls = _spy_cholesky(monkeypatch)
    bound = spectral_norm_upper(w)
    # 1e-11 and 1e-8 above the short estimate are still below lambda_max: no certificate
    assert calls[:2] == [None, None] and calls[2] is not None and len(calls) == 3
    _assert_tight_above(bound, _sigma(w), rel=1e-5)


def test_spectral_norm_upper_falls_back_to_the_eigensolver(
        monkeypatch: pytest.MonkeyPatch) -> None:
    w = np.random.default_rng(9).normal(size=(400, 300))
    lam = _sigma(w) ** 2
    monkeypatch.setattr(numerics, "_lanczos_top", lambda g: lam * 0.5)
    calls = _spy_cholesky(monkeypatch)
    bound = spectral_norm_upper(w)
    assert calls == [None] * len(numerics._SHIFTS)
    _assert_tight_above(bound, _sigma(w))


def test_spectral_norm_upper_falls_back_when_the_estimate_is_not_positive(
        monkeypatch: pytest.MonkeyPatch) -> None:
    w = np.random.default_rng(10).normal(size=(300, 300))
    monkeypatch.setattr(numerics, "_lanczos_top", lambda g: 0.0)
    calls = _spy_cholesky(monkeypatch)
    _assert_tight_above(spectral_norm_upper(w), _sigma(w))
    assert calls == []


def test_cholesky_certificate_refuses_a_shift_below_the_top_eigenvalue() -> None:
    w = np.random.default_rng(11).normal(size=(300, 280))
    g = w.T @ w
    lam = float(np.linalg.eigvalsh(g)[-1])
    assert numerics._cholesky_certifies(g, lam * (1 - 1e-6)) is None
    certified = numerics._cholesky_certifies(g, lam * (1 + 1e-9))
    assert certified is not None and lam <= certified <= lam * (1 + 1e-8)


def test_lanczos_estimate_is_close_to_the_top_eigenvalue() -> None:
    w = np.random.default_rng(12).normal(size=(700, 500))
    g = w.T @ w
    lam = float(np.linalg.eigvalsh(g)[-1])
    assert numerics._lanczos_top(g) == pytest.approx(lam, rel=1e-11)


def test_frobenius_upper_is_above_numpy_and_tight_in_any_layout() -> None:
    w = np.random.default_rng(13).normal(size=(64, 96))
    for a in (w, w.T, w[::2, ::3]):
        _assert_tight_above(frobenius_upper(a), float(np.linalg.norm(a)))


@settings(deadline=None)
@given(m=st.integers(256, 320), n=st.integers(256, 320), seed=st.integers(0, 2**31 - 1),
       log_scale=st.integers(-30, 30), decay=st.floats(0.0, 3.0))
def test_spectral_norm_upper_is_never_below_the_largest_singular_value(
        m: int, n: int, seed: int, log_scale: int, decay: float) -> None:
    """The Jacobian of x -> W x is W: hunt for a W whose norm exceeds its certificate."""
    rng = np.random.default_rng(seed)
    k = min(m, n)
    s = math.ldexp(1.0, log_scale) * np.exp(-decay * rng.random(k) * 10)
    w = _with_singular_values(s, m, n, seed)
    assert spectral_norm_upper(w) >= _sigma(w)
