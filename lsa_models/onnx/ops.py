"""The ONNX op registry: for each op family, a torch implementation and a Lipschitz rule.

The torch implementations evaluate a graph with autograd (graph.py). The rules bound the
graph (analyzer.py): every tensor that depends on the model input carries a `Flow`, the
Lipschitz constant of the map input -> tensor in the chosen norm (2: Frobenius norm of the
whole tensor; inf: largest entry) and, on bounded domains, a bound on the 2-norm of each of
its tokens (last-axis rows). Tensors that do not depend on the input are constants (float64
arrays from a reference evaluation). A rule that cannot bound its op raises `NotCertified`.

Composite patterns (attention, decomposed LayerNorm, the Erf form of GELU) are recognised
before the rules run (attention.py, analyzer.py); their member nodes never reach the rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import onnx
import torch
from torch import Tensor

from ..bounds.formulas import layernorm_bound, linear_bound
from ..bounds.numerics import (
    ACTIVATION_LIPSCHITZ,
    add_up,
    div_up,
    mul_up,
    sqrt_up,
)

# sup |erf'| = 2/sqrt(pi) = 1.1283791670955126..., rounded up.
ERF_LIPSCHITZ = 1.1283792
SOFTMAX_LIPSCHITZ = 0.5  # ||diag(p) - p p^T|| <= 1/2 in the 2- and inf-norms


@dataclass
class Node:
    """One ONNX node with its attributes decoded to Python values."""

    name: str
    op_type: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    domain: str = ""

    @staticmethod
    def from_proto(proto: onnx.NodeProto, index: int) -> Node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in proto.attribute}
        return Node(proto.name or f"{proto.op_type}_{index}", proto.op_type, list(proto.input),
                    list(proto.output), attrs, proto.domain)


@dataclass
class Flow:
    """What is known about an input-dependent tensor."""

    lip: float
    radius: float | None  # bound on every last-axis row's 2-norm; None: unknown
    shape: tuple[int, ...]


class NotCertified(Exception):
    """An op (or its use) for which no certified bound is available."""


class UnsupportedOnnxError(ValueError):
    """Base class of the ONNX loading errors (bad files, unsupported content)."""


@dataclass
class RunContext:
    float_dtype: torch.dtype = torch.float32


Arg = Flow | np.ndarray


def _np(t: Tensor) -> np.ndarray:
    return t.detach().to("cpu").numpy()


_ONNX_TO_TORCH: dict[int, torch.dtype] = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.BOOL: torch.bool,
}
FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
               onnx.TensorProto.BFLOAT16}


def torch_dtype(onnx_type: int, ctx: RunContext) -> torch.dtype:
    if onnx_type in FLOAT_TYPES:
        return ctx.float_dtype  # the evaluator runs in one float precision
    if onnx_type not in _ONNX_TO_TORCH:
        raise NotImplementedError(f"tensor element type {onnx_type} is not supported")
    return _ONNX_TO_TORCH[onnx_type]


def tensor_from_proto(t: onnx.TensorProto, ctx: RunContext) -> Tensor:
    arr = onnx.numpy_helper.to_array(t)
    if np.issubdtype(arr.dtype, np.floating) and ctx.float_dtype == torch.float64:
        return torch.from_numpy(arr.astype(np.float64))  # one pass: convert and own the copy
    out = torch.from_numpy(np.array(arr, copy=True))
    return out.to(ctx.float_dtype) if out.is_floating_point() else out


def _ints(t: Tensor | None) -> list[int]:
    return [] if t is None else [int(v) for v in t.reshape(-1).tolist()]


class Op:
    """One op family. `run` evaluates it in torch; `bound` propagates flows."""

    types: ClassVar[tuple[str, ...]] = ()

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        raise NotImplementedError

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        raise NotCertified(f"{node.op_type} node {node.name} has no Lipschitz rule for "
                           "input-dependent operands")


OPS: dict[str, Op] = {}


def register(cls: type[Op]) -> type[Op]:
    inst = cls()
    for t in cls.types:
        OPS[t] = inst
    return cls


def _variables(args: Sequence[Arg | None]) -> list[tuple[int, Flow]]:
    return [(i, a) for i, a in enumerate(args) if isinstance(a, Flow)]


def _max_row_norm(c: np.ndarray) -> float:
    """Largest 2-norm of a last-axis row of a constant (a broadcast bias)."""
    c = np.asarray(c, dtype=np.float64)
    if c.ndim == 0:
        return abs(float(c))  # broadcast over a row of unknown width: handled by callers
    rows = np.sqrt(np.square(c).reshape(-1, c.shape[-1]).sum(axis=1)) if c.size else np.zeros(1)
    return mul_up(float(rows.max()), 1.0 + 1e-12)


def _row_width(shape: tuple[int, ...]) -> int:
    return int(shape[-1]) if shape else 1


# ---- linear algebra -----------------------------------------------------------------------

@register
class MatMulOp(Op):
    types = ("MatMul",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        a, b = ins[0], ins[1]
        assert a is not None and b is not None
        if a.dim() > 2 and b.dim() == 2:
            # one (rows, k) @ (k, m) product: torch.matmul runs a seq-first (N, 1, k) input
            # as N separate vector products that each stream the whole weight (4x slower)
            return [(a.reshape(-1, a.shape[-1]) @ b).reshape(*a.shape[:-1], b.shape[-1])]
        return [torch.matmul(a, b)]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a, b = args[0], args[1]
        if isinstance(a, Flow) and isinstance(b, np.ndarray) and b.ndim == 2:
            return [_right_linear(a, b, None, norm, out_shapes[0])]
        if isinstance(a, Flow) and isinstance(b, np.ndarray) and b.ndim > 2:
            # batched constant right factors (per head): the worst one bounds every slice
            mats = b.reshape(-1, b.shape[-2], b.shape[-1])
            flows = [_right_linear(a, m, None, norm, out_shapes[0]) for m in mats]
            return [Flow(max(f.lip for f in flows), _max_or_none([f.radius for f in flows]),
                         out_shapes[0])]
        if isinstance(b, Flow) and isinstance(a, np.ndarray) and a.ndim == 2:
            # C @ X mixes rows (tokens): ||C X||_F <= ||C||_2 ||X||_F; inf: ||C||_inf
            op_norm = linear_bound(a, "2") if norm == "2" else linear_bound(a, "inf")
            return [Flow(mul_up(b.lip, op_norm), None, out_shapes[0])]
        raise NotCertified(f"MatMul node {node.name} multiplies two input-dependent tensors "
                           "outside a recognised attention layer: not Lipschitz in general")


def _max_or_none(xs: list[float | None]) -> float | None:
    return None if any(x is None for x in xs) else max(x for x in xs if x is not None)


def _right_linear(a: Flow, w: np.ndarray, bias: np.ndarray | None, norm: str,
                  out_shape: tuple[int, ...]) -> Flow:
    """`x -> x W (+ b)` on every row, W (in, out) in the row-vector convention."""
    wt = w.T  # torch layout (out, in) for linear_bound (a view: norms read any layout)
    lip = linear_bound(wt, norm)
    radius = None
    if a.radius is not None:
        w2 = lip if norm == "2" else linear_bound(wt, "2")
        radius = mul_up(w2, a.radius)
        if bias is not None:
            radius = add_up(radius, _max_row_norm(np.broadcast_to(bias, (w.shape[1],))
                                                   if bias.ndim == 0 else bias))
    return Flow(mul_up(a.lip, lip), radius, out_shape)


def gemm_epilogue(node: Node, product: Tensor, ins: list[Tensor | None]) -> Tensor:
    """What Gemm does after its product: `alpha A'B' + beta C`."""
    y = node.attrs.get("alpha", 1.0) * product
    if len(ins) > 2 and ins[2] is not None:
        y = y + node.attrs.get("beta", 1.0) * ins[2]
    return y


@register
class GemmOp(Op):
    types = ("Gemm",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        a, b = ins[0], ins[1]
        assert a is not None and b is not None
        if node.attrs.get("transA", 0):
            a = a.T
        if node.attrs.get("transB", 0):
            b = b.T
        return [gemm_epilogue(node, a @ b, ins)]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a, b = args[0], args[1]
        c = args[2] if len(args) > 2 else None
        if not (isinstance(a, Flow) and isinstance(b, np.ndarray)) or isinstance(c, Flow) \
                or node.attrs.get("transA", 0):
            raise NotCertified(f"Gemm node {node.name}: only input @ constant is supported")
        w = b.T if node.attrs.get("transB", 0) else b
        w = w * float(node.attrs.get("alpha", 1.0))
        bias = None if c is None else np.asarray(c) * float(node.attrs.get("beta", 1.0))
        return [_right_linear(a, w, bias, norm, out_shapes[0])]


# ---- elementwise arithmetic ---------------------------------------------------------------

def _broadcast_add_radius(flow: Flow, c: np.ndarray) -> float | None:
    if flow.radius is None:
        return None
    c = np.asarray(c, dtype=np.float64)
    width = _row_width(flow.shape)
    if c.ndim == 0 or c.shape[-1] == 1:
        # a scalar (or per-row constant) added to every coordinate of a row
        return add_up(flow.radius, mul_up(float(np.abs(c).max()), sqrt_up(width)))
    return add_up(flow.radius, _max_row_norm(c))


@register
class AddSubOp(Op):
    types = ("Add", "Sub")

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        a, b = ins[0], ins[1]
        return [a + b if node.op_type == "Add" else a - b]  # type: ignore[operator]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a, b = args[0], args[1]
        shape = out_shapes[0]
        if isinstance(a, Flow) and isinstance(b, Flow):
            if a.shape != shape or b.shape != shape:
                raise NotCertified(f"{node.op_type} node {node.name} broadcasts an "
                                   "input-dependent tensor")
            # Lip(f + g) <= Lip(f) + Lip(g): residual connections
            r = None if a.radius is None or b.radius is None else add_up(a.radius, b.radius)
            return [Flow(add_up(a.lip, b.lip), r, shape)]
        flow, const = (a, b) if isinstance(a, Flow) else (b, a)
        assert isinstance(flow, Flow) and isinstance(const, np.ndarray)
        if flow.shape != shape:
            raise NotCertified(f"{node.op_type} node {node.name} broadcasts an "
                               "input-dependent tensor")
        return [Flow(flow.lip, _broadcast_add_radius(flow, const), shape)]


@register
class MulDivOp(Op):
    types = ("Mul", "Div")

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        a, b = ins[0], ins[1]
        assert a is not None and b is not None
        if node.op_type == "Mul":
            return [a * b]
        if not a.is_floating_point() and not b.is_floating_point():
            return [torch.div(a, b, rounding_mode="trunc")]
        return [a / b]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a, b = args[0], args[1]
        if node.op_type == "Mul" and isinstance(b, Flow) and isinstance(a, np.ndarray):
            a, b = b, a
        if not (isinstance(a, Flow) and isinstance(b, np.ndarray)):
            raise NotCertified(f"{node.op_type} node {node.name} of two input-dependent "
                               "tensors (or a constant divided by one) outside a recognised "
                               "pattern: not Lipschitz in general")
        if a.shape != out_shapes[0]:
            raise NotCertified(f"{node.op_type} node {node.name} broadcasts an "
                               "input-dependent tensor")
        c = np.abs(np.asarray(b, dtype=np.float64))
        if node.op_type == "Mul":
            factor = float(c.max()) if c.size else 0.0
        else:
            if c.size == 0 or float(c.min()) == 0.0:
                raise NotCertified(f"Div node {node.name} divides by zero")
            factor = div_up(1.0, float(c.min()))
        # a diagonal scaling: operator norm max|c| in both norms; rows shrink or grow alike
        radius = None if a.radius is None else mul_up(a.radius, factor)
        return [Flow(mul_up(a.lip, factor), radius, out_shapes[0])]


@register
class NegOp(Op):
    types = ("Neg",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        return [-ins[0]]  # type: ignore[operator]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a = args[0]
        assert isinstance(a, Flow)
        return [Flow(a.lip, a.radius, out_shapes[0])]


# ---- activations --------------------------------------------------------------------------

@register
class ActivationOp(Op):
    types = ("Relu", "Tanh", "Sigmoid", "Gelu", "Erf")

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        t = node.op_type
        if t == "Relu":
            return [torch.relu(x)]
        if t == "Tanh":
            return [torch.tanh(x)]
        if t == "Sigmoid":
            return [torch.sigmoid(x)]
        if t == "Erf":
            return [torch.erf(x)]
        approx = node.attrs.get("approximate", b"none")
        approx = approx.decode() if isinstance(approx, bytes) else str(approx)
        return [torch.nn.functional.gelu(x, approximate=approx)]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a = args[0]
        assert isinstance(a, Flow)
        t = node.op_type
        lip = ERF_LIPSCHITZ if t == "Erf" else ACTIVATION_LIPSCHITZ[t.lower()]
        width = _row_width(a.shape)
        if t in ("Sigmoid",):
            radius: float | None = sqrt_up(width)  # values in (0, 1)
        elif t in ("Tanh", "Erf"):
            radius = sqrt_up(width) if a.radius is None else min(sqrt_up(width),
                                                                 mul_up(lip, a.radius))
        else:
            # act(0) = 0 and |act(x)| <= L |x| coordinate-wise
            radius = None if a.radius is None else mul_up(lip, a.radius)
        return [Flow(mul_up(a.lip, lip), radius, out_shapes[0])]


@register
class SoftmaxOp(Op):
    types = ("Softmax",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        return [torch.softmax(ins[0], dim=int(node.attrs.get("axis", -1)))]  # type: ignore[arg-type]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a = args[0]
        assert isinstance(a, Flow)
        axis = int(node.attrs.get("axis", -1)) % max(len(a.shape), 1)
        # probabilities: a row along the softmax axis has 2-norm <= 1, any row <= sqrt(width)
        radius = 1.0 if axis == len(a.shape) - 1 else sqrt_up(_row_width(a.shape))
        return [Flow(mul_up(a.lip, SOFTMAX_LIPSCHITZ), radius, out_shapes[0])]


@register
class LayerNormOp(Op):
    types = ("LayerNormalization",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        x, scale = ins[0], ins[1]
        assert x is not None and scale is not None
        bias = ins[2] if len(ins) > 2 else None
        axis = int(node.attrs.get("axis", -1)) % x.dim()
        y = torch.nn.functional.layer_norm(x, tuple(x.shape[axis:]), scale, bias,
                                           float(node.attrs.get("epsilon", 1e-5)))
        return [y]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a, gamma = args[0], args[1]
        beta = args[2] if len(args) > 2 else None
        if not isinstance(a, Flow) or not isinstance(gamma, np.ndarray) \
                or isinstance(beta, Flow):
            raise NotCertified(f"LayerNormalization node {node.name}: scale and bias must be "
                               "constants")
        if int(node.attrs.get("axis", -1)) % len(a.shape) != len(a.shape) - 1:
            raise NotCertified(f"LayerNormalization node {node.name} normalises over more "
                               "than the last axis")
        eps = decimal_attr(float(node.attrs.get("epsilon", 1e-5)))
        return [layernorm_flow(a, gamma, beta, eps, norm, out_shapes[0])]


def decimal_attr(x: float) -> float:
    """A float32 attribute read as the shortest decimal that rounds to it: the value the
    exporter was given (eps=1e-5 is stored as 9.99999974738e-06). The native analyser reads
    the configured value too; see docs/bounds.md, "Conventions"."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-")) \
        if abs(x) >= 1e-30 else float(x)


