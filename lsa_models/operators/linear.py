"""The linear family: MatMul and Gemm by a constant, Add/Sub, Mul/Div by a constant (and the
product of two token-bounded tensors), Neg, Einsum; and the vocabulary of the global mode that
every family with a global mode (conv.py, layout.py, reduce.py, masks.py, constants.py)
shares.

The global mode (the ONNX front end's rules, onnx/ops/) sees each operand either as a constant
(a float64 array) or as an input-dependent tensor `Tracked`: `lip`, the Lipschitz constant of
the map input -> tensor in the chosen norm (2: Frobenius norm of the whole tensor; inf: the
largest entry), `radius`, a bound on every last-axis row's 2-norm (None: unknown), and `shape`.
`global_bound(args, out_shapes, norm)` answers one `Out(lip, radius)` per output; a use the op
has no rule for raises `Refused`, whose `tail` completes "<op> node <name>" in the front end's
refusal. `evaluate_inputs(ins, float_dtype, n_outputs)` is the torch value of a node of the op
(`float_dtype`, the evaluator's float precision, is read by Cast, Constant and
ConstantOfShape).

MatMul `x W` by a constant W (the row-vector convention) has constant `||W||` (2: spectral
norm; inf: largest absolute row sum of W^T) and maps rows of norm r to rows of norm
<= ||W||_2 r (+ the bias's largest row norm for Gemm); batched constant right factors take the
worst slice; `C X` by a constant C mixes tokens: ||C||_2 (inf: ||C||_inf), no radius. Gemm is
`alpha A' B' + beta C` with B constant (transA refused). Add/Sub of two tensors of the output's
shape: Lip(f + g) <= Lip(f) + Lip(g) (residual connections); adding a constant keeps the
constant and moves each row by at most the constant's row norm. Mul/Div by a constant is a
diagonal scaling: max |c| (1 / min |c| for Div). The product of two tensors whose tokens are
bounded (R_a, R_b): A B - A' B' = (A - A') B + A' (B - B'), so Lip <= R_b Lip(a) + R_a Lip(b)
in both norms and tokens have norm <= R_a R_b (docs/bounds.md, "Gated MLPs (SwiGLU)"). Neg is
an isometry. Einsum is evaluated (weight arithmetic folds to constants; attention's
contractions are the recognised layer's, onnx/attention.py) and refused on other
input-dependent operands.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from ..bounds.formulas import linear_bound
from ..bounds.numerics import add_up, div_up, mul_up, sqrt_up
from .base import ModeNotImplemented, Operator


@runtime_checkable
class Tracked(Protocol):
    """An input-dependent tensor as the global analysis knows it (its `Value`)."""

    lip: float
    radius: float | None
    shape: tuple[int, ...]


Arg = Any  # a `Tracked`, a constant np.ndarray, or None (an absent input)


class Out(NamedTuple):
    """One output's global bound: its Lipschitz constant and token-norm bound (None:
    unknown); its shape is the node's."""

    lip: float
    radius: float | None


class Refused(ModeNotImplemented):
    """No global rule for this use of the op; `tail` completes "<op> node <name>"."""

    def __init__(self, op: str, tail: str) -> None:
        super().__init__(op, "global Lipschitz", tail.lstrip(" :"))
        self.tail = tail


class Unevaluable(NotImplementedError):
    """A form of the op the evaluator does not implement; `tail` completes "<op> node
    <name>" in the front end's error."""

    def __init__(self, tail: str) -> None:
        super().__init__(tail.lstrip(" :"))
        self.tail = tail


# the refusal of an op the global analysis meets on constants, or inside patterns, only
OUTSIDE_PATTERN = " applied to an input-dependent tensor outside a recognised pattern"


def is_var(a: Arg) -> bool:
    """Whether an operand is input-dependent (a `Tracked`, not a constant or absent)."""
    return isinstance(a, Tracked)


def variables(args: Sequence[Arg]) -> list[tuple[int, Tracked]]:
    return [(i, a) for i, a in enumerate(args) if is_var(a)]


def max_row_norm(c: np.ndarray) -> float:
    """Largest 2-norm of a last-axis row of a constant (a broadcast bias)."""
    c = np.asarray(c, dtype=np.float64)
    if c.ndim == 0:
        return abs(float(c))  # broadcast over a row of unknown width: handled by callers
    rows = np.sqrt(np.square(c).reshape(-1, c.shape[-1]).sum(axis=1)) if c.size else np.zeros(1)
    return mul_up(float(rows.max()), 1.0 + 1e-12)


def row_width(shape: tuple[int, ...]) -> int:
    return int(shape[-1]) if shape else 1


def ints(t: Tensor | None) -> list[int]:
    return [] if t is None else [int(v) for v in t.reshape(-1).tolist()]


def axes_of(ins: Sequence[Tensor | None], attrs: Mapping[str, Any]) -> list[int]:
    """A node's axes: its second input (opset 13+ for Squeeze/Unsqueeze, 18+ for the
    reductions), else its `axes` attribute (the older opsets); [] where neither is given."""
    return ints(ins[1]) if len(ins) > 1 and ins[1] is not None else list(attrs.get("axes", []))


