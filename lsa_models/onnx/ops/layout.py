"""Layout ops: reshape, transpose, slice, gather, concat, split, expand, cast."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ...bounds.numerics import (
    add_up,
    mul_up,
    sqrt_up,
)
from .base import (
    FLOAT_TYPES,
    Arg,
    Flow,
    Node,
    NotCertified,
    Op,
    RunContext,
    _ints,
    _max_row_norm,
    _variables,
    register,
    torch_dtype,
)

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
        # ONNX allows axis in [-r, r]: axis = r flattens everything into the first dimension
        axis = int(node.attrs.get("axis", 1))
        axis = axis + x.dim() if axis < 0 else axis
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
class GatherElementsOp(Op):
    """`out[i][j][k] = x[idx[i][j][k]][j][k]` (axis 0): each output entry copies one input
    entry (BERT's TorchScript export gathers its position ids this way, on constants).

    Bound with constant indices: an input entry copied m times counts m times in the squared
    2-norm, so the constant is sqrt(m) for the largest m (1 in the inf-norm: each output
    entry depends on one input entry with coefficient 1)."""

    types = ("GatherElements",)

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        x, idx = ins[0], ins[1]
        assert x is not None and idx is not None
        axis = int(node.attrs.get("axis", 0)) % x.dim()
        index = idx.long()
        index = torch.where(index < 0, index + x.shape[axis], index)
        return [torch.gather(x, axis, index)]

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        a, idx = args[0], args[1]
        if not isinstance(a, Flow) or not isinstance(idx, np.ndarray):
            raise NotCertified(f"GatherElements node {node.name} with input-dependent indices")
        axis = int(node.attrs.get("axis", 0)) % len(a.shape)
        index = np.asarray(idx).astype(np.int64)
        index = np.where(index < 0, index + a.shape[axis], index)
        coords: list[np.ndarray] = list(np.indices(index.shape))
        coords[axis] = index
        flat = np.ravel_multi_index(tuple(coords), a.shape).reshape(-1)
        mult = int(np.bincount(flat).max()) if flat.size else 1
        factor = sqrt_up(mult) if norm == "2" and mult > 1 else 1.0
        return [Flow(mul_up(a.lip, factor), None, out_shapes[0])]


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
