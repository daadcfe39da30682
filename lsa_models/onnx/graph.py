"""The torch evaluator of an ONNX graph: an `nn.Module` mapping (B, N, D) -> the graph output.

Every node runs through the op registry (the `ops` package), so the graph is differentiable with
autograd. Tensors that do not depend on the model input are folded once at build time;
shape arithmetic (Shape, Gather of shapes, Concat of dims) runs at call time, so graphs
with dynamic batch or sequence dimensions evaluate at any size they accept.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections import ChainMap, OrderedDict
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import onnx
import torch
from google.protobuf.internal import api_implementation
from torch import Tensor, nn

from .errors import DynamicSeqLenError
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
    # the graph serialised as checked (no external data; shape annotations not added):
    # what onnxruntime loads, so the graph is not serialised again for it
    blob: bytes = b""
    # the upload's input (and output) were sequence-first (N, 1, D): the graph was given
    # transposes to batch-first (loading._to_batch_first)
    seq_first: bool = False
    # the upload's input was an image (B, C, H, W) read by a patch-embedding Conv: the graph
    # takes its patches (B, P, C kh kw) instead (loading._pixels_to_patches); its (C, H, W)
    pixels: tuple[int, ...] | None = None
    # large float32 weights as read-only views of the upload's bytes (light.raw_weight_views):
    # the evaluator's float32 constants, without a copy
    weight_views: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def initializers(self) -> dict[str, onnx.TensorProto]:
        return {t.name: t for t in self.model.graph.initializer}

    @property
    def attention_tokens(self) -> tuple[int, ...]:
        """The key counts of the graph's Softmaxes over square logits (shape inference): the
        tokens its attention sees, N + 1 after a class token."""
        shapes = {vi.name: [d.dim_value if d.HasField("dim_value") else 0
                            for d in vi.type.tensor_type.shape.dim]
                  for vi in self.model.graph.value_info}
        out = set()
        for nd in self.model.graph.node:
            s = shapes.get(nd.input[0]) if nd.op_type == "Softmax" and nd.input else None
            axis = next((a.i for a in nd.attribute if a.name == "axis"), -1)
            if s and len(s) >= 2 and s[axis % len(s)] > 0 and s.count(s[axis % len(s)]) >= 2:
                out.add(s[axis % len(s)])
        return tuple(sorted(out))


_UPB = api_implementation.Type() == "upb"


def _initializer(t: onnx.TensorProto, ctx: RunContext, view: np.ndarray | None = None
                 ) -> Tensor:
    """An initializer as a tensor: over `view` (its bytes in the upload) when given and read
    in float32. Otherwise a float32 weight in raw bytes, read in float32, becomes a
    tensor over the one copy the protobuf accessor hands out (`tensor_from_proto` copies it
    once more: 340 MB of fresh pages for GPT-2-small); with the upb backend nobody else holds
    that bytes object (each access copies), so the tensor may own it although it is marked
    read-only (constants are never written in place). Its size is checked like numpy's
    reshape would."""
    if view is not None and ctx.float_dtype == torch.float32:
        with warnings.catch_warnings():  # "not writable": constants are never written
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(view)
    if (t.data_type != onnx.TensorProto.FLOAT or ctx.float_dtype != torch.float32
            or t.data_location == onnx.TensorProto.EXTERNAL or sys.byteorder != "little"
            or not _UPB):
        return tensor_from_proto(t, ctx)
    raw = t.raw_data
    n = math.prod(t.dims)
    if not raw or n == 0:
        return tensor_from_proto(t, ctx)
    if len(raw) != 4 * n:
        raise ValueError(f"initializer {t.name!r} holds {len(raw)} raw bytes; its shape "
                         f"{list(t.dims)} needs {4 * n}")
    arr = np.frombuffer(raw, dtype="<f4").reshape(tuple(t.dims))
    with warnings.catch_warnings():  # "not writable": the buffer is ours alone (see above)
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


class GraphModule(nn.Module):
    """Evaluates the graph in torch; `float_dtype` float32 (as exported) or float64."""

    def __init__(self, spec: GraphSpec, float_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.spec = spec
        self.ctx = RunContext(float_dtype)
        self.d_model = spec.d_model
        consts: dict[str, Tensor] = {
            name: _initializer(t, self.ctx, spec.weight_views.get(name))
            for name, t in spec.initializers.items()
        }
        self.runtime_nodes: list[Node] = []
        self.folded: dict[str, Node] = {}  # constant -> the node that folded it
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
                    self.folded[name] = node
        self.consts = consts

    @property
    def default_seq_len(self) -> int:
        """The fixed N; a graph with a dynamic N has no default (the bound depends on N), so
        callers that fall back on it get a clear error instead of a silent guess."""
        if self.spec.seq_len is None:
            raise DynamicSeqLenError("the graph has a dynamic sequence length: give the "
                                     "length to certify with --seq-len N")
        return self.spec.seq_len

    def _set_float_dtype(self, float_dtype: torch.dtype) -> GraphModule:
        # constants are a plain dict (no parameters): nn.Module.double() would not see them
        self.consts = {k: v.to(float_dtype) if v.is_floating_point() else v
                       for k, v in self.consts.items()}
        self.ctx = RunContext(float_dtype)
        return self

    def double(self) -> GraphModule:
        return self._set_float_dtype(torch.float64)

    def float(self) -> GraphModule:
        return self._set_float_dtype(torch.float32)

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


_EXACT_IN_FLOAT32 = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                     onnx.TensorProto.BFLOAT16}
_SMALL_CONST_BYTES = 1 << 20
_LARGE_CONST_BUDGET = 96 << 20


class _Env(Mapping[str, Tensor]):
    """The analysis' view of every tensor: input-dependent ones at the reference point (in
    the module's own precision: their values only give shapes and starting points), all
    others in float64 (constants converted from the file lazily, shape arithmetic re-run)."""

    def __init__(self, info: GraphInfo) -> None:
        self._info = info

    def __getitem__(self, name: str) -> Tensor:
        info = self._info
        if name in info.var:
            return info.ref[name]
        hit = info.static.get(name)
        if hit is not None:
            return hit
        return info.const64(name)

    def __contains__(self, name: object) -> bool:
        info = self._info
        return isinstance(name, str) and (name in info.ref or name in info.static
                                          or name in info.module.consts)

    def __iter__(self) -> Iterator[str]:
        info = self._info
        return iter(dict.fromkeys([*info.module.consts, *info.ref, *info.static]))

    def __len__(self) -> int:
        return sum(1 for _ in self)


class GraphInfo:
    """One reference evaluation of the graph with everything the analysis needs: which
    tensors depend on the input (`var`; shape arithmetic does not count), producers,
    consumers, static shapes, and the tensor dominator tree (`idom`) rooted at the input.

    The reference evaluation runs in the module's precision (float32 as exported: it only
    decides structure and shapes). Everything that feeds a bound is float64: `env` gives
    constants converted from the file (lazily: most weights are only read by the rules),
    and `eval_nodes` re-evaluates regions in float64 at chosen inputs.
    """

    def __init__(self, module: GraphModule, seq_len: int, seed: int = 0) -> None:
        spec = module.spec
        self.spec = spec
        self.module = module
        self.ctx = RunContext(torch.float64)
        self.seq_len = seq_len
        self.batch = spec.batch or 1
        gen = torch.Generator().manual_seed(seed)
        shape = (self.batch, seq_len, spec.d_model) if spec.rank == 3 else (seq_len,
                                                                            spec.d_model)
        self.input_shape = shape
        x0 = torch.randn(*shape, generator=gen, dtype=torch.float64)
        with torch.no_grad():
            self.ref = module.run_env(x0.to(module.ctx.float_dtype))
        self.nodes = module.runtime_nodes
        self.order = {n.name: i for i, n in enumerate(self.nodes)}
        self.producer: dict[str, Node] = {}
        self.consumers: dict[str, list[Node]] = {}
        self.var: set[str] = {spec.input_name}
        self._index_nodes()
        # float64 constants: small ones kept, large ones (weights) in a bounded LRU; holding
        # every weight of a large model in float64 at once costs more in fresh memory (page
        # faults) than converting a weight again when it is read again much later
        self._c64: OrderedDict[str, Tensor] = OrderedDict()
        self._c64_bytes = 0
        self._initializers = spec.initializers
        # runtime tensors that do not depend on the input values (shape arithmetic, and what
        # it computes, e.g. a 1/sqrt(d) scale) again in float64
        self.static: dict[str, Tensor] = {}
        self._evaluate_static()
        self.env: Mapping[str, Tensor] = _Env(self)
        # nodes whose values reach the output (a node read only through Shape is not)
        self.live: set[str] = self._live_nodes()
        self.idom: dict[str, str | None] = {spec.input_name: None}
        self.depth: dict[str, int] = {spec.input_name: 0}
        self._dominators()

    def _index_nodes(self) -> None:
        """Producers, consumers, and which tensors depend on the input values (`var`)."""
        for n in self.nodes:
            for o in n.outputs:
                if o:
                    self.producer[o] = n
            for i in n.inputs:
                if i:
                    self.consumers.setdefault(i, []).append(n)
            if n.op_type not in ("Shape", "Size") and any(i in self.var for i in n.inputs):
                self.var.update(o for o in n.outputs if o)

    def _evaluate_static(self) -> None:
        """Runtime tensors that do not depend on the input values, in float64."""
        consts = self.module.consts
        with torch.no_grad():
            for n in self.nodes:
                outs_ = [o for o in n.outputs if o]
                if not outs_ or any(o in self.var for o in outs_):
                    continue
                ins: list[Tensor | None] = []
                for i in n.inputs:
                    if not i:
                        ins.append(None)
                    elif i in self.var or (i not in self.static and i not in consts):
                        ins.append(self.ref[i])  # Shape/Size of an input-dependent tensor
                    else:
                        ins.append(self.static[i] if i in self.static else self.const64(i))
                vals = OPS[n.op_type].run(n, ins, self.ctx)
                for name, value in zip(n.outputs, vals, strict=False):
                    if name:
                        self.static[name] = value

    def _live_nodes(self) -> set[str]:
        """Nodes whose values reach a graph output (not only through Shape/Size)."""
        live: set[str] = set()
        stack = [o.name for o in self.spec.model.graph.output]
        seen: set[str] = set()
        while stack:
            t = stack.pop()
            if t in seen or t not in self.producer:
                continue
            seen.add(t)
            prod = self.producer[t]
            live.add(prod.name)
            if prod.op_type not in ("Shape", "Size"):
                stack.extend(i for i in prod.inputs if i)
        return live

    def _dominators(self) -> None:
        """The tensor dominator tree rooted at the input: `idom[t]` is the nearest tensor
        every input-dependent path to t passes through."""
        for n in self.nodes:
            vin = [i for i in n.inputs if i in self.var]
            if not vin or n.op_type in ("Shape", "Size"):
                continue
            dom = vin[0]
            for other in vin[1:]:
                dom = self._lca(dom, other)
            for o in n.outputs:
                if o:
                    self.idom[o] = dom
                    self.depth[o] = self.depth[dom] + 1

    def const64(self, name: str) -> Tensor:
        """A constant of the graph in float64: initializers converted from the file (exact
        for float32/16 data, and a float64 file keeps its digits), folded ones re-folded."""
        hit = self._c64.get(name)
        if hit is not None:
            self._c64.move_to_end(name)
            return hit
        module = self.module
        if module.ctx.float_dtype == torch.float64:
            value = module.consts[name]
        elif name in self._initializers:
            init = self._initializers[name]
            if init.data_type in _EXACT_IN_FLOAT32 and name in module.consts:
                # the module's float32 copy holds the file's values exactly
                # (converted by numpy: its allocations are reused, torch's fault in fresh
                # pages every time)
                value = torch.from_numpy(module.consts[name].detach().numpy().astype(np.float64))
            else:
                value = tensor_from_proto(init, self.ctx)
        elif name in module.folded:
            node = module.folded[name]
            with torch.no_grad():
                outs = OPS[node.op_type].run(
                    node, [self.const64(i) if i else None for i in node.inputs], self.ctx)
            for o, v in zip(node.outputs, outs, strict=False):
                if o:
                    self._keep(o, v)
            return dict(zip(node.outputs, outs, strict=False))[name]
        else:
            value = module.consts[name]  # KeyError for a name the graph does not have
        self._keep(name, value)
        return value

    def _keep(self, name: str, value: Tensor) -> None:
        self._c64[name] = value
        size = value.numel() * value.element_size()
        if size < _SMALL_CONST_BYTES:
            return
        self._c64_bytes += size
        for old in list(self._c64):
            if self._c64_bytes <= _LARGE_CONST_BUDGET or old == name:
                break
            t = self._c64[old]
            if t.numel() * t.element_size() >= _SMALL_CONST_BYTES:
                self._c64_bytes -= t.numel() * t.element_size()
                del self._c64[old]

    def _lca(self, a: str, b: str) -> str:
        while a != b:
            if self.depth[a] >= self.depth[b]:
                a = self.idom[a] or a
            else:
                b = self.idom[b] or b
            if self.depth[a] == 0 and self.depth[b] == 0:
                return a
        return a

    def shape(self, name: str) -> tuple[int, ...]:
        for where in (self.ref, self.static, self.module.consts):
            if name in where:
                return tuple(where[name].shape)  # no float64 conversion for a shape
        return tuple(self.env[name].shape)

    def is_token(self, name: str, n: int | None = None) -> bool:
        """Shape (batch, n, width) like the input (n = N unless given: an attention over
        N + 1 tokens after a class token is concatenated): last axis = features of a token."""
        s = self.shape(name)
        n = self.seq_len if n is None else n
        if len(s) == len(self.input_shape) and s[:-1] == (*self.input_shape[:-2], n):
            return True
        # with one sequence, (N, width), (1, N, width) and (N, 1, width) hold the same rows
        # in the same order: a 2-D input wrapped as `layer(x.unsqueeze(0)).squeeze(0)`, the
        # sequence-first layout of torch's attention internals and of seq-first exports
        one = len(self.input_shape) == 2 or self.input_shape[0] == 1
        return one and s[:-1] in ((n,), (1, n), (n, 1))

    def eval_nodes(self, nodes: Iterable[Node],
                   overrides: Mapping[str, Tensor]) -> MutableMapping[str, Tensor]:
        """Run `nodes` (in graph order) in float64 on top of `env` with overrides; the nodes
        must read only the overrides, each other and tensors that do not depend on the
        input (a closed `region`)."""
        computed: dict[str, Tensor] = {}
        env: MutableMapping[str, Tensor] = ChainMap(
            computed, dict(overrides), cast(MutableMapping[str, Tensor], self.env))
        for node in nodes:
            if all(o in overrides for o in node.outputs if o):
                continue
            outs = OPS[node.op_type].run(node, [env[i] if i else None for i in node.inputs],
                                         self.ctx)
            for name, value in zip(node.outputs, outs, strict=False):
                if name:
                    computed[name] = value
        return env

    def needed(self, nodes: list[Node], targets: Iterable[str]) -> list[Node]:
        """The nodes of `nodes` that the targets depend on, in graph order."""
        by_output = {o: n for n in nodes for o in n.outputs if o}
        keep: dict[str, Node] = {}
        stack = [t for t in targets]
        while stack:
            t = stack.pop()
            n = by_output.get(t)
            if n is None or n.name in keep:
                continue
            keep[n.name] = n
            stack.extend(i for i in n.inputs if i)
        return [n for n in nodes if n.name in keep]

    def region(self, source: str, sink: str) -> list[Node] | None:
        """The input-dependent nodes on paths source -> sink, in graph order, or None when the
        region is not closed (it reads other input-dependent tensors, or a tensor inside it
        is used outside it)."""
        anc: set[str] = set()
        stack = [sink]
        while stack:
            t = stack.pop()
            if t in anc or t == source or t not in self.producer:
                continue
            anc.add(t)
            stack.extend(i for i in self.producer[t].inputs if i in self.var)
        nodes = {self.producer[t].name: self.producer[t] for t in anc}
        outs = {o for n in nodes.values() for o in n.outputs if o}
        for n in nodes.values():
            for i in n.inputs:
                if i in self.var and i != source and i not in outs:
                    return None
        for o in outs - {sink}:
            for c in self.consumers.get(o, []):
                # a Shape of an inside tensor is a constant at the fixed size
                if c.name not in nodes and c.op_type not in ("Shape", "Size") \
                        and c.name in self.live:
                    return None
        graph_outputs = {o.name for o in self.spec.model.graph.output}
        if (outs - {sink}) & graph_outputs:
            return None
        return sorted(nodes.values(), key=lambda n: self.order[n.name])
