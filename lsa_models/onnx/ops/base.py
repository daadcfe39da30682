"""The op registry's base: decoded nodes, flows, the `Op` interface and the registry.

The torch implementations evaluate a graph with autograd (graph.py). The rules bound the
graph's generic nodes (analyzer.py lowers each to the bound engine's `OpNode` layer): every
tensor that depends on the model input carries a `Flow` (the engine's `Value`), the
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

from ...bounds.layer_graph.values import Value
from ...bounds.numerics import (  # noqa: F401  (SILU_LIPSCHITZ: re-exported for the ops)
    SILU_LIPSCHITZ,
    mul_up,
)

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


# What is known about an input-dependent tensor: the bound engine's value type
# (lsa_models/bounds/layer_graph/values.py), `Flow(lip, radius, shape)`.
Flow = Value


class NotCertified(Exception):
    """An op (or its use) for which no certified bound is available."""


class UnsupportedOnnxError(ValueError):
    """Base class of the ONNX loading errors (bad files, unsupported content)."""


@dataclass
class RunContext:
    float_dtype: torch.dtype = torch.float32


Arg = Flow | np.ndarray


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
