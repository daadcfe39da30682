"""The arithmetic elementwise functions, one class per op, each owning every mode
(operators/base.py): Exp, Sqrt, Reciprocal and Pow by a constant exponent, the pieces that
LayerNorm, RMSNorm, softmax and Pow chains are made of. Derivations: docs/operators.md,
"The arithmetic family", and docs/local-enclosure.md.

Two float64 formulas of the same function live here on purpose: the Jacobian enclosure's
(`d1`, `d1_range`, `value_range`: x^p by `np.power`) and the affine relaxation's
(`relaxation()`: 1/sqrt(x), -1/(x x), ...), as the engine has always computed them; both
are outward once the caller pads them, and keeping each lets every certified number stay
what it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from .base import ChainDiff, GraphBuilder, IntervalOps, Iv, Sym
from .linear import OUTSIDE_PATTERN, Arg, GlobalOperator, Out

F = Callable[[np.ndarray], np.ndarray]


def ends(f: F, lo: np.ndarray, hi: np.ndarray) -> Iv:
    """Range of a function monotone on [lo, hi]: its end values, ordered."""
    a, b = f(lo), f(hi)
    return np.minimum(a, b), np.maximum(a, b)


def near_far(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """|x| over [lo, hi]: its smallest (0 where the interval holds 0) and largest value."""
    near = np.where((lo <= 0) & (hi >= 0), 0.0, np.minimum(np.abs(lo), np.abs(hi)))
    return near, np.maximum(np.abs(lo), np.abs(hi))


@dataclass(frozen=True)
class Relaxation:
    """f, f' and f'' at float64 points for the affine relaxation (engine/affine/elementwise.py),
    each monotone on the open interval `domain`, so their ranges are their end values (the
    caller pads them). `value`: f's range where f is not monotone (x^2: from |x|'s nearest
    and farthest value); `exact_d2`: f'' is a constant, taken exactly (not padded)."""

    point: F
    d1: F
    d2: F
    domain: tuple[float, float] = (-math.inf, math.inf)
    value: Callable[[np.ndarray, np.ndarray], Iv] | None = None
    exact_d2: bool = False


def _square_value(lo: np.ndarray, hi: np.ndarray) -> Iv:
    near, far = near_far(lo, hi)
    return near * near, far * far


EXP_RELAXATION = Relaxation(np.exp, np.exp, np.exp)
SQUARE_RELAXATION = Relaxation(np.square, lambda x: 2.0 * x, lambda x: np.full_like(x, 2.0),
                               value=_square_value, exact_d2=True)
# on the positive half line: 1/x, x^-1/2, sqrt(x) and their derivatives are monotone
RECIPROCAL_RELAXATION = Relaxation(lambda x: 1.0 / x, lambda x: -1.0 / (x * x),
                                   lambda x: 2.0 / (x * x * x), (0.0, math.inf))
RSQRT_RELAXATION = Relaxation(lambda x: 1.0 / np.sqrt(x), lambda x: -0.5 / (x * np.sqrt(x)),
                              lambda x: 0.75 / (x * x * np.sqrt(x)), (0.0, math.inf))
SQRT_RELAXATION = Relaxation(np.sqrt, lambda x: 0.5 / np.sqrt(x),
                             lambda x: -0.25 / (x * np.sqrt(x)), (0.0, math.inf))


class Arithmetic(GlobalOperator):
    """y = f(x) entrywise. `kind`: the name the local engine's elementwise functions go by;
    `bounds`: the range of f (value ranges are clipped to it). The global analysis evaluates
    it on constants and has no rule on an input-dependent operand (exp and 1/x are not
    globally Lipschitz): registry.CONSTANTS."""

    kind: ClassVar[str] = ""
    bounds: ClassVar[tuple[float, float]] = (-math.inf, math.inf)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        return [self.evaluate(x)]

    def global_bound(self, args: Sequence[Arg], out_shapes: list[tuple[int, ...]],
                     norm: str) -> list[Out | None]:
        raise self.refused(OUTSIDE_PATTERN)

    def d1_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        return ends(self.d1, lo, hi)  # f' monotone on the domain

    def relaxation(self) -> Relaxation:
        self.refuse("affine relaxation")

    def subgradient_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        return ends(self.relaxation().d1, lo, hi)

    def d2_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv | None:
        return ends(self.relaxation().d2, lo, hi)


class Exp(Arithmetic):
    types = ("Exp",)
    kind = "exp"
    bounds = (0.0, math.inf)

    def evaluate(self, x: Tensor) -> Tensor:
        return torch.exp(x)

    def point(self, x: np.ndarray) -> np.ndarray:
        return np.exp(x)

    def d1(self, x: np.ndarray) -> np.ndarray:
        return np.exp(x)

    def value_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        return np.exp(lo), np.exp(hi)

    def relaxation(self) -> Relaxation:
        return EXP_RELAXATION

    def derivative_graph(self, b: GraphBuilder, x: str, y: str) -> str:  # exp' = y
        return y

    def arb(self, arb: Any) -> Callable[[Any], Any]:
        return lambda a: a.exp()


class Sqrt(Arithmetic):
    types = ("Sqrt",)
    kind = "sqrt"
    bounds = (0.0, math.inf)

    def evaluate(self, x: Tensor) -> Tensor:
        return torch.sqrt(x)

    def point(self, x: np.ndarray) -> np.ndarray:
        return np.sqrt(x)

    def d1(self, x: np.ndarray) -> np.ndarray:
        return 0.5 / np.sqrt(x)

    def domain_error(self, lo: np.ndarray, hi: np.ndarray) -> str | None:
        return "Sqrt of a value the ball can bring to <= 0" if np.any(lo <= 0) else None

    def value_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        return np.sqrt(lo), np.sqrt(hi)

    def relaxation(self) -> Relaxation:
        return SQRT_RELAXATION

    def derivative_graph(self, b: GraphBuilder, x: str, y: str) -> str:  # 1 / (2 y)
        return b.op("Reciprocal", [b.op("Mul", [y, b.const(2.0)])])

    def arb(self, arb: Any) -> Callable[[Any], Any]:
        return lambda a: a.sqrt()


class Reciprocal(Arithmetic):
    types = ("Reciprocal",)
    kind = "reciprocal"

    def evaluate(self, x: Tensor) -> Tensor:
        return torch.reciprocal(x)

    def point(self, x: np.ndarray) -> np.ndarray:
        return 1.0 / x

    def d1(self, x: np.ndarray) -> np.ndarray:
        return -1.0 / (x * x)

    def domain_error(self, lo: np.ndarray, hi: np.ndarray) -> str | None:
        if np.any((lo <= 0) & (hi >= 0)):
            return "a division by a value the ball can bring to 0"
        return None

    def value_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        return 1.0 / hi, 1.0 / lo  # lo, hi on one side of 0 (`domain_error`)

    def relaxation(self) -> Relaxation:
        return RECIPROCAL_RELAXATION

    def derivative_graph(self, b: GraphBuilder, x: str, y: str) -> str:  # -y^2
        return b.op("Neg", [b.op("Mul", [y, y])])

    def arb(self, arb: Any) -> Callable[[Any], Any]:
        one = arb(1)
        return lambda a: one / a


# the exponents a fused elementwise chain takes (engine/elementwise_chains.py; `Pow.chain_rule`)
CHAIN_EXPONENTS = (2.0, 3.0)
# the affine relaxation's exponents (RMSNorm's x.pow(2), x^0.5, 1/x, x^-1/2)
_POW_RELAXATIONS = {2.0: SQUARE_RELAXATION, 0.5: SQRT_RELAXATION, -1.0: RECIPROCAL_RELAXATION,
                    -0.5: RSQRT_RELAXATION}


class Pow(Arithmetic):
    """x^p by a constant exponent p (the graph's second input, given as the attribute
    "exponent"; 2 by default). The Jacobian enclosure takes p = 1, integers 2..16 on any
    interval and every other p on positive ones; the affine relaxation p = 2, 0.5, -1, -0.5;
    the derived graphs p = 2; fused chains p = 2, 3 (engine/elementwise_chains.py)."""

    types = ("Pow",)
    kind = "pow"

    def __init__(self, op_type: str, attrs: Mapping[str, Any] | None = None) -> None:
        super().__init__(op_type, attrs)
        self.p = float(self.attrs.get("exponent", 2.0))

    def _integer(self) -> bool:
        """An integer exponent 2 < p <= 16: p x^(p-1) is monotone or even, on any interval."""
        return self.p == int(self.p) and 2 < self.p <= 16

    def evaluate(self, x: Tensor) -> Tensor:
        return torch.pow(x, self.p)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        x, p = ins[0], ins[1]  # the ONNX node's exponent: a tensor operand
        assert x is not None and p is not None
        return [torch.pow(x, p)]

    def point(self, x: np.ndarray) -> np.ndarray:
        return np.power(x, self.p)

    def d1(self, x: np.ndarray) -> np.ndarray:
        p = self.p
        if p == 2.0:
            return 2.0 * x
        if p == 1.0:
            return np.ones_like(x)
        return p * np.power(x, p - 1.0)

    def domain_error(self, lo: np.ndarray, hi: np.ndarray) -> str | None:
        if self.p in (2.0, 1.0) or self._integer() or not np.any(lo <= 0):
            return None
        return f"Pow with exponent {self.p} of a value the ball can bring to <= 0"

    def d1_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        if self.p not in (2.0, 1.0) and self._integer() and int(self.p - 1) % 2 == 0:
            # p - 1 even: p x^(p-1) is even and increasing in |x|
            near, far = near_far(lo, hi)
            return self.d1(near), self.d1(far)
        return ends(self.d1, lo, hi)  # monotone (p - 1 odd, or x > 0: `domain_error`)

    def value_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        p = self.p
        integer = p == int(p) and 2 <= p <= 16
        if not integer and not p < 0:
            self.refuse("value range", f"the exponent {p}")
        if p < 0:  # decreasing on x > 0 (`domain_error`)
            return np.power(hi, p), np.power(lo, p)
        # integer powers: odd ones increase, even ones from the ends nearest to / farthest
        # from 0
        e = int(p)
        if e % 2:
            return np.power(lo, e), np.power(hi, e)
        near, far = near_far(lo, hi)
        return np.power(near, e), np.power(far, e)

    def relaxation(self) -> Relaxation:
        r = _POW_RELAXATIONS.get(self.p)
        if r is None:
            self.refuse("affine relaxation", f"the exponent {self.p}")
        return r

    def derivative_graph(self, b: GraphBuilder, x: str, y: str) -> str:  # 2 x
        if self.p != 2.0:
            self.refuse("tangent/adjoint", "only for the exponent 2")
        return b.op("Mul", [x, b.const(2.0)])

    def chain_rule(self, iv: IntervalOps, a: Iv, da: Iv, dda: Iv | None = None
                   ) -> tuple[Iv, Iv, Iv | None]:
        """u^p, (u^p)' and, given u'' (`dda`), (u^p)'' over intervals, for u in a fused chain
        (engine/elementwise_chains.py, p = 2 or 3): (u^2)' = 2 u u', (u^2)'' = 2 (u'^2 + u u''),
        (u^3)' = 3 u^2 u', (u^3)'' = 3 (2 u u'^2 + u^2 u'')."""
        if self.p == 2.0:
            v, d = iv.square(a), iv.mul(iv.mul(a, da), iv.k(2.0))
            dd = None if dda is None else iv.mul(iv.add(iv.square(da), iv.mul(a, dda)),
                                                 iv.k(2.0))
            return v, d, dd
        v = iv.out(a[0] ** 3, a[1] ** 3)  # p = 3: increasing
        d = iv.mul(iv.mul(iv.square(a), da), iv.k(3.0))
        dd = None if dda is None else iv.mul(
            iv.add(iv.mul(iv.k(2.0), iv.mul(a, iv.square(da))), iv.mul(iv.square(a), dda)),
            iv.k(3.0))
        return v, d, dd

    def chain_derivative(self, diff: ChainDiff, a: Sym, y: str) -> Sym | None:
        """2 a or 3 a^2 (fused chains hold Pow by 2 or 3 only)."""
        if self.p == 2.0:
            return diff.mul(a, 2.0)
        return diff.mul(diff.mul(a, a), 3.0)

    def arb(self, arb: Any) -> Callable[[Any], Any]:
        pw = self.p
        if pw == 2.0:
            return lambda a: a * a
        if pw == 0.5:
            return lambda a: a.sqrt()
        if pw == int(pw) and abs(pw) <= 16:
            n = int(pw)
            return lambda a: a ** n
        e = arb(pw)
        return lambda a: a ** e


__all__ = ["CHAIN_EXPONENTS", "Arithmetic", "Exp", "Pow", "Reciprocal", "Relaxation", "Sqrt",
           "ends", "near_far"]
