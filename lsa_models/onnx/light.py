"""Copies of an ONNX model without the bytes of its weights, for the ONNX checker, shape
inference and onnxruntime: a 340 MB model's weights are then never copied into C++ for them
(bench/gpt2_bound.py). What each consumer would have checked about the weights taken out
is checked here or where the weights are read."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import onnx
import torch
from torch import Tensor

from .errors import OnnxCheckError

# Initializers up to this many elements keep their values for shape inference (it reads the
# values of shape-like inputs: Reshape targets, Slice bounds); larger ones are weights.
_SHAPE_DATA_MAX = 4096


_T = onnx.TensorProto
# bytes per element of the data types a weight may store as raw bytes (sub-byte types, whose
# raw size rounds up, stay with the checker)
_RAW_ITEMSIZE: dict[int, int] = {
    _T.FLOAT: 4, _T.DOUBLE: 8, _T.FLOAT16: 2, _T.BFLOAT16: 2, _T.INT8: 1, _T.UINT8: 1,
    _T.INT16: 2, _T.UINT16: 2, _T.INT32: 4, _T.UINT32: 4, _T.INT64: 8, _T.UINT64: 8,
    _T.BOOL: 1}


def _is_plain_weight(t: onnx.TensorProto) -> bool:
    """A large tensor whose data is raw bytes only, exactly as many as its shape and type
    need: everything `onnx.checker.check_tensor` verifies about a tensor (a defined,
    non-STRING type, one value field, the raw size) holds for it."""
    n = math.prod(t.dims)
    size = _RAW_ITEMSIZE.get(t.data_type)
    return (n > _SHAPE_DATA_MAX and size is not None and t.data_location != _T.EXTERNAL
            and len(t.raw_data) == n * size
            and not (t.float_data or t.int32_data or t.string_data or t.int64_data
                     or t.double_data or t.uint64_data))


def light_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its plain weights declared as typed graph inputs instead of carried as
    data: the checker and shape inference give the same verdicts and shapes on it (they read
    only small shape-like constants), without copying every weight into C++ (~1.9 s of a
    340 MB model for the checker alone; bench/gpt2_bound.py). What the checker would have
    verified about the weights taken out, and about initializer names (non-empty, unique,
    among the graph inputs for IR version <= 3), is checked here."""
    light = _skeleton(model, shapes=True)
    g, src = light.graph, model.graph
    declared = {i.name for i in src.input}
    seen: set[str] = set()
    for t in src.initializer:
        if not t.name:
            raise OnnxCheckError("the ONNX checker rejected the graph: tensor initializers "
                                 "must have a non-empty name")
        if t.name in seen:
            raise OnnxCheckError(f"the ONNX checker rejected the graph: {t.name} initializer "
                                 "name is not unique")
        seen.add(t.name)
        if not _is_plain_weight(t):
            g.initializer.append(t)
        elif t.name in declared:
            continue
        elif model.ir_version <= 3:
            raise OnnxCheckError(f"the ONNX checker rejected the graph: {t.name} in "
                                 "initializer but not in graph input")
        else:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return light


def check_and_infer(model: onnx.ModelProto) -> None:
    """The ONNX checker, then strict shape inference with its results written into `model`,
    both on the light copy (`light_copy`)."""
    light = light_copy(model)
    onnx.checker.check_model(light)
    inferred = onnx.shape_inference.infer_shapes(light, strict_mode=True).graph
    src = model.graph
    del src.value_info[:]
    src.value_info.extend(inferred.value_info)
    del src.output[:]
    src.output.extend(inferred.output)


# the location the weights handed to onnxruntime as arrays are said to be stored in; it is
# never read (onnxruntime takes every external initializer from the arrays given)
_ARRAYS = "__lsa_weights_as_arrays__"


