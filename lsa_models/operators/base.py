"""The operator interface: one class per op, one method per bound mode (docs/operators.md,
"The modes", says who reads each). An instance is made from a node's attributes
(`registry.make`). A mode an op does not implement raises `ModeNotImplemented(op, mode)`, which
each reader turns into its own refusal, by name. Every enclosure is outward: the ranges
returned hold the exact function's values over the whole interval; the callers add their libm
allowance. This package imports neither engine/ nor the onnx/ front ends (an import-linter
contract).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NoReturn, Protocol

import numpy as np
from torch import Tensor

Iv = tuple[np.ndarray, np.ndarray]
Sym = str | float


class ModeNotImplemented(Exception):
    """The op has no rule for this mode (refused by name; the caller reports it)."""

    def __init__(self, op: str, mode: str, why: str = "") -> None:
        self.op, self.mode = op, mode
        super().__init__(f"{op} has no {mode} rule" + (f" ({why})" if why else ""))


class GraphBuilder(Protocol):
    """What the derived graphs (engine/derived/tangent.py's builder) offer an op: new nodes."""

    def op(self, op_type: str, inputs: list[str], attrs: dict | None = None,
           hint: str = "") -> str: ...

    def const(self, value: np.ndarray | float, hint: str = "c") -> str: ...

    def ints(self, value: list[int], hint: str = "axes") -> str:
        """An int64 constant (a reduction's axes)."""
        ...

    def step(self, g: str, u: str) -> str:
        """g * H(u), H the step (u > 0): the derivative op of Relu."""
        ...


class ChainDiff(Protocol):
    """Symbolic arithmetic inside a fused chain's derivative (engine/derived/adjoint.py's
    `_Diff`)."""

    @property
    def b(self) -> GraphBuilder: ...

    def mul(self, p: Sym, q: Sym) -> Sym: ...

    def add(self, p: Sym, q: Sym, sub: bool = False) -> Sym: ...


class IntervalOps(Protocol):
    """The padded interval arithmetic of a fused elementwise chain (engine/elementwise_chains.py):
    each result widened outward for its rounding; `k(x)`: the constant x as an interval."""

    def mul(self, a: Iv, b: Iv) -> Iv: ...

    def add(self, a: Iv, b: Iv) -> Iv: ...

    def square(self, a: Iv) -> Iv: ...

    def out(self, lo: np.ndarray, hi: np.ndarray) -> Iv: ...

    def k(self, x: float) -> Iv: ...


def text_attr(attrs: Mapping[str, Any], name: str, default: str) -> str:
    v = attrs.get(name, default)
    return v.decode() if isinstance(v, bytes) else str(v)


class Operator:
    """One ONNX op type (or a few spellings of one function) and every mode it takes part in.
    The defaults refuse; an op overrides the modes it has."""

    types: ClassVar[tuple[str, ...]] = ()

    def __init__(self, op_type: str, attrs: Mapping[str, Any] | None = None) -> None:
        self.op_type = op_type
        self.attrs: Mapping[str, Any] = attrs or {}

    def refuse(self, mode: str, why: str = "") -> NoReturn:
        raise ModeNotImplemented(self.op_type, mode, why)

    # evaluation and the global analysis
    def evaluate(self, x: Tensor) -> Tensor:
        self.refuse("evaluation")

    def global_factor(self) -> float:
        self.refuse("global Lipschitz")

    def token_radius(self, radius: float | None, width: int) -> float | None:
        self.refuse("token radius")

    # float64 points and enclosures over intervals
    def point(self, x: np.ndarray) -> np.ndarray:
        self.refuse("point evaluation")

    def d1(self, x: np.ndarray) -> np.ndarray:
        self.refuse("derivative")

    def d1_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        self.refuse("derivative range")

    def value_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        self.refuse("value range")

    def subgradient_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv:
        return self.d1_range(lo, hi)

    def d2_range(self, lo: np.ndarray, hi: np.ndarray) -> Iv | None:
        return None

    def domain_error(self, lo: np.ndarray, hi: np.ndarray) -> str | None:
        """Why [lo, hi] leaves the op's domain, or None (activations: defined everywhere)."""
        return None

    # derived graphs
    def scaled_derivative(self, b: GraphBuilder, g: str, x: str, y: str,
                          derivative_first: bool) -> str:
        """g f'(x) as graph nodes (an elementwise op: f'(x) times g, in the order the caller's
        graph multiplies)."""
        d = self.derivative_graph(b, x, y)
        return b.op("Mul", [d, g] if derivative_first else [g, d])

    def derivative_graph(self, b: GraphBuilder, x: str, y: str) -> str:
        """f'(x) as graph nodes, from y = f(x) where it can."""
        self.refuse("tangent/adjoint")

    def chain_derivative(self, diff: ChainDiff, a: Sym, y: str) -> Sym | None:
        return None

    # ball arithmetic
    def arb(self, arb: Any) -> Callable[[Any], Any]:
        self.refuse("ball arithmetic")


__all__ = ["ChainDiff", "GraphBuilder", "IntervalOps", "Iv", "ModeNotImplemented", "Operator",
           "Sym", "text_attr"]
