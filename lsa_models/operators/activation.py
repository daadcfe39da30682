"""Elementwise activations, one class per op, each owning every mode (operators/base.py).

Shared math sits in two base classes: `SigmoidShaped` (increasing, f' even and decreasing in
|x|: tanh, erf, sigmoid) and `PiecewiseLinear`'s kink bookkeeping (Relu, LeakyRelu,
HardSigmoid; HardSwish is quadratic between its kinks). Derivations: docs/operators.md and,
for the older ones, docs/local-enclosure.md and docs/bounds.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np
import torch
from scipy import special
from torch import Tensor

# ACTIVATION_LIPSCHITZ: the one table of these factors, read by the native models' layer
# graph too (bounds/ sits below this package and cannot import it)
from ..bounds.numerics import ACTIVATION_LIPSCHITZ, GELU_LIPSCHITZ, U, add_up, mul_up, sqrt_up
from .base import ChainDiff, GraphBuilder, Iv, Operator, Sym, text_attr

# sup |erf'| = 2/sqrt(pi) = 1.1283791670955126..., rounded up.
ERF_LIPSCHITZ = 1.1283792
# ln 2 = 0.693147180559945309..., rounded up: softplus(0), and |softplus(x)| <= |x| + ln 2
LN2_UP = 0.6931471805599454
_SQRT2 = math.sqrt(2.0)


class Activation(Operator):
    """y = f(x) entrywise. `kind`: the name reports use ("activation:<kind>"); `bounds`: the
    range of f (value ranges are clipped to it); `fusable`: smooth with f'' enclosed, so it
    joins elementwise chains (engine/elementwise_chains.py)."""

    kind: ClassVar[str] = ""
    bounds: ClassVar[tuple[float, float]] = (-math.inf, math.inf)
    fusable: ClassVar[bool] = False


def _near_far(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    near = np.where((lo <= 0) & (hi >= 0), 0.0, np.minimum(np.abs(lo), np.abs(hi)))
    return near, np.maximum(np.abs(lo), np.abs(hi))


class Smooth(Activation):
    """Increasing and smooth: f over an interval from its ends; f'' from its ends and the
    critical points of f'' (`crits`, where f''' = 0), f'' being smooth."""

    crits: ClassVar[tuple[float, ...]] = ()

    def d2(self, x: np.ndarray) -> np.ndarray:
        self.refuse("curvature")

    def value_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        return self.point(lo), self.point(hi)

    def d2_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv | None:
        cands = [self.d2(lo), self.d2(hi)]
        for c in self.crits:
            inside = (lo <= c) & (hi >= c)
            hc = np.full_like(lo, self.d2(np.array(c)))
            cands.append(np.where(inside, hc, self.d2(lo)))
        st = np.stack(cands)
        return st.min(axis=0), st.max(axis=0)


class SigmoidShaped(Smooth):
    """Increasing, bounded by `bounds`, f' even and decreasing in |x| (tanh, erf, sigmoid): f'
    over [lo, hi] is [f'(farthest from 0), f'(nearest to 0)]."""

    fusable = True
    lipschitz: ClassVar[float] = 1.0
    through_zero: ClassVar[bool] = True  # f(0) = 0, |f(x)| <= L |x|

    def global_factor(self) -> float:
        return self.lipschitz

    def token_radius(self, radius: float | None, width: int) -> float | None:
        bounded = sqrt_up(width)  # |f| <= 1
        if radius is None or not self.through_zero:
            return bounded
        return min(bounded, mul_up(self.lipschitz, radius))

    def d1_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        near, far = _near_far(lo, hi)
        return self.d1(far), self.d1(near)


class Tanh(SigmoidShaped):
    types = ("Tanh",)
    kind = "tanh"
    bounds = (-1.0, 1.0)
    lipschitz = ACTIVATION_LIPSCHITZ["tanh"]
    # tanh''' = -2 (1 - t^2)(1 - 3 t^2), t = tanh x: zero at t = +-1/sqrt 3
    crits = (-math.atanh(1.0 / math.sqrt(3.0)), math.atanh(1.0 / math.sqrt(3.0)))

    def evaluate(self, x: Tensor) -> Tensor:
        return torch.tanh(x)

    def point(self, x: np.ndarray) -> np.ndarray:
        return np.tanh(x)

    def d1(self, x: np.ndarray) -> np.ndarray:
        return 1.0 - np.tanh(x) ** 2

    def d2(self, x: np.ndarray) -> np.ndarray:
        t = np.tanh(x)
        return -2.0 * t * (1.0 - t * t)

    def derivative_graph(self, b: GraphBuilder, x: str, y: str) -> str:  # 1 - y^2
        return b.op("Sub", [b.const(1.0, "one"), b.op("Mul", [y, y])])

    def chain_derivative(self, diff: ChainDiff, a: Sym, y: str) -> Sym | None:
        return diff.add(1.0, diff.b.op("Mul", [y, y]), sub=True)

    def arb(self, arb: Any) -> Callable[[Any], Any]:
        return lambda a: a.tanh()


class Sigmoid(SigmoidShaped):
    types = ("Sigmoid",)
    kind = "sigmoid"
    bounds = (0.0, 1.0)
    lipschitz = ACTIVATION_LIPSCHITZ["sigmoid"]  # 1/4
    through_zero = False  # values in (0, 1)
    # sigmoid''' = s (1 - s)(1 - 6 s + 6 s^2): zero at s = (3 -+ sqrt 3) / 6
    _crit = math.log((3.0 + math.sqrt(3.0)) / (3.0 - math.sqrt(3.0)))
    crits = (-_crit, _crit)

    def evaluate(self, x: Tensor) -> Tensor:
        return torch.sigmoid(x)

    def point(self, x: np.ndarray) -> np.ndarray:
        return special.expit(x)

    def d1(self, x: np.ndarray) -> np.ndarray:
        s = special.expit(x)
        return s * (1.0 - s)

    def d2(self, x: np.ndarray) -> np.ndarray:
        s = special.expit(x)
        return s * (1.0 - s) * (1.0 - 2.0 * s)

    def derivative_graph(self, b: GraphBuilder, x: str, y: str) -> str:  # y (1 - y)
        return b.op("Mul", [y, b.op("Sub", [b.const(1.0, "one"), y])])

    def chain_derivative(self, diff: ChainDiff, a: Sym, y: str) -> Sym | None:
        return diff.mul(y, diff.add(1.0, y, sub=True))

    def arb(self, arb: Any) -> Callable[[Any], Any]:
        one = arb(1)
        return lambda a: one / (one + (-a).exp())


class Erf(SigmoidShaped):
    types = ("Erf",)
    kind = "erf"
    bounds = (-1.0, 1.0)
    lipschitz = ERF_LIPSCHITZ
    # erf''' = (4/sqrt pi) e^(-x^2) (2 x^2 - 1)
    crits = (-1.0 / math.sqrt(2.0), 1.0 / math.sqrt(2.0))

    def evaluate(self, x: Tensor) -> Tensor:
        return torch.erf(x)

    def point(self, x: np.ndarray) -> np.ndarray:
        return special.erf(x)

    def d1(self, x: np.ndarray) -> np.ndarray:
        return (2.0 / math.sqrt(math.pi)) * np.exp(-x * x)

    def d2(self, x: np.ndarray) -> np.ndarray:
        return (-4.0 / math.sqrt(math.pi)) * x * np.exp(-x * x)

    def derivative_graph(self, b: GraphBuilder, x: str, y: str) -> str:  # 2/sqrt(pi) e^(-x^2)
        e = b.op("Exp", [b.op("Neg", [b.op("Mul", [x, x])])])
        return b.op("Mul", [e, b.const(2 / math.sqrt(math.pi))])

    def arb(self, arb: Any) -> Callable[[Any], Any]:
        return lambda a: a.erf()


class Softplus(Smooth):
    """ln(1 + e^x): increasing and convex, f' = sigmoid (increasing, in (0, 1)), f'' =
    sigmoid' (even, largest at 0)."""

    types = ("Softplus",)
    kind = "softplus"
    bounds = (0.0, math.inf)
    fusable = True
    crits = (0.0,)  # f''' = s (1 - s)(1 - 2 s): zero at x = 0

    def evaluate(self, x: Tensor) -> Tensor:
        return torch.logaddexp(x, torch.zeros_like(x))

    def global_factor(self) -> float:
        return 1.0

    def token_radius(self, radius: float | None, width: int) -> float | None:
        # |softplus(x)| <= |x| + ln 2 entrywise: ||f(x)||_2 <= ||x||_2 + ln 2 sqrt(width)
        return None if radius is None else add_up(radius, mul_up(LN2_UP, sqrt_up(width)))

    def point(self, x: np.ndarray) -> np.ndarray:
        return np.logaddexp(0.0, x)

    def d1(self, x: np.ndarray) -> np.ndarray:
        return special.expit(x)

    def d1_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        return special.expit(lo), special.expit(hi)

    def d2(self, x: np.ndarray) -> np.ndarray:
        s = special.expit(x)
        return s * (1.0 - s)

    def derivative_graph(self, b: GraphBuilder, x: str, y: str) -> str:
        return b.op("Sigmoid", [x])

    def chain_derivative(self, diff: ChainDiff, a: Sym, y: str) -> Sym | None:
        return diff.b.op("Sigmoid", [a]) if isinstance(a, str) else None

    def arb(self, arb: Any) -> Callable[[Any], Any]:
        one = arb(1)
        return lambda a: (one + a.exp()).log()


class Gelu(Activation):
    """x Phi(x) (approximate="none"); the tanh approximation (opset 20) is evaluated and bounded
    globally, and locally as the chain it stands for (engine/enclosure/rules_more.py)."""

    types = ("Gelu",)
    kind = "gelu"
    # GELU's minimum: x* = -0.7517915247, GELU(x*) = -0.1699712702 (GELU' = Phi + x phi has
    # its only negative-side zero there); -0.17 is below it
    MIN_X, MIN = -0.7517915247, -0.17

    def __init__(self, op_type: str, attrs: Mapping[str, Any] | None = None) -> None:
        super().__init__(op_type, attrs)
        self.approximate = text_attr(self.attrs, "approximate", "none")

    def _exact(self, mode: str) -> None:
        if self.approximate != "none":
            self.refuse(mode, "the tanh approximation: written out as its chain")

    def evaluate(self, x: Tensor) -> Tensor:
        return torch.nn.functional.gelu(x, approximate=self.approximate)

    def global_factor(self) -> float:
        return ACTIVATION_LIPSCHITZ["gelu"]  # GELU_LIPSCHITZ: above both forms' sup |f'|

    def token_radius(self, radius: float | None, width: int) -> float | None:
        return None if radius is None else mul_up(GELU_LIPSCHITZ, radius)

    def point(self, x: np.ndarray) -> np.ndarray:
        self._exact("point evaluation")
        return 0.5 * x * (1.0 + special.erf(x / _SQRT2))

    def d1(self, x: np.ndarray) -> np.ndarray:
        self._exact("derivative")
        return 0.5 * (1.0 + special.erf(x / _SQRT2)) + x * np.exp(-0.5 * x * x) / math.sqrt(
            2 * math.pi)

    def d1_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        # GELU'' = phi(x) (2 - x^2): extremes at the ends or at -sqrt 2 (min), sqrt 2 (max)
        a, b = self.d1(lo), self.d1(hi)
        dlo, dhi = np.minimum(a, b), np.maximum(a, b)
        dlo = np.where((lo <= -_SQRT2) & (hi >= -_SQRT2), np.minimum(dlo, self.d1(
            np.array(-_SQRT2))), dlo)
        dhi = np.where((lo <= _SQRT2) & (hi >= _SQRT2), np.maximum(dhi, self.d1(
            np.array(_SQRT2))), dhi)
        return dlo, dhi

    def subgradient_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        self.refuse("affine relaxation")

    def value_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        f = self.point
        a, b = f(lo), f(hi)
        a = np.where((lo < self.MIN_X) & (hi > self.MIN_X), self.MIN, np.minimum(a, b))
        return a, np.maximum(f(lo), f(hi))

    def derivative_graph(self, b: GraphBuilder, x: str, y: str) -> str:
        self._exact("tangent/adjoint")
        # Phi(x) + x phi(x) = (1 + erf(x / sqrt 2)) / 2 + x exp(-x^2 / 2) / sqrt(2 pi)
        cdf = b.op("Mul", [b.op("Add", [b.op("Erf", [b.op("Mul", [x, b.const(
            1 / math.sqrt(2))])]), b.const(1.0)]), b.const(0.5)])
        pdf = b.op("Mul", [b.op("Exp", [b.op("Mul", [b.op("Mul", [x, x]), b.const(-0.5)])]),
                           b.const(1 / math.sqrt(2 * math.pi))])
        return b.op("Add", [cdf, b.op("Mul", [x, pdf])])

    def arb(self, arb: Any) -> Callable[[Any], Any]:
        one = arb(1)
        if self.approximate == "tanh":
            k = (arb(2) / arb.pi()).sqrt()
            c3 = arb("0.044715")
            return lambda a: a * (one + (k * (a + c3 * a * a * a)).tanh()) / 2
        r2 = arb(2).sqrt()
        return lambda a: a * (one + (a / r2).erf()) / 2


def _outward(lo: np.ndarray, hi: np.ndarray, err_lo: np.ndarray, err_hi: np.ndarray) -> Iv:
    """[lo - err_lo, hi + err_hi]: values computed with a few roundings, widened by their
    bound (err >= the rounding of each end) and the smallest normal."""
    return lo - err_lo - 1e-300, hi + err_hi + 1e-300


class Relu(Activation):
    """max(x, 0). Its derivative op is the step H(x) = [x > 0] (torch's convention at 0),
    written `step` in the derived graphs (engine/derivative_ops.py's ReluGrad)."""

    types = ("Relu",)
    kind = "relu"
    bounds = (0.0, math.inf)

    def evaluate(self, x: Tensor) -> Tensor:
        return torch.relu(x)

    def global_factor(self) -> float:
        return ACTIVATION_LIPSCHITZ["relu"]  # 1

    def token_radius(self, radius: float | None, width: int) -> float | None:
        return None if radius is None else mul_up(1.0, radius)  # |relu(x)| <= |x|

    def point(self, x: np.ndarray) -> np.ndarray:
        return np.maximum(x, 0.0)

    def d1(self, x: np.ndarray) -> np.ndarray:
        return (x > 0).astype(np.float64)

    def d1_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        return np.where(lo > 0, 1.0, 0.0), np.where(hi > 0, 1.0, 0.0)

    def subgradient_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        """The slopes over [lo, hi]: 1 right of 0, 0 left of it, [0, 1] (the subgradients)
        at 0."""
        return np.where(lo > 0, 1.0, 0.0), np.where(hi >= 0, 1.0, 0.0)

    def value_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        return np.maximum(lo, 0.0), np.maximum(hi, 0.0)  # exact

    def d2_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv | None:
        # convex: f'' >= 0, given as [0, inf] (the affine forms' chord candidate applies)
        return np.zeros_like(lo), np.full_like(lo, np.inf)

    def scaled_derivative(self, b: GraphBuilder, g: str, x: str, y: str,
                          derivative_first: bool) -> str:
        return b.step(g, x)

    def arb(self, arb: Any) -> Callable[[Any], Any]:
        zero = arb(0)
        return lambda a: a.max(zero)


class LeakyRelu(Activation):
    """x for x >= 0, alpha x below (ONNX LeakyRelu, alpha 0.01 by default): slopes alpha and 1,
    one kink at 0 (convex for alpha <= 1, concave above)."""

    types = ("LeakyRelu",)
    kind = "leakyrelu"

    def __init__(self, op_type: str, attrs: Mapping[str, Any] | None = None) -> None:
        super().__init__(op_type, attrs)
        self.alpha = float(self.attrs.get("alpha", 0.01))

    def evaluate(self, x: Tensor) -> Tensor:
        return torch.where(x >= 0, x, self.alpha * x)

    def global_factor(self) -> float:
        return max(1.0, abs(self.alpha))

    def token_radius(self, radius: float | None, width: int) -> float | None:
        # f(0) = 0 and |f(x)| <= max(1, |alpha|) |x|
        return None if radius is None else mul_up(self.global_factor(), radius)

    def point(self, x: np.ndarray) -> np.ndarray:
        return np.where(x >= 0, x, self.alpha * x)

    def d1(self, x: np.ndarray) -> np.ndarray:
        return np.where(x > 0, 1.0, self.alpha)

    def d1_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        # slope alpha wherever the interval reaches x <= 0, 1 wherever it reaches x >= 0
        a, one = np.full_like(lo, self.alpha), np.ones_like(lo)
        left, right = lo <= 0, hi >= 0
        return (np.where(left & right, np.minimum(a, one), np.where(left, a, one)),
                np.where(left & right, np.maximum(a, one), np.where(left, a, one)))

    def value_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        a, b = self.point(lo), self.point(hi)
        vlo, vhi = np.minimum(a, b), np.maximum(a, b)
        kink = (lo <= 0) & (hi >= 0)  # f(0) = 0: the extreme for alpha < 0
        vlo, vhi = np.where(kink, np.minimum(vlo, 0.0), vlo), np.where(kink, np.maximum(
            vhi, 0.0), vhi)
        return _outward(vlo, vhi, 2 * U * np.abs(vlo), 2 * U * np.abs(vhi))  # alpha x

    def d2_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv | None:
        kink = (lo <= 0) & (hi >= 0)
        z = np.zeros_like(lo)
        if self.alpha <= 1.0:  # convex: the slope steps up at 0
            return z, np.where(kink, np.inf, 0.0)
        return np.where(kink, -np.inf, 0.0), z

    def scaled_derivative(self, b: GraphBuilder, g: str, x: str, y: str,
                          derivative_first: bool) -> str:
        # g f'(x) = g H(x) + alpha (g - g H(x)): exact in the graph's arithmetic
        s = b.step(g, x)
        return b.op("Add", [s, b.op("Mul", [b.op("Sub", [g, s]), b.const(self.alpha)])])

    def arb(self, arb: Any) -> Callable[[Any], Any]:
        al = arb(self.alpha)
        if self.alpha <= 1.0:
            return lambda a: a.max(al * a)
        return lambda a: a.min(al * a)


class _Clipped(Activation):
    """The ramp z = alpha x + beta clipped to [0, 1] (alpha > 0 for the local modes): kinks at
    ka = -beta/alpha and kb = (1 - beta)/alpha, each known to within `tol` (two roundings)."""

    alpha: float
    beta: float

    def _ramp(self, mode: str) -> tuple[float, float, float]:
        if not self.alpha > 0:
            self.refuse(mode, f"alpha = {self.alpha}: only an increasing ramp is bounded")
        ka, kb = -self.beta / self.alpha, (1.0 - self.beta) / self.alpha
        return ka, kb, 8 * U * (abs(ka) + abs(kb)) + 1e-300

    def _z(self, x: np.ndarray) -> np.ndarray:
        return self.alpha * x + self.beta

    def _pieces(self, lo: np.ndarray, hi: np.ndarray, mode: str
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Whether [lo, hi] may reach below ka, into (ka, kb), above kb."""
        ka, kb, tol = self._ramp(mode)
        return lo <= ka + tol, (hi > ka - tol) & (lo < kb + tol), hi >= kb - tol


class HardSigmoid(_Clipped):
    """max(0, min(1, alpha x + beta)) (ONNX HardSigmoid: alpha 0.2, beta 0.5 by default; torch
    exports alpha = 1/6): slope alpha between the kinks, 0 outside."""

    types = ("HardSigmoid",)
    kind = "hardsigmoid"
    bounds = (0.0, 1.0)

    def __init__(self, op_type: str, attrs: Mapping[str, Any] | None = None) -> None:
        super().__init__(op_type, attrs)
        self.alpha = float(self.attrs.get("alpha", 0.2))
        self.beta = float(self.attrs.get("beta", 0.5))

    def evaluate(self, x: Tensor) -> Tensor:
        return torch.clamp(self.alpha * x + self.beta, 0.0, 1.0)

    def global_factor(self) -> float:
        return abs(self.alpha)

    def token_radius(self, radius: float | None, width: int) -> float | None:
        return sqrt_up(width)  # values in [0, 1]

    def point(self, x: np.ndarray) -> np.ndarray:
        return np.clip(self._z(x), 0.0, 1.0)

    def d1(self, x: np.ndarray) -> np.ndarray:
        z = self._z(x)
        return np.where((z > 0) & (z < 1), self.alpha, 0.0)

    def d1_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        below, mid, above = self._pieces(lo, hi, "derivative range")
        return np.where(below | above, 0.0, self.alpha), np.where(mid, self.alpha, 0.0)

    def value_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        self._ramp("value range")
        zl, zh = self._z(lo), self._z(hi)  # increasing; each end two roundings
        el = 2 * U * (np.abs(self.alpha * lo) + abs(self.beta))
        eh = 2 * U * (np.abs(self.alpha * hi) + abs(self.beta))
        zl, zh = _outward(zl, zh, el, eh)
        return np.clip(zl, 0.0, 1.0), np.clip(zh, 0.0, 1.0)

    def d2_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv | None:
        # f' steps up by alpha at ka (convex there) and down at kb (concave): as measures
        ka, kb, tol = self._ramp("curvature")
        at_a = (lo <= ka + tol) & (hi >= ka - tol)
        at_b = (lo <= kb + tol) & (hi >= kb - tol)
        return np.where(at_b, -np.inf, 0.0), np.where(at_a, np.inf, 0.0)

    def scaled_derivative(self, b: GraphBuilder, g: str, x: str, y: str,
                          derivative_first: bool) -> str:
        # g f'(x) = alpha (g H(z) - g H(z - 1)), z = alpha x + beta
        self._ramp("tangent/adjoint")
        z = b.op("Add", [b.op("Mul", [x, b.const(self.alpha)]), b.const(self.beta)])
        inner = b.op("Sub", [b.step(g, z), b.step(g, b.op("Sub", [z, b.const(1.0, "one")]))])
        return b.op("Mul", [inner, b.const(self.alpha)])

    def arb(self, arb: Any) -> Callable[[Any], Any]:
        al, be, zero, one = arb(self.alpha), arb(self.beta), arb(0), arb(1)
        return lambda a: (al * a + be).max(zero).min(one)


class HardSwish(_Clipped):
    """x max(0, min(1, x/6 + 1/2)) (ONNX HardSwish, alpha = 1/6 and beta = 1/2 in float64):
    0 below -3, x above 3, x^2/6 + x/2 between, so f' = x/3 + 1/2 in [-1/2, 3/2] there; the
    minimum -beta^2/(4 alpha) = -3/8 at -beta/(2 alpha) = -3/2."""

    types = ("HardSwish",)
    kind = "hardswish"
    alpha, beta = 1.0 / 6.0, 0.5
    LIPSCHITZ = 1.5  # 2 alpha kb + beta = 2 (1 - beta) + beta, exactly

    def evaluate(self, x: Tensor) -> Tensor:
        return x * torch.clamp(self.alpha * x + self.beta, 0.0, 1.0)

    def global_factor(self) -> float:
        return self.LIPSCHITZ

    def token_radius(self, radius: float | None, width: int) -> float | None:
        return radius  # |f(x)| = |x| clip(...) <= |x|

    def point(self, x: np.ndarray) -> np.ndarray:
        return x * np.clip(self._z(x), 0.0, 1.0)

    def d1(self, x: np.ndarray) -> np.ndarray:
        z = self._z(x)
        return np.where(z <= 0, 0.0, np.where(z >= 1, 1.0, 2 * self.alpha * x + self.beta))

    def d1_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        ka, kb, _ = self._ramp("derivative range")
        below, mid, above = self._pieces(lo, hi, "derivative range")
        # between the kinks f' = 2 alpha x + beta increases: its ends on the clipped interval
        ml = 2 * self.alpha * np.clip(lo, ka, kb) + self.beta
        mh = 2 * self.alpha * np.clip(hi, ka, kb) + self.beta
        ml, mh = _outward(ml, mh, 4 * U * (np.abs(ml) + 1), 4 * U * (np.abs(mh) + 1))
        inf = np.full_like(lo, np.inf)
        dlo = np.minimum(np.minimum(np.where(below, 0.0, inf), np.where(above, 1.0, inf)),
                         np.where(mid, ml, inf))
        dhi = np.maximum(np.maximum(np.where(below, 0.0, -inf), np.where(above, 1.0, -inf)),
                         np.where(mid, mh, -inf))
        return dlo, dhi

    def value_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        self._ramp("value range")
        # quasi-convex (0, then down to the minimum at xm, then up): the larger end value is
        # the maximum; the minimum is -3/8 where xm lies inside, else the smaller end value
        a, b = self.point(lo), self.point(hi)
        xm, fmin = -self.beta / (2 * self.alpha), -self.beta ** 2 / (4 * self.alpha)
        tol = 8 * U * abs(xm)
        vlo = np.where((lo <= xm + tol) & (hi >= xm - tol), fmin * (1 + 8 * U),
                       np.minimum(a, b))
        vhi = np.maximum(a, b)
        # x (alpha x + beta): a few roundings of terms below |x| (|x| / 6 + 1/2) each
        err = 4 * U * np.maximum(np.abs(lo), np.abs(hi)) * (
            np.maximum(np.abs(lo), np.abs(hi)) * self.alpha + self.beta + 1)
        return _outward(vlo, vhi, err, err)

    def d2_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv | None:
        # 2 alpha between the kinks, 0 outside; f' steps down at both kinks (-1/2 at -3,
        # -1/2 at 3): concave there
        ka, kb, tol = self._ramp("curvature")
        below, mid, above = self._pieces(lo, hi, "curvature")
        kink = ((lo <= ka + tol) & (hi >= ka - tol)) | ((lo <= kb + tol) & (hi >= kb - tol))
        two_a = 2 * self.alpha * (1 + 4 * U)
        top = np.where(mid, two_a, 0.0)
        low = np.where(below | above, 0.0, 2 * self.alpha * (1 - 4 * U))
        return np.where(kink, -np.inf, low), top

    def scaled_derivative(self, b: GraphBuilder, g: str, x: str, y: str,
                          derivative_first: bool) -> str:
        # g f'(x) = g HardSigmoid(x) + alpha (g x H(z) - g x H(z - 1)), z = alpha x + beta
        hs = b.op("HardSigmoid", [x], {"alpha": self.alpha, "beta": self.beta})
        first = b.op("Mul", [hs, g] if derivative_first else [g, hs])
        gx = b.op("Mul", [g, x])
        z = b.op("Add", [b.op("Mul", [x, b.const(self.alpha)]), b.const(self.beta)])
        inner = b.op("Sub", [b.step(gx, z), b.step(gx, b.op("Sub", [z, b.const(1.0, "one")]))])
        return b.op("Add", [first, b.op("Mul", [inner, b.const(self.alpha)])])

    def arb(self, arb: Any) -> Callable[[Any], Any]:
        al, be, zero, one = arb(self.alpha), arb(self.beta), arb(0), arb(1)
        return lambda a: a * (al * a + be).max(zero).min(one)


__all__ = ["ERF_LIPSCHITZ", "Activation", "Erf", "Gelu", "HardSigmoid", "HardSwish",
           "LeakyRelu", "Relu", "Sigmoid", "SigmoidShaped", "Smooth", "Softplus", "Tanh"]
