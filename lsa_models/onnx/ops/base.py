"""The op registry's base: decoded nodes, flows, the `Op` interface and the registry.

`run` evaluates a node in torch (graph.py). `bound` bounds a generic node (analyzer.py lowers
each to the engine's `OpNode`): input-dependent operands carry a `Flow` (the engine's `Value`:
docs/engine.md, "The value type"), the others are float64 constants; an op without a rule for
its use raises `NotCertified`. Recognised composites (attention, decomposed norms, written-out
GELU) never reach the rules.
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
from ...operators.constants import from_proto
from ...operators.linear import GlobalOperator, Refused, Unevaluable
from ...operators.registry import global_operator


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


@dataclass
class RunContext:
    float_dtype: torch.dtype = torch.float32


Arg = Flow | np.ndarray


def tensor_from_proto(t: onnx.TensorProto, ctx: RunContext) -> Tensor:
    return from_proto(t, ctx.float_dtype)


class Op:
    """One op family. `run` evaluates it in torch; `bound` propagates flows."""

    types: ClassVar[tuple[str, ...]] = ()

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        raise NotImplementedError

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        raise NotCertified(f"{node.op_type} node {node.name} has no Lipschitz rule for "
                           "input-dependent operands")


class RegistryOp(Op):
    """An op whose evaluation and global rule are its class's in lsa_models/operators/ (the
    registry's `global_operator`); its refusals name the node."""

    def operator(self, node: Node) -> GlobalOperator:
        op = global_operator(node.op_type, node.attrs)
        assert op is not None, node.op_type
        return op

    def run(self, node: Node, ins: list[Tensor | None], ctx: RunContext) -> list[Tensor]:
        # (ctx: only a Cast reads it; some callers evaluate ops that never cast without one)
        dtype = None if ctx is None else ctx.float_dtype
        try:
            return self.operator(node).evaluate_inputs(ins, dtype, len(node.outputs))
        except Unevaluable as e:
            raise NotImplementedError(f"{node.op_type} node {node.name}{e.tail}") from None

    def bound(self, node: Node, args: list[Arg | None], out_shapes: list[tuple[int, ...]],
              norm: str) -> list[Flow | None]:
        try:
            outs = self.operator(node).global_bound(args, out_shapes, norm)
        except Refused as e:
            raise NotCertified(f"{node.op_type} node {node.name}{e.tail}") from None
        return [None if o is None else Flow(o.lip, o.radius, shape)
                for o, shape in zip(outs, out_shapes, strict=False)]


OPS: dict[str, Op] = {}


def register(cls: type[Op]) -> type[Op]:
    inst = cls()
    for t in cls.types:
        OPS[t] = inst
    return cls


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