class GlobalOperator(Operator):
    """An op of the global analysis: its torch value on a node's inputs and its rule."""

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        self.refuse("evaluation")

    def global_bound(self, args: Sequence[Arg], out_shapes: list[tuple[int, ...]],
                     norm: str) -> list[Out | None]:
        raise Refused(self.op_type, " has no Lipschitz rule for input-dependent operands")

    def refused(self, tail: str) -> Refused:
        return Refused(self.op_type, tail)


# ---- MatMul and Gemm ----------------------------------------------------------------------

def _max_or_none(xs: list[float | None]) -> float | None:
    return None if any(x is None for x in xs) else max(x for x in xs if x is not None)


def right_linear(a: Tracked, w: np.ndarray, bias: np.ndarray | None, norm: str) -> Out:
    """`x -> x W (+ b)` on every row, W (in, out) in the row-vector convention."""
    wt = w.T  # torch layout (out, in) for linear_bound (a view: norms read any layout)
    lip = linear_bound(wt, norm)
    radius = None
    if a.radius is not None:
        w2 = lip if norm == "2" else linear_bound(wt, "2")
        radius = mul_up(w2, a.radius)
        if bias is not None:
            radius = add_up(radius, max_row_norm(np.broadcast_to(bias, (w.shape[1],))
                                                  if bias.ndim == 0 else bias))
    return Out(mul_up(a.lip, lip), radius)


class MatMul(GlobalOperator):
    types = ("MatMul",)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        a, b = ins[0], ins[1]
        assert a is not None and b is not None
        if a.dim() > 2 and b.dim() == 2:
            # one (rows, k) @ (k, m) product: torch.matmul runs a seq-first (N, 1, k) input
            # as N separate vector products that each stream the whole weight (4x slower)
            return [(a.reshape(-1, a.shape[-1]) @ b).reshape(*a.shape[:-1], b.shape[-1])]
        return [torch.matmul(a, b)]

    def global_bound(self, args: Sequence[Arg], out_shapes: list[tuple[int, ...]],
                     norm: str) -> list[Out | None]:
        a, b = args[0], args[1]
        if is_var(a) and isinstance(b, np.ndarray) and b.ndim == 2:
            return [right_linear(a, b, None, norm)]
        if is_var(a) and isinstance(b, np.ndarray) and b.ndim > 2:
            # batched constant right factors (per head): the worst one bounds every slice
            mats = b.reshape(-1, b.shape[-2], b.shape[-1])
            outs = [right_linear(a, m, None, norm) for m in mats]
            return [Out(max(f.lip for f in outs), _max_or_none([f.radius for f in outs]))]
        if is_var(b) and isinstance(a, np.ndarray) and a.ndim == 2:
            # C @ X mixes rows (tokens): ||C X||_F <= ||C||_2 ||X||_F; inf: ||C||_inf
            op_norm = linear_bound(a, "2") if norm == "2" else linear_bound(a, "inf")
            return [Out(mul_up(b.lip, op_norm), None)]
        raise self.refused(" multiplies two input-dependent tensors outside a recognised "
                           "attention layer: not Lipschitz in general")


class Gemm(GlobalOperator):
    types = ("Gemm",)

    def epilogue(self, product: Tensor, ins: Sequence[Tensor | None]) -> Tensor:
        """What Gemm does after its product: `alpha A'B' + beta C`."""
        y = self.attrs.get("alpha", 1.0) * product
        if len(ins) > 2 and ins[2] is not None:
            y = y + self.attrs.get("beta", 1.0) * ins[2]
        return y

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        a, b = ins[0], ins[1]
        assert a is not None and b is not None
        if self.attrs.get("transA", 0):
            a = a.T
        if self.attrs.get("transB", 0):
            b = b.T
        return [self.epilogue(a @ b, ins)]

    def global_bound(self, args: Sequence[Arg], out_shapes: list[tuple[int, ...]],
                     norm: str) -> list[Out | None]:
        a, b = args[0], args[1]
        c = args[2] if len(args) > 2 else None
        if not (is_var(a) and isinstance(b, np.ndarray)) or is_var(c) \
                or self.attrs.get("transA", 0):
            raise self.refused(": only input @ constant is supported")
        w = b.T if self.attrs.get("transB", 0) else b
        w = w * float(self.attrs.get("alpha", 1.0))
        bias = None if c is None else np.asarray(c) * float(self.attrs.get("beta", 1.0))
        return [right_linear(a, w, bias, norm)]


# ---- elementwise arithmetic ---------------------------------------------------------------

def _broadcast_add_radius(flow: Tracked, c: np.ndarray) -> float | None:
    if flow.radius is None:
        return None
    c = np.asarray(c, dtype=np.float64)
    width = row_width(flow.shape)
    if c.ndim == 0 or c.shape[-1] == 1:
        # a scalar (or per-row constant) added to every coordinate of a row
        return add_up(flow.radius, mul_up(float(np.abs(c).max()), sqrt_up(width)))
    return add_up(flow.radius, max_row_norm(c))


