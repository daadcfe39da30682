"""The layout family: Reshape, Flatten, Transpose, Squeeze/Unsqueeze, Identity/Dropout, Cast,
Slice, Gather, GatherElements, Concat, Split and Expand; and the ONNX element types the
evaluator maps to torch's.

These ops move entries without changing them. Reshape, Flatten, Transpose, Squeeze,
Unsqueeze, Identity, Dropout (inference), Cast to a float type, Slice and Split are
isometries or restrictions in both norms: the Lipschitz constant passes unchanged, and the
token radius too where the output keeps the input's rows (its last axis is the input's, and a
Transpose keeps the last axis last; a Split's part of a row is no longer than the row). Their
shape arguments must be constants; a Cast to integers or booleans has no rule. Gather with
constant indices copies entries: an entry copied m times counts m times in the squared 2-norm
(sqrt(m); 1 in the inf-norm), and a gather along the last axis grows a row by sqrt(m).
GatherElements likewise with m the most copies of one entry, no radius. Concat:
||[df; dg]|| <= sqrt(Lf^2 + Lg^2) (inf: the max); along the last axis rows join (the root of
the squared radii and the constants' row norms), along another the largest. Expand repeats
each entry (factor) times: sqrt(factor) in the 2-norm, 1 in the inf-norm; rows pass when the
last axis is kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import torch
from torch import Tensor

from ..bounds.numerics import add_up, mul_up, sqrt_up
from .linear import (
    Arg,
    GlobalOperator,
    Out,
    axes_of,
    ints,
    is_var,
    max_row_norm,
    variables,
)

ONNX_TO_TORCH: dict[int, torch.dtype] = {
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


def element_dtype(onnx_type: int, float_dtype: torch.dtype | None) -> torch.dtype:
    """The torch dtype of an ONNX element type; floats in the evaluator's one precision."""
    if onnx_type in FLOAT_TYPES:
        assert float_dtype is not None
        return float_dtype  # the evaluator runs in one float precision
    if onnx_type not in ONNX_TO_TORCH:
        raise NotImplementedError(f"tensor element type {onnx_type} is not supported")
    return ONNX_TO_TORCH[onnx_type]


class Layout(GlobalOperator):
    """Ops that move entries without changing them: isometries in both norms."""

    def global_bound(self, args: Sequence[Arg], out_shapes: list[tuple[int, ...]],
                     norm: str) -> list[Out | None]:
        a = args[0]
        if not is_var(a) or any(is_var(x) for x in args[1:]):
            raise self.refused(": input-dependent shape arguments")
        out: list[Out | None] = []
        for shape in out_shapes:
            keeps_rows = bool(shape) and bool(a.shape) and shape[-1] == a.shape[-1] \
                and self.keeps_last_axis(a.shape)
            out.append(Out(a.lip, a.radius if keeps_rows else None))
        return out

    def keeps_last_axis(self, in_shape: tuple[int, ...]) -> bool:
        return True


class Reshape(Layout):
    types = ("Reshape",)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        x, shape = ins[0], ints(ins[1])
        assert x is not None
        allowzero = int(self.attrs.get("allowzero", 0))
        target = [x.shape[i] if (s == 0 and not allowzero) else s for i, s in enumerate(shape)]
        return [x.reshape(tuple(target))]


class Flatten(Layout):
    types = ("Flatten",)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        # ONNX allows axis in [-r, r]: axis = r flattens everything into the first dimension
        axis = int(self.attrs.get("axis", 1))
        axis = axis + x.dim() if axis < 0 else axis
        lead = int(np.prod(x.shape[:axis])) if axis else 1
        return [x.reshape(lead, -1)]


class Transpose(Layout):
    types = ("Transpose",)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        perm = self.attrs.get("perm") or list(range(x.dim()))[::-1]
        return [x.permute(*perm)]

    def keeps_last_axis(self, in_shape: tuple[int, ...]) -> bool:
        perm = self.attrs.get("perm") or list(range(len(in_shape)))[::-1]
        return int(perm[-1]) == len(in_shape) - 1


class Squeeze(Layout):
    types = ("Squeeze", "Unsqueeze")

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        axes = axes_of(ins, self.attrs)
        if self.op_type == "Squeeze":
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


class Identity(Layout):
    types = ("Identity", "Dropout")

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        if self.op_type == "Dropout" and n_outputs > 1:
            return [x, torch.ones_like(x, dtype=torch.bool)]
        return [x]


class Cast(Layout):
    types = ("Cast",)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        return [ins[0].to(element_dtype(int(self.attrs["to"]), float_dtype))]  # type: ignore[union-attr]

    def global_bound(self, args: Sequence[Arg], out_shapes: list[tuple[int, ...]],
                     norm: str) -> list[Out | None]:
        if int(self.attrs["to"]) not in FLOAT_TYPES:
            raise self.refused(" turns an input-dependent tensor into integers or booleans")
        return super().global_bound(args, out_shapes, norm)


def _slice_indices(dim: int, start: int, end: int, step: int) -> list[int]:
    # ONNX clamps like Python slicing does
    return list(range(*slice(start, end, step).indices(dim)))


class Slice(Layout):
    types = ("Slice",)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        starts, ends = ints(ins[1]), ints(ins[2])
        axes = ints(ins[3]) if len(ins) > 3 and ins[3] is not None else list(
            range(len(starts)))
        steps = ints(ins[4]) if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
        for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
            a %= x.dim()
            idx = _slice_indices(x.shape[a], s, e, st)
            if st == 1 and idx:
                x = x.narrow(a, idx[0], len(idx))
            else:
                x = x.index_select(a, torch.tensor(idx, dtype=torch.long, device=x.device))
        return [x]


