"""The torch evaluator of an ONNX graph: an `nn.Module` mapping (B, N, D) -> the graph output.

Every node runs through the op registry (ops.py), so the graph is differentiable with
autograd. Tensors that do not depend on the model input are folded once at build time;
shape arithmetic (Shape, Gather of shapes, Concat of dims) runs at call time, so graphs
with dynamic batch or sequence dimensions evaluate at any size they accept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
import torch
from torch import Tensor, nn

from .ops import OPS, Node, RunContext, tensor_from_proto


@dataclass
class GraphSpec:
    """What the loader decided about a graph (loading.py)."""

    model: onnx.ModelProto
    nodes: list[Node]
    input_name: str  # the tensor the continuous input (B, N, D) is fed into
    output_name: str
    d_model: int
    seq_len: int | None  # fixed N, or None when dynamic
    batch: int | None  # fixed batch size of the graph, or None when dynamic
    rank: int  # 3: (B, N, D) input; 2: (N, D), the batch is looped over
    # Nodes that only compute the continuous input from token ids (an embedding lookup):
    # skipped, the input is fed into `input_name` directly.
    skipped: set[str] = field(default_factory=set)
    ids_name: str | None = None  # the token-ids graph input when an embedding is skipped
    opset: int = 0

    @property
    def initializers(self) -> dict[str, onnx.TensorProto]:
        return {t.name: t for t in self.model.graph.initializer}


class GraphModule(nn.Module):
    """Evaluates the graph in torch; `float_dtype` float32 (as exported) or float64."""

    def __init__(self, spec: GraphSpec, float_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.spec = spec
        self.ctx = RunContext(float_dtype)
        self.d_model = spec.d_model
        self.default_seq_len = spec.seq_len
        consts: dict[str, Tensor] = {
            name: tensor_from_proto(t, self.ctx) for name, t in spec.initializers.items()
        }
        self.runtime_nodes: list[Node] = []
        dynamic = {spec.input_name}
        if spec.ids_name:
            dynamic.add(spec.ids_name)
        for node in spec.nodes:
            if node.name in spec.skipped:
                continue
            if any(i in dynamic for i in node.inputs if i):
                dynamic.update(node.outputs)
                self.runtime_nodes.append(node)
                continue
            # depends on constants only: fold now
            outs = OPS[node.op_type].run(node, [consts[i] if i else None for i in node.inputs],
                                         self.ctx)
            for name, value in zip(node.outputs, outs, strict=False):
                if name:
                    consts[name] = value
        self.consts = consts

    def with_dtype(self, float_dtype: torch.dtype) -> GraphModule:
        return GraphModule(self.spec, float_dtype)

    def run_env(self, x: Tensor, overrides: dict[str, Tensor] | None = None,
                stop: str | None = None) -> dict[str, Tensor]:
        """All tensors of one evaluation on a batch the graph accepts as it is.

        `overrides` replace computed tensors (the nodes producing them are skipped); `stop`
        ends the evaluation once that tensor is known.
        """
        env: dict[str, Tensor] = dict(self.consts)
        env[self.spec.input_name] = x
        if self.spec.ids_name:
            env[self.spec.ids_name] = torch.zeros(x.shape[:-1], dtype=torch.int64)
        if overrides:
            env.update(overrides)
        for node in self.runtime_nodes:
            if stop is not None and stop in env:
                break
            if overrides and all(o in overrides for o in node.outputs if o):
                continue
            ins = [env[i] if i else None for i in node.inputs]
            outs = OPS[node.op_type].run(node, ins, self.ctx)
            for name, value in zip(node.outputs, outs, strict=False):
                if name and not (overrides and name in overrides):
                    env[name] = value
        return env

    def _call_graph(self, x: Tensor) -> Tensor:
        return self.run_env(x, stop=self.spec.output_name)[self.spec.output_name]

    def forward(self, x: Tensor) -> Tensor:  # x: (B, N, D)
        x = x.to(self.ctx.float_dtype)
        if self.spec.rank == 2:
            return torch.stack([self._call_graph(xb) for xb in x])  # (B, ...)
        fixed = self.spec.batch
        if fixed is None or x.shape[0] == fixed:
            return self._call_graph(x)
        if x.shape[0] % fixed:
            raise ValueError(f"the graph has a fixed batch size {fixed}; got {x.shape[0]}")
        return torch.cat([self._call_graph(c) for c in x.split(fixed)])