class AddSub(GlobalOperator):
    types = ("Add", "Sub")

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        a, b = ins[0], ins[1]
        return [a + b if self.op_type == "Add" else a - b]  # type: ignore[operator]

    def global_bound(self, args: Sequence[Arg], out_shapes: list[tuple[int, ...]],
                     norm: str) -> list[Out | None]:
        a, b = args[0], args[1]
        shape = out_shapes[0]
        if is_var(a) and is_var(b):
            if a.shape != shape or b.shape != shape:
                raise self.refused(" broadcasts an input-dependent tensor")
            # Lip(f + g) <= Lip(f) + Lip(g): residual connections
            r = None if a.radius is None or b.radius is None else add_up(a.radius, b.radius)
            return [Out(add_up(a.lip, b.lip), r)]
        flow, const = (a, b) if is_var(a) else (b, a)
        assert is_var(flow) and isinstance(const, np.ndarray)
        if flow.shape != shape:
            raise self.refused(" broadcasts an input-dependent tensor")
        return [Out(flow.lip, _broadcast_add_radius(flow, const))]


def product_bound(a: Tracked, b: Tracked, shape: tuple[int, ...]) -> Out:
    """`a * b` of two input-dependent tensors with bounded tokens (a gated MLP's
    `silu(x W^G) * (x W^U)` behind an RMSNorm): `A B - A' B' = (A - A') B + A' (B - B')`, and
    every entry of a token is at most its 2-norm, so `Lip <= R_b Lip(a) + R_a Lip(b)` in the 2-
    and the inf-norm; tokens have norm `<= R_a R_b` (docs/bounds.md, "Gated MLPs (SwiGLU)")."""
    if a.shape != shape or b.shape != shape:
        raise Refused("Mul", " broadcasts an input-dependent tensor")
    assert a.radius is not None and b.radius is not None
    lip = add_up(mul_up(b.radius, a.lip), mul_up(a.radius, b.lip))
    return Out(lip, mul_up(a.radius, b.radius))


class MulDiv(GlobalOperator):
    types = ("Mul", "Div")

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        a, b = ins[0], ins[1]
        assert a is not None and b is not None
        if self.op_type == "Mul":
            return [a * b]
        if not a.is_floating_point() and not b.is_floating_point():
            return [torch.div(a, b, rounding_mode="trunc")]
        return [a / b]

    def global_bound(self, args: Sequence[Arg], out_shapes: list[tuple[int, ...]],
                     norm: str) -> list[Out | None]:
        a, b = args[0], args[1]
        if self.op_type == "Mul" and is_var(b) and isinstance(a, np.ndarray):
            a, b = b, a
        if self.op_type == "Mul" and is_var(a) and is_var(b) \
                and a.radius is not None and b.radius is not None:
            return [product_bound(a, b, out_shapes[0])]
        if not (is_var(a) and isinstance(b, np.ndarray)):
            raise self.refused(" of two input-dependent tensors (or a constant divided by one) "
                               "outside a recognised pattern: not Lipschitz in general (a "
                               "product of two is bounded when both factors' token norms are, "
                               "e.g. behind a LayerNorm or RMSNorm, or with an input radius)")
        if a.shape != out_shapes[0]:
            raise self.refused(" broadcasts an input-dependent tensor")
        c = np.abs(np.asarray(b, dtype=np.float64))
        if self.op_type == "Mul":
            factor = float(c.max()) if c.size else 0.0
        else:
            if c.size == 0 or float(c.min()) == 0.0:
                raise self.refused(" divides by zero")
            factor = div_up(1.0, float(c.min()))
        # a diagonal scaling: operator norm max|c| in both norms; rows shrink or grow alike
        radius = None if a.radius is None else mul_up(a.radius, factor)
        return [Out(mul_up(a.lip, factor), radius)]


class Neg(GlobalOperator):
    types = ("Neg",)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        return [-ins[0]]  # type: ignore[operator]

    def global_bound(self, args: Sequence[Arg], out_shapes: list[tuple[int, ...]],
                     norm: str) -> list[Out | None]:
        a = args[0]
        assert is_var(a)
        return [Out(a.lip, a.radius)]


class Einsum(GlobalOperator):
    """Appears in weight arithmetic (folded to constants) and in attention's contractions
    (onnx/attention.py reads them as the layer's products); on other input-dependent operands
    the global mode refuses it rather than guess which contraction it is."""

    types = ("Einsum",)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        eq = self.attrs["equation"]
        eq = eq.decode() if isinstance(eq, bytes) else str(eq)
        return [torch.einsum(eq, *[x for x in ins if x is not None])]

    def global_bound(self, args: Sequence[Arg], out_shapes: list[tuple[int, ...]],
                     norm: str) -> list[Out | None]:
        raise self.refused(OUTSIDE_PATTERN)


__all__ = ["OUTSIDE_PATTERN", "AddSub", "Arg", "Einsum", "Gemm", "GlobalOperator", "MatMul",
           "MulDiv", "Neg", "Out", "Refused", "Tracked", "Unevaluable", "ints", "is_var",
           "max_row_norm", "product_bound", "right_linear", "row_width", "variables"]