def ort_light_model(model: onnx.ModelProto, consts: Mapping[str, Tensor]
                    ) -> tuple[bytes, dict[str, np.ndarray]]:
    """(the model serialised with its large float32 weights marked as external data, those
    weights as arrays) for `SessionOptions.add_external_initializers`. The arrays are the
    torch evaluator's own constants, decoded from the same bytes by the ONNX rule (raw data:
    little-endian float32; `GraphModule`), so onnxruntime computes with the weights of the
    file and the comparison still tests every op's semantics. Shape annotations are left
    out: onnxruntime infers its own."""
    light = _skeleton(model, shapes=False)
    g, src = light.graph, model.graph
    arrays: dict[str, np.ndarray] = {}
    for t in src.initializer:
        c = consts.get(t.name)
        if (t.data_type != _T.FLOAT or math.prod(t.dims) <= _SHAPE_DATA_MAX or c is None
                or c.dtype != torch.float32 or tuple(c.shape) != tuple(t.dims)):
            g.initializer.append(t)
            continue
        arrays[t.name] = np.ascontiguousarray(c.detach().numpy())
        ext = g.initializer.add()
        ext.name, ext.data_type, ext.data_location = t.name, t.data_type, _T.EXTERNAL
        ext.dims.extend(t.dims)
        for key, value in (("location", _ARRAYS), ("offset", "0"),
                           ("length", str(4 * math.prod(t.dims)))):
            entry = ext.external_data.add()
            entry.key, entry.value = key, value
    return light.SerializeToString(), arrays


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _fields(buf: bytes, start: int, end: int) -> list[tuple[int, int, int]]:
    """(field number, start, end) of the length-delimited fields of the message in
    buf[start:end]; other wire types are skipped."""
    out = []
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            n, pos = _varint(buf, pos)
            out.append((key >> 3, pos, pos + n))
            pos += n
        else:
            raise ValueError(f"wire type {wire}")
    if pos != end:
        raise ValueError("a field runs past its message")
    return out


# ModelProto.graph = 7, GraphProto.initializer = 5, TensorProto.name = 8, .raw_data = 9
_GRAPH, _INITIALIZER, _NAME, _RAW = 7, 5, 8, 9


def raw_weight_views(raw: bytes, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The large float32 weights of the parsed `model` as read-only arrays over the upload's
    own bytes `raw` (no copy: the protobuf accessor copies every weight, 340 MB of fresh
    pages for GPT-2-small). The wire format is walked only where it holds initializers; each
    one found is matched to the parsed model's initializer at the same position (protobuf
    concatenates repeated and merged fields in order; the last name and raw_data win), by
    name and by the byte count its shape needs. Anything unexpected gives no views (the
    caller then reads the weights from the parsed model)."""
    inits = model.graph.initializer
    try:
        found: list[tuple[str, int, int]] = []
        for field, gs, ge in _fields(raw, 0, len(raw)):
            if field != _GRAPH:
                continue
            for f2, ts, te in _fields(raw, gs, ge):
                if f2 != _INITIALIZER:
                    continue
                name, span = "", (0, 0)
                for f3, s, e in _fields(raw, ts, te):
                    if f3 == _NAME:
                        name = raw[s:e].decode("utf-8")
                    elif f3 == _RAW:
                        span = (s, e)
                found.append((name, *span))
    except (ValueError, IndexError, UnicodeDecodeError):
        return {}
    if len(found) != len(inits):
        return {}
    views: dict[str, np.ndarray] = {}
    for t, (name, s, e) in zip(inits, found, strict=True):
        n = math.prod(t.dims)
        if name != t.name:
            return {}
        if (t.data_type == _T.FLOAT and n > _SHAPE_DATA_MAX and e - s == 4 * n
                and t.data_location != _T.EXTERNAL):
            views[name] = np.frombuffer(raw, dtype="<f4", count=n, offset=s).reshape(
                tuple(t.dims))
    return views


def _skeleton(model: onnx.ModelProto, shapes: bool) -> onnx.ModelProto:
    """The model without its dense initializers: header, functions, nodes, inputs, outputs,
    sparse initializers (and the shape annotations when `shapes`); the callers add the
    initializers they keep."""
    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    g, src = light.graph, model.graph
    g.name = src.name
    g.node.extend(src.node)
    g.input.extend(src.input)
    g.output.extend(src.output)
    if shapes:
        g.value_info.extend(src.value_info)
    g.sparse_initializer.extend(src.sparse_initializer)
    return light
