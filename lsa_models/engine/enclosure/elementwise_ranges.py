"""f' and f over an interval for the local enclosure's elementwise functions
(docs/local-enclosure.md), read from the op classes of lsa_models/operators/: the
activations and the arithmetic ones (exp, sqrt, reciprocal, x^p with a constant exponent) that
LayerNorm, softmax and Pow chains are made of.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lsa_models.engine.values import FLOOR, LocalNotCertified
from lsa_models.operators import ModeNotImplemented, Operator, arithmetic_by_kind, by_kind
from lsa_models.operators.activation import Activation
from lsa_models.operators.arithmetic import Arithmetic

# Relative allowance on derivative values computed with libm/scipy (erf, exp, tanh):
# faithfully rounded to a few ulp; 1e-12 is far above that.
LIBM_REL = 1e-12


Deriv = tuple[Callable[[np.ndarray], np.ndarray],
              Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]]


# An elementwise function: an op of lsa_models/operators/ (an activation, or an arithmetic
# one: Exp, Sqrt, Reciprocal, Pow), or the name the local engine gives it ("tanh", ...,
# "exp", "sqrt", "reciprocal", "pow": x^exponent)
Kind = str | Operator


def _op(kind: Kind, exponent: float) -> Activation | Arithmetic | None:
    if isinstance(kind, (Activation, Arithmetic)):
        return kind
    if not isinstance(kind, str):
        return None
    if kind == "pow":
        return arithmetic_by_kind(kind, {"exponent": exponent})
    return by_kind(kind) or arithmetic_by_kind(kind)


def derivative(kind: Kind, lo: np.ndarray, hi: np.ndarray, exponent: float = 2.0) -> Deriv:
    """(f', range of f' over [lo, hi]) for an elementwise function; refuses ranges outside
    its domain."""
    op = _op(kind, exponent)
    if isinstance(op, Activation):
        try:
            op.d1_range(lo.reshape(-1)[:0], hi.reshape(-1)[:0])  # refused here, by name
        except ModeNotImplemented as e:
            raise LocalNotCertified(str(e)) from None
        return op.d1, op.d1_range
    if op is not None:
        why = op.domain_error(lo, hi)
        if why is not None:
            raise LocalNotCertified(why)
        return op.d1, op.d1_range
    raise LocalNotCertified(f"no local rule for the elementwise function {kind}")


def value_range(kind: Kind, lo: np.ndarray, hi: np.ndarray, exponent: float = 2.0
                ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """An enclosure of f over [lo, hi] entrywise (interval arithmetic, docs/local-enclosure.md):
    the op's own (operators/), inside its `bounds`, where the op has one (on x > 0 where its
    domain asks it, checked by `derivative`). Library values get LIBM_REL of their
    magnitude; None: no range known."""
    op = _op(kind, exponent)
    if op is None:
        return None, None
    try:
        a, b = op.value_range(lo, hi)
    except ModeNotImplemented:
        return None, None
    pad = 4 * LIBM_REL * np.maximum(np.abs(a), np.abs(b)) + FLOOR
    a, b = a - pad, b + pad
    bounds = op.bounds
    a, b = np.maximum(a, bounds[0]), np.minimum(b, bounds[1])
    return a, b