def layernorm_flow(a: Flow, gamma: np.ndarray, beta: np.ndarray | None, eps: float, norm: str,
                   shape: tuple[int, ...]) -> Flow:
    """Shared by the LayerNormalization op and the decomposed pattern (native rule's numbers)."""
    width = _row_width(shape)
    g = np.broadcast_to(np.asarray(gamma, dtype=np.float64), (width,))
    if eps <= 0:
        raise NotCertified("LayerNorm with epsilon <= 0 is not Lipschitz")
    upper = layernorm_bound(g, eps, norm)
    gmax = float(np.abs(g).max())
    b = 0.0 if beta is None else linear_bound(
        np.broadcast_to(np.asarray(beta, dtype=np.float64), (width,))[None, :], "2")
    radius = add_up(mul_up(sqrt_up(width), gmax), b)
    return Flow(mul_up(a.lip, upper), radius, shape)


# ---- layout -------------------------------------------------------------------------------

class _LayoutOp(Op):
    """Ops that move entries without changing them: isometries in both norms."""

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a = args[0]
        if not isinstance(a, Flow) or any(isinstance(x, Flow) for x in args[1:]):
            raise NotCertified(f"{node.op_type} node {node.name}: input-dependent shape "
                               "arguments")
        out = []
        for shape in out_shapes:
            keeps_rows = bool(shape) and bool(a.shape) and shape[-1] == a.shape[-1] \
                and self.keeps_last_axis(node, a.shape)
            out.append(Flow(a.lip, a.radius if keeps_rows else None, shape))
        return out  # type: ignore[return-value]

    def keeps_last_axis(self, node: Node, in_shape: tuple[int, ...]) -> bool:
        return True


