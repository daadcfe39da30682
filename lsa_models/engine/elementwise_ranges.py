"""f' and f over an interval for the local enclosure's elementwise functions
(docs/local-enclosure.md): the activations' from lsa_models/operators/, and the arithmetic
ones (exp, sqrt, reciprocal, x^p with a constant exponent) that LayerNorm, softmax and Pow
chains are made of.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..operators import ModeNotImplemented, by_kind
from ..operators.activation import Activation
from .values import FLOOR, LocalNotCertified

# Relative allowance on derivative values computed with libm/scipy (erf, exp, tanh):
# faithfully rounded to a few ulp; 1e-12 is far above that.
LIBM_REL = 1e-12


def _bell_range(d: Callable[[np.ndarray], np.ndarray], lo: np.ndarray,
                hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Range of an even derivative decreasing in |x| (tanh', sigmoid', erf')."""
    near = np.where((lo <= 0) & (hi >= 0), 0.0, np.minimum(np.abs(lo), np.abs(hi)))
    far = np.maximum(np.abs(lo), np.abs(hi))
    return d(far), d(near)


def _monotone_range(d: Callable[[np.ndarray], np.ndarray], lo: np.ndarray,
                    hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, b = d(lo), d(hi)
    return np.minimum(a, b), np.maximum(a, b)


Deriv = tuple[Callable[[np.ndarray], np.ndarray],
              Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]]


def _mono(d: Callable[[np.ndarray], np.ndarray]) -> Deriv:
    return d, lambda a, b: _monotone_range(d, a, b)


def _even_range(d: Callable[[np.ndarray], np.ndarray], lo: np.ndarray,
                hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Range of an even derivative increasing in |x| (p x^{p-1}, p - 1 even)."""
    lo_r, hi_r = _bell_range(d, lo, hi)  # bell: (value far, value near)
    return hi_r, lo_r


def _pow(lo: np.ndarray, p: float) -> Deriv:
    if p == 2.0:
        return _mono(lambda x: 2.0 * x)
    if p == 1.0:
        return _mono(np.ones_like)
    if p == int(p) and 2 < p <= 16:
        # integer exponents: p x^{p-1} is monotone (p - 1 odd) or even and increasing in |x|
        def d(x: np.ndarray) -> np.ndarray:
            return p * np.power(x, p - 1.0)
        if int(p - 1) % 2:
            return _mono(d)
        return d, lambda a, b: _even_range(d, a, b)
    if np.any(lo <= 0):
        raise LocalNotCertified(f"Pow with exponent {p} of a value the ball can bring to <= 0")
    return _mono(lambda x: p * np.power(x, p - 1.0))


# An elementwise function: an activation (lsa_models/operators/, or its report name "tanh",
# ...) or one of the arithmetic functions below ("exp", "sqrt", "reciprocal", "pow")
Kind = str | Activation


def _activation(kind: Kind) -> Activation | None:
    return kind if isinstance(kind, Activation) else by_kind(kind)


def derivative(kind: Kind, lo: np.ndarray, hi: np.ndarray, exponent: float = 2.0) -> Deriv:
    """(f', range of f' over [lo, hi]) for an elementwise function; refuses ranges outside
    its domain."""
    op = _activation(kind)
    if op is not None:
        try:
            op.d1_range(lo.reshape(-1)[:0], hi.reshape(-1)[:0])  # refused here, by name
        except ModeNotImplemented as e:
            raise LocalNotCertified(str(e)) from None
        return op.d1, op.d1_range
    if kind == "exp":
        return _mono(np.exp)
    if kind == "sqrt":
        if np.any(lo <= 0):
            raise LocalNotCertified("Sqrt of a value the ball can bring to <= 0")
        return _mono(lambda x: 0.5 / np.sqrt(x))
    if kind == "reciprocal":
        if np.any((lo <= 0) & (hi >= 0)):
            raise LocalNotCertified("a division by a value the ball can bring to 0")
        return _mono(lambda x: -1.0 / (x * x))
    if kind == "pow":
        return _pow(lo, exponent)
    raise LocalNotCertified(f"no local rule for the elementwise function {kind}")


_RANGE: dict[str, tuple[float, float]] = {"sqrt": (0.0, math.inf), "exp": (0.0, math.inf)}


_F: dict[str, Callable[[np.ndarray], np.ndarray]] = {"exp": np.exp, "sqrt": np.sqrt}


def value_range(kind: Kind, lo: np.ndarray, hi: np.ndarray, exponent: float = 2.0
                ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """An enclosure of f over [lo, hi] entrywise (interval arithmetic, docs/local-enclosure.md):
    increasing functions map the ends; 1/x and x^p with p < 0 (on x > 0, checked by
    `derivative`) decrease; integer x^p (2 <= p <= 16) increase (p odd) or go from the end
    nearest to / farthest from 0 (p even); an activation gives its own (operators/).
    Library values get LIBM_REL of their magnitude; None: no range known."""
    op = _activation(kind)
    bounds = _RANGE.get(kind) if isinstance(kind, str) else None
    if op is not None:
        try:
            a, b = op.value_range(lo, hi)
        except ModeNotImplemented:
            return None, None
        bounds = op.bounds
    elif kind in _F:
        f = _F[kind]
        a, b = f(lo), f(hi)
    elif kind == "reciprocal":
        a, b = 1.0 / hi, 1.0 / lo  # lo, hi on one side of 0
    elif kind == "pow" and exponent == int(exponent) and 2 <= exponent <= 16:
        # integer powers: odd ones increase, even ones from the ends nearest to / farthest
        # from 0
        e = int(exponent)
        if e % 2:
            a, b = np.power(lo, e), np.power(hi, e)
        else:
            near = np.where((lo <= 0) & (hi >= 0), 0.0, np.minimum(np.abs(lo), np.abs(hi)))
            a, b = np.power(near, e), np.power(np.maximum(np.abs(lo), np.abs(hi)), e)
    elif kind == "pow" and exponent < 0:
        a, b = np.power(hi, exponent), np.power(lo, exponent)
    else:
        return None, None
    pad = 4 * LIBM_REL * np.maximum(np.abs(a), np.abs(b)) + FLOOR
    a, b = a - pad, b + pad
    if bounds is not None:
        a, b = np.maximum(a, bounds[0]), np.minimum(b, bounds[1])
    return a, b


__all__ = ["LIBM_REL", "Deriv", "Kind", "derivative", "value_range"]
