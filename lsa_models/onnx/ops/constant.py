"""Ops that only ever see constants or shapes (and Einsum on weights)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from .base import (
    Arg,
    Flow,
    Node,
    NotCertified,
    Op,
    RunContext,
    _ints,
    register,
    tensor_from_proto,
)

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
    LayerNorm and scale computations, which patterns or constant folding take care of; Cos and
    Sin in rotary position tables computed from position ids (constants of the input)."""

    types = ("Sqrt", "Pow", "Reciprocal", "Equal", "Less", "Greater", "LessOrEqual",
             "GreaterOrEqual", "Not", "And", "Or", "Mod", "Range", "Trilu", "Exp", "Log",
             "Max", "Min", "IsNaN", "IsInf", "Cos", "Sin")

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        t = node.op_type
        x = ins[0]
        assert x is not None
        y = ins[1] if len(ins) > 1 else None
        simple = {"Sqrt": torch.sqrt, "Reciprocal": torch.reciprocal, "Not": torch.logical_not,
                  "Cos": torch.cos, "Sin": torch.sin,
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