@register
class ReshapeOp(_LayoutOp):
    types = ("Reshape",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        x, shape = ins[0], _ints(ins[1])
        assert x is not None
        allowzero = int(node.attrs.get("allowzero", 0))
        target = [x.shape[i] if (s == 0 and not allowzero) else s for i, s in enumerate(shape)]
        return [x.reshape(tuple(target))]


@register
class FlattenOp(_LayoutOp):
    types = ("Flatten",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        axis = int(node.attrs.get("axis", 1)) % max(x.dim(), 1)
        lead = int(np.prod(x.shape[:axis])) if axis else 1
        return [x.reshape(lead, -1)]


@register
class TransposeOp(_LayoutOp):
    types = ("Transpose",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        perm = node.attrs.get("perm") or list(range(x.dim()))[::-1]
        return [x.permute(*perm)]

    def keeps_last_axis(self, node: Node, in_shape: tuple[int, ...]) -> bool:
        perm = node.attrs.get("perm") or list(range(len(in_shape)))[::-1]
        return int(perm[-1]) == len(in_shape) - 1


@register
class SqueezeOp(_LayoutOp):
    types = ("Squeeze", "Unsqueeze")

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        axes = _ints(ins[1]) if len(ins) > 1 and ins[1] is not None else list(
            node.attrs.get("axes", []))
        if node.op_type == "Squeeze":
            if not axes:
                return [x.squeeze()]
            axes = sorted(a % x.dim() for a in axes)
            for a in reversed(axes):
                x = x.squeeze(a)
            return [x]
        rank = x.dim() + len(axes)
        for a in sorted(a % rank for a in axes):
            x = x.unsqueeze(a)
        return [x]


@register
class IdentityOp(_LayoutOp):
    types = ("Identity", "Dropout")

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        if node.op_type == "Dropout" and len(node.outputs) > 1:
            return [x, torch.ones_like(x, dtype=torch.bool)]
        return [x]


@register
class CastOp(_LayoutOp):
    types = ("Cast",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        return [ins[0].to(torch_dtype(int(node.attrs["to"]), ctx))]  # type: ignore[union-attr]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        if int(node.attrs["to"]) not in FLOAT_TYPES:
            raise NotCertified(f"Cast node {node.name} turns an input-dependent tensor into "
                               "integers or booleans")
        return super().bound(node, args, out_shapes, norm)


def _slice_indices(dim: int, start: int, end: int, step: int) -> list[int]:
    # ONNX clamps like Python slicing does
    return list(range(*slice(start, end, step).indices(dim)))


@register
class SliceOp(_LayoutOp):
    types = ("Slice",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        starts, ends = _ints(ins[1]), _ints(ins[2])
        axes = _ints(ins[3]) if len(ins) > 3 and ins[3] is not None else list(
            range(len(starts)))
        steps = _ints(ins[4]) if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
        for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
            a %= x.dim()
            idx = _slice_indices(x.shape[a], s, e, st)
            if st == 1 and idx:
                x = x.narrow(a, idx[0], len(idx))
            else:
                x = x.index_select(a, torch.tensor(idx, dtype=torch.long, device=x.device))
        return [x]


@register
class GatherOp(_LayoutOp):
    types = ("Gather",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        x, idx = ins[0], ins[1]
        assert x is not None and idx is not None
        axis = int(node.attrs.get("axis", 0)) % x.dim()
        flat = idx.reshape(-1).long()
        flat = torch.where(flat < 0, flat + x.shape[axis], flat)
        out = x.index_select(axis, flat)
        return [out.reshape((*x.shape[:axis], *idx.shape, *x.shape[axis + 1:]))]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a, idx = args[0], args[1]
        if not isinstance(a, Flow) or not isinstance(idx, np.ndarray):
            raise NotCertified(f"Gather node {node.name} with input-dependent indices")
        flows = super().bound(node, args, out_shapes, norm)
        _, counts = np.unique(np.asarray(idx).reshape(-1), return_counts=True)
        mult = int(counts.max()) if counts.size else 1
        if mult > 1 and norm == "2":  # repeated entries count repeatedly in the 2-norm
            f = flows[0]
            assert f is not None
            flows = [Flow(mul_up(f.lip, sqrt_up(mult)), f.radius, f.shape)]
        axis = int(node.attrs.get("axis", 0)) % len(a.shape)
        if axis == len(a.shape) - 1 and a.radius is not None:
            f = flows[0]
            assert f is not None
            flows = [Flow(f.lip, mul_up(a.radius, sqrt_up(mult)), f.shape)]
        return flows


@register
class ConcatOp(Op):
    types = ("Concat",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        xs = [x for x in ins if x is not None]
        dtype = torch.promote_types(xs[0].dtype, xs[-1].dtype)
        return [torch.cat([x.to(dtype) for x in xs], dim=int(node.attrs["axis"]))]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        flows = [a for _, a in _variables(args)]
        shape = out_shapes[0]
        axis = int(node.attrs["axis"]) % len(shape)
        # ||[df; dg]||_2 <= sqrt(Lf^2 + Lg^2) ||dx||; inf-norm: the max
        if norm == "2":
            lip = sqrt_up(add_up(*(mul_up(f.lip, f.lip) for f in flows)))
        else:
            lip = max(f.lip for f in flows)
        radii = [f.radius for f in flows]
        consts = [a for a in args if isinstance(a, np.ndarray)]
        radius: float | None = None
        if all(r is not None for r in radii):
            if axis == len(shape) - 1:
                parts = [mul_up(r, r) for r in radii if r is not None]
                parts += [mul_up(_max_row_norm(c), _max_row_norm(c)) for c in consts]
                radius = sqrt_up(add_up(*parts))
            else:
                radius = max([r for r in radii if r is not None]
                             + [_max_row_norm(c) for c in consts])
        return [Flow(lip, radius, shape)]


@register
class SplitOp(_LayoutOp):
    types = ("Split",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        axis = int(node.attrs.get("axis", 0)) % x.dim()
        sizes = _ints(ins[1]) if len(ins) > 1 and ins[1] is not None else list(
            node.attrs.get("split", []))
        if not sizes:
            n = int(node.attrs.get("num_outputs", len(node.outputs)))
            chunk = -(-x.shape[axis] // n)
            sizes = [min(chunk, x.shape[axis] - i * chunk) for i in range(n)]
        return list(torch.split(x, sizes, dim=axis))

    def keeps_last_axis(self, node: Node, in_shape: tuple[int, ...]) -> bool:
        return True  # a part of a row has a smaller norm than the row


@register
class ExpandOp(Op):
    types = ("Expand",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        shape = torch.broadcast_shapes(tuple(x.shape), tuple(_ints(ins[1])))
        return [x.expand(shape)]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a = args[0]
        assert isinstance(a, Flow)
        factor = int(np.prod(out_shapes[0])) // max(int(np.prod(a.shape)), 1)
        lip = a.lip if norm == "inf" else mul_up(a.lip, sqrt_up(factor))
        same_rows = bool(a.shape) and out_shapes[0][-1] == a.shape[-1]
        return [Flow(lip, a.radius if same_rows else None, out_shapes[0])]


@register
class ReduceOp(Op):
    types = ("ReduceMean", "ReduceSum", "ReduceMax")

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        axes = _ints(ins[1]) if len(ins) > 1 and ins[1] is not None else list(
            node.attrs.get("axes", []))
        keep = bool(node.attrs.get("keepdims", 1))
        if not axes:
            if node.attrs.get("noop_with_empty_axes", 0):
                return [x]
            axes = list(range(x.dim()))
        dims = tuple(sorted(a % x.dim() for a in axes))
        if node.op_type == "ReduceMean":
            return [x.mean(dim=dims, keepdim=keep)]
        if node.op_type == "ReduceSum":
            return [x.sum(dim=dims, keepdim=keep)]
        return [x.amax(dim=dims, keepdim=keep)]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a = args[0]
        assert isinstance(a, Flow)
        m = max(int(np.prod(a.shape)) // max(int(np.prod(out_shapes[0])), 1), 1)
        # a mean or a max of m entries is 1-Lipschitz in both norms; a sum is not
        factor = (sqrt_up(m) if norm == "2" else float(m)) if node.op_type == "ReduceSum" \
            else 1.0
        return [Flow(mul_up(a.lip, factor), None, out_shapes[0])]


@register
class WhereOp(Op):
    types = ("Where",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        c, x, y = ins
        assert c is not None and x is not None and y is not None
        return [torch.where(c.bool(), x, y)]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        c, x, y = args
        if isinstance(c, Flow):
            raise NotCertified(f"Where node {node.name} with an input-dependent condition")
        flows = [f for f in (x, y) if isinstance(f, Flow)]
        if any(f.shape != out_shapes[0] for f in flows):
            raise NotCertified(f"Where node {node.name} broadcasts an input-dependent tensor")
        # a constant mask selects entries: each output entry copies one input entry
        # (2-norm: the selected entries of both inputs, sqrt(Lx^2 + Ly^2); inf-norm: the max)
        if len(flows) == 2 and norm == "2":
            lip = sqrt_up(add_up(*(mul_up(f.lip, f.lip) for f in flows)))
        else:
            lip = max(f.lip for f in flows)
        return [Flow(lip, None, out_shapes[0])]


# ---- ops that only ever see constants or shapes -------------------------------------------

class _ConstantOnly(Op):
    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        raise NotCertified(f"{node.op_type} node {node.name} applied to an input-dependent "
                           "tensor outside a recognised pattern")


@register
class ConstantOp(_ConstantOnly):
    types = ("Constant",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        a = node.attrs
        if "value" in a:
            return [tensor_from_proto(a["value"], ctx)]
        if "value_float" in a:
            return [torch.tensor(a["value_float"], dtype=ctx.float_dtype)]
        if "value_floats" in a:
            return [torch.tensor(list(a["value_floats"]), dtype=ctx.float_dtype)]
        if "value_int" in a:
            return [torch.tensor(a["value_int"], dtype=torch.int64)]
        if "value_ints" in a:
            return [torch.tensor(list(a["value_ints"]), dtype=torch.int64)]
        raise NotImplementedError(f"Constant node {node.name}: unsupported value attribute")


@register
class ShapeOp(Op):
    types = ("Shape", "Size")

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        if node.op_type == "Size":
            return [torch.tensor(x.numel(), dtype=torch.int64)]
        dims = list(x.shape)
        start = int(node.attrs.get("start", 0))
        end = node.attrs.get("end")
        return [torch.tensor(dims[start:None if end is None else int(end)], dtype=torch.int64)]


@register
class ConstantOfShapeOp(_ConstantOnly):
    types = ("ConstantOfShape",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        shape = _ints(ins[0])
        if "value" in node.attrs:
            v = tensor_from_proto(node.attrs["value"], ctx).reshape(())
        else:
            v = torch.tensor(0.0, dtype=ctx.float_dtype)
        return [torch.full(shape, v.item(), dtype=v.dtype)]


@register
class ElementwiseConstOp(_ConstantOnly):
    """Mask and shape arithmetic; Sqrt, Pow and Reciprocal also appear in decomposed
    LayerNorm and scale computations, which patterns or constant folding take care of."""

    types = ("Sqrt", "Pow", "Reciprocal", "Equal", "Less", "Greater", "LessOrEqual",
             "GreaterOrEqual", "Not", "And", "Or", "Mod", "Range", "Trilu", "Exp", "Log",
             "Max", "Min", "IsNaN", "IsInf")

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        t = node.op_type
        x = ins[0]
        assert x is not None
        y = ins[1] if len(ins) > 1 else None
        simple = {"Sqrt": torch.sqrt, "Reciprocal": torch.reciprocal, "Not": torch.logical_not,
                  "Exp": torch.exp, "Log": torch.log, "IsNaN": torch.isnan,
                  "IsInf": torch.isinf}
        if t in simple:
            return [simple[t](x)]
        if t == "Pow":
            return [torch.pow(x, y)]  # type: ignore[arg-type]
        binary = {"Equal": torch.eq, "Less": torch.lt, "Greater": torch.gt,
                  "LessOrEqual": torch.le, "GreaterOrEqual": torch.ge,
                  "And": torch.logical_and, "Or": torch.logical_or}
        if t in binary:
            return [binary[t](x, y)]  # type: ignore[arg-type]
        if t == "Mod":
            if node.attrs.get("fmod", 0):
                return [torch.fmod(x, y)]  # type: ignore[arg-type]
            return [torch.remainder(x, y)]  # type: ignore[arg-type]
        if t in ("Max", "Min"):
            out = x
            for z in ins[1:]:
                out = torch.maximum(out, z) if t == "Max" else torch.minimum(out, z)  # type: ignore[arg-type]
            return [out]
        if t == "Range":
            start, limit, delta = (v.item() for v in ins)  # type: ignore[union-attr]
            return [torch.arange(start, limit, delta, dtype=x.dtype)]
        # Trilu
        k = int(y.item()) if y is not None else 0
        upper = bool(node.attrs.get("upper", 1))
        return [torch.triu(x, k) if upper else torch.tril(x, k)]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        t = node.op_type
        if t in ("Max", "Min") and all(isinstance(a, np.ndarray) for a in args[1:]):
            a = args[0]
            assert isinstance(a, Flow)
            if a.shape == out_shapes[0]:  # clipping is 1-Lipschitz
                return [Flow(a.lip, None, a.shape)]
        return super().bound(node, args, out_shapes, norm)


@register
class EinsumOp(_ConstantOnly):
    """Appears in weight arithmetic (folded to constants); on input-dependent operands the
    analysis refuses it rather than guess which contraction it is."""

    types = ("Einsum",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        eq = node.attrs["equation"]
        eq = eq.decode() if isinstance(eq, bytes) else str(eq)
        return [torch.einsum(eq, *[x for x in ins if x is not None])]


def supported_op_types() -> list[str]:
    return sorted(OPS)


def unsupported_ops(nodes: Sequence[Node]) -> dict[str, int]:
    """Op types (with counts) the registry has no torch implementation for."""
    counts: dict[str, int] = {}
    for n in nodes:
        if n.op_type not in OPS or n.domain not in ("", "ai.onnx"):
            key = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"
            counts[key] = counts.get(key, 0) + 1
    return counts


__all__ = [
    "ERF_LIPSCHITZ",
    "OPS",
    "Flow",
    "Node",
    "NotCertified",
    "Op",
    "RunContext",
    "layernorm_flow",
    "supported_op_types",
    "unsupported_ops",
]