class GatherElements(GlobalOperator):
    """`out[i][j][k] = x[idx[i][j][k]][j][k]` (axis 0): each output entry copies one input
    entry (BERT's TorchScript export gathers its position ids this way, on constants).

    Bound with constant indices: an input entry copied m times counts m times in the squared
    2-norm, so the constant is sqrt(m) for the largest m (1 in the inf-norm: each output
    entry depends on one input entry with coefficient 1)."""

    types = ("GatherElements",)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        x, idx = ins[0], ins[1]
        assert x is not None and idx is not None
        axis = int(self.attrs.get("axis", 0)) % x.dim()
        index = idx.long()
        index = torch.where(index < 0, index + x.shape[axis], index)
        return [torch.gather(x, axis, index)]

    def global_bound(self, args: Sequence[Arg], out_shapes: list[tuple[int, ...]],
                     norm: str) -> list[Out | None]:
        a, idx = args[0], args[1]
        if not is_var(a) or not isinstance(idx, np.ndarray):
            raise self.refused(" with input-dependent indices")
        axis = int(self.attrs.get("axis", 0)) % len(a.shape)
        index = np.asarray(idx).astype(np.int64)
        index = np.where(index < 0, index + a.shape[axis], index)
        coords: list[np.ndarray] = list(np.indices(index.shape))
        coords[axis] = index
        flat = np.ravel_multi_index(tuple(coords), a.shape).reshape(-1)
        mult = int(np.bincount(flat).max()) if flat.size else 1
        factor = sqrt_up(mult) if norm == "2" and mult > 1 else 1.0
        return [Out(mul_up(a.lip, factor), None)]


class Gather(Layout):
    types = ("Gather",)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        x, idx = ins[0], ins[1]
        assert x is not None and idx is not None
        axis = int(self.attrs.get("axis", 0)) % x.dim()
        flat = idx.reshape(-1).long()
        flat = torch.where(flat < 0, flat + x.shape[axis], flat)
        out = x.index_select(axis, flat)
        return [out.reshape((*x.shape[:axis], *idx.shape, *x.shape[axis + 1:]))]

    def global_bound(self, args: Sequence[Arg], out_shapes: list[tuple[int, ...]],
                     norm: str) -> list[Out | None]:
        a, idx = args[0], args[1]
        if not is_var(a) or not isinstance(idx, np.ndarray):
            raise self.refused(" with input-dependent indices")
        outs = super().global_bound(args, out_shapes, norm)
        _, counts = np.unique(np.asarray(idx).reshape(-1), return_counts=True)
        mult = int(counts.max()) if counts.size else 1
        if mult > 1 and norm == "2":  # repeated entries count repeatedly in the 2-norm
            f = outs[0]
            assert f is not None
            outs = [Out(mul_up(f.lip, sqrt_up(mult)), f.radius)]
        axis = int(self.attrs.get("axis", 0)) % len(a.shape)
        if axis == len(a.shape) - 1 and a.radius is not None:
            f = outs[0]
            assert f is not None
            outs = [Out(f.lip, mul_up(a.radius, sqrt_up(mult)))]
        return outs


class Concat(GlobalOperator):
    types = ("Concat",)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        xs = [x for x in ins if x is not None]
        dtype = torch.promote_types(xs[0].dtype, xs[-1].dtype)
        return [torch.cat([x.to(dtype) for x in xs], dim=int(self.attrs["axis"]))]

    def global_bound(self, args: Sequence[Arg], out_shapes: list[tuple[int, ...]],
                     norm: str) -> list[Out | None]:
        flows = [a for _, a in variables(args)]
        shape = out_shapes[0]
        axis = int(self.attrs["axis"]) % len(shape)
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
                parts += [mul_up(max_row_norm(c), max_row_norm(c)) for c in consts]
                radius = sqrt_up(add_up(*parts))
            else:
                radius = max([r for r in radii if r is not None]
                             + [max_row_norm(c) for c in consts])
        return [Out(lip, radius)]


class Split(Layout):
    types = ("Split",)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        axis = int(self.attrs.get("axis", 0)) % x.dim()
        sizes = ints(ins[1]) if len(ins) > 1 and ins[1] is not None else list(
            self.attrs.get("split", []))
        if not sizes:
            n = int(self.attrs.get("num_outputs", n_outputs))
            chunk = -(-x.shape[axis] // n)
            sizes = [min(chunk, x.shape[axis] - i * chunk) for i in range(n)]
        return list(torch.split(x, sizes, dim=axis))

    def keeps_last_axis(self, in_shape: tuple[int, ...]) -> bool:
        return True  # a part of a row has a smaller norm than the row


class Expand(GlobalOperator):
    types = ("Expand",)

    def evaluate_inputs(self, ins: Sequence[Tensor | None], float_dtype: torch.dtype | None,
                        n_outputs: int = 1) -> list[Tensor]:
        x = ins[0]
        assert x is not None
        shape = torch.broadcast_shapes(tuple(x.shape), tuple(ints(ins[1])))
        return [x.expand(shape)]

    def global_bound(self, args: Sequence[Arg], out_shapes: list[tuple[int, ...]],
                     norm: str) -> list[Out | None]:
        a = args[0]
        assert is_var(a)
        factor = int(np.prod(out_shapes[0])) // max(int(np.prod(a.shape)), 1)
        lip = a.lip if norm == "inf" else mul_up(a.lip, sqrt_up(factor))
        same_rows = bool(a.shape) and out_shapes[0][-1] == a.shape[-1]
        return [Out(lip, a.radius if same_rows else None)]


__all__ = ["FLOAT_TYPES", "ONNX_TO_TORCH", "Cast", "Concat", "Expand", "Flatten", "Gather",
           "GatherElements", "Identity", "Layout", "Reshape", "Slice", "Split", "Squeeze",
           "Transpose", "element_dtype"]
