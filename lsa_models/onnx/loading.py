"""Safe loading of uploaded ONNX graphs (bytes of an .onnx, or a .zip with its external data).

Nothing outside the upload is ever read: external data may only come from members of the
same zip, named by relative paths that stay inside it. Sizes are checked before anything is
allocated; the torch evaluation is compared with onnxruntime before the model is used.
"""

from __future__ import annotations

import io
import os
import posixpath
import stat
import zipfile
from dataclasses import dataclass

import numpy as np
import onnx
import torch
from google.protobuf.message import DecodeError

from ..operators.conv import Conv
from ..operators.layout import FLOAT_TYPES
from .errors import (
    OnnxCheckError,
    OnnxExternalDataError,
    OnnxInputError,
    OnnxMismatchError,
    OnnxParseError,
    OnnxShapeError,
    OnnxTooLargeError,
    UnsupportedOpsError,
)
from .graph import GraphModule, GraphSpec
from .light import check_and_infer, ort_light_model, raw_weight_views
from .ops import Node, unsupported_ops
from .rewrite import canonical_layouts

ZIP_MAGIC = b"PK\x03\x04"
MIN_OPSET, MAX_OPSET = 13, onnx.defs.onnx_opset_version()


@dataclass(frozen=True)
class LoadOptions:
    """Limits of the loader. `max_bytes` caps the upload and everything unpacked from it;
    `max_elements` caps any one declared tensor (inputs, outputs, intermediates, weights)."""

    max_bytes: int = int(os.environ.get("LSA_ONNX_MAX_BYTES", 1 << 30))
    max_elements: int = 1 << 28
    check_ort: bool = True
    check_seq_len: int = 8  # N used for the onnxruntime check when the graph's N is dynamic
    rtol: float = 1e-4


@dataclass
class OnnxModel:
    spec: GraphSpec
    module: GraphModule
    format: str  # "onnx" | "onnx-zip"
    max_abs_diff: float | None  # torch vs onnxruntime on random inputs


def is_onnx(data: bytes, filename: str = "") -> bool:
    """Content sniffing (the file name is not trusted): a zip holding an .onnx member, a
    protobuf that starts like a ModelProto (field 1, ir_version, a small varint: claimed even
    when truncated, so the user gets the ONNX loader's error), or one that parses as a model
    with a graph."""
    if data[:4] == ZIP_MAGIC:
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as zf:
                return any(n.lower().endswith(".onnx") for n in zf.namelist())
        except zipfile.BadZipFile:
            return False
    if len(data) > 1 and data[0] == 0x08 and 3 <= data[1] <= 32:
        return True  # ir_version 3..32
    if data[:1] not in (b"\x08", b"\x12", b"\x1a", b"\x22", b"\x3a", b"\x42", b"\x52"):
        return False  # first field of a ModelProto: ir_version, producer, graph, opsets...
    try:
        m = onnx.ModelProto()
        m.ParseFromString(data)
        return m.HasField("graph") and len(m.graph.node) > 0
    except (DecodeError, ValueError, RuntimeError):
        return False


def _safe_member(name: str) -> str | None:
    """The normalised member name, or None when it could escape the archive."""
    if not name or name.startswith(("/", "\\")) or "\\" in name or ":" in name.split("/")[0]:
        return None
    norm = posixpath.normpath(name)
    if norm.startswith("../") or norm == ".." or "/../" in f"/{norm}/":
        return None
    if any(part == ".." for part in name.split("/")):
        return None
    return norm


def _read_zip(data: bytes, opts: LoadOptions) -> tuple[bytes, dict[str, bytes], str]:
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise OnnxParseError(f"not a valid zip archive: {exc}") from None
    members: dict[str, zipfile.ZipInfo] = {}
    total = 0
    with zf:
        for info in zf.infolist():
            if info.is_dir():
                continue
            mode = (info.external_attr >> 16) & 0xFFFF
            if stat.S_ISLNK(mode):
                raise OnnxExternalDataError(f"zip member {info.filename!r} is a symbolic link; "
                                            "links are not accepted, store the file itself")
            safe = _safe_member(info.filename)
            if safe is None:
                raise OnnxExternalDataError(
                    f"zip member {info.filename!r} has an absolute path or '..'; store files "
                    "under relative paths inside the archive")
            total += info.file_size
            if total > opts.max_bytes:
                raise OnnxTooLargeError(f"the zip unpacks to more than {opts.max_bytes} bytes "
                                        "(the upload size limit)")
            members[safe] = info
        graphs = [n for n in members if n.lower().endswith(".onnx")]
        if len(graphs) != 1:
            raise OnnxParseError(f"the zip must hold exactly one .onnx file, found {len(graphs)}"
                                 + (f": {', '.join(sorted(graphs))}" if graphs else ""))
        contents = {name: zf.read(info) for name, info in members.items()}
    main = graphs[0]
    return contents[main], contents, main


def _parse(raw: bytes) -> onnx.ModelProto:
    model = onnx.ModelProto()
    try:
        model.ParseFromString(raw)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise OnnxParseError(f"not a valid ONNX protobuf (truncated or corrupt file?): "
                             f"{exc}") from None
    if not model.HasField("graph") or not model.graph.node:
        raise OnnxParseError("the file parses but holds no ONNX graph (truncated, corrupt or "
                             "not an ONNX model)")
    return model


def _elem_size(data_type: int) -> int:
    try:
        return int(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(data_type)).itemsize)
    except (KeyError, TypeError, ValueError):
        raise OnnxParseError(f"unsupported tensor element type {data_type}") from None


def _check_tensor_size(t: onnx.TensorProto, opts: LoadOptions, where: str) -> int:
    n = 1
    for d in t.dims:
        if d < 0:
            raise OnnxShapeError(f"{where} {t.name!r} has a negative dimension")
        n *= int(d)
    if n > opts.max_elements:
        raise OnnxShapeError(f"{where} {t.name!r} declares {n} elements (limit "
                             f"{opts.max_elements}); the model is too large for this service")
    return n


def _resolve_external(model: onnx.ModelProto, files: dict[str, bytes] | None, main: str,
                      opts: LoadOptions) -> bool:
    """Inline every external tensor from the upload's own files, after checking its path.
    True when something was inlined (the model no longer matches the uploaded bytes)."""
    inlined = False
    tensors = list(model.graph.initializer)
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                tensors.append(attr.t)
    for t in tensors:
        n = _check_tensor_size(t, opts, "tensor")
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        location = info.get("location", "")
        safe = _safe_member(location)
        if safe is None or posixpath.isabs(location):
            raise OnnxExternalDataError(
                f"tensor {t.name!r} points at external data {location!r}: absolute paths and "
                "'..' are not accepted; keep data files next to the .onnx inside the zip")
        if files is None:
            raise OnnxExternalDataError(
                f"tensor {t.name!r} keeps its data in {location!r}, which was not uploaded; "
                "upload a .zip holding the .onnx file and its data files")
        path = posixpath.normpath(posixpath.join(posixpath.dirname(main), safe))
        if path not in files:
            raise OnnxExternalDataError(
                f"tensor {t.name!r} keeps its data in {location!r}, which is not in the zip")
        blob = files[path]
        try:
            offset = int(info.get("offset", 0))
            length = int(info["length"]) if "length" in info else len(blob) - offset
        except ValueError:
            raise OnnxExternalDataError(f"tensor {t.name!r}: bad offset/length") from None
        expected = n * _elem_size(t.data_type)
        if offset < 0 or length != expected or offset + length > len(blob):
            raise OnnxExternalDataError(
                f"tensor {t.name!r}: external data {location!r} [{offset}, +{length}) does not "
                f"hold the {expected} bytes its shape needs")
        t.raw_data = blob[offset:offset + length]
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT
        inlined = True
    return inlined


def _check_declared_shapes(model: onnx.ModelProto, opts: LoadOptions) -> None:
    g = model.graph
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if not vi.type.HasField("tensor_type"):
            continue
        n = 1
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_value"):
                if d.dim_value < 0:
                    raise OnnxShapeError(f"tensor {vi.name!r} declares a negative dimension")
                n *= d.dim_value
        if n > opts.max_elements:
            raise OnnxShapeError(f"tensor {vi.name!r} declares a shape of {n} elements (limit "
                                 f"{opts.max_elements}); the model is too large for this service")


def _dims(vi: onnx.ValueInfoProto) -> list[int | None]:
    return [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
            for d in vi.type.tensor_type.shape.dim]


_SEQ_FIRST = "__seq_first"


def _to_batch_first(model: onnx.ModelProto) -> bool:
    """A graph exported with a sequence-first input (N, 1, D) (torch's default layout,
    `batch_first=False`, traced with one sequence) gets a Transpose in front of it, and one
    behind a sequence-first (N, 1, D') output, so the analysis sees (1, N, D) like every other
    graph. Permuting coordinates changes no norm: the Lipschitz constant is the same, and a
    token is still a token (row x_i in both layouts). True when it rewrote the graph."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    floats = [vi for vi in g.input if vi.name not in inits
              and vi.type.tensor_type.elem_type in FLOAT_TYPES]
    if len(floats) != 1:
        return False
    vi = floats[0]
    dims = _dims(vi)
    if len(dims) != 3 or dims[0] is None or dims[0] < 2 or dims[1] != 1:
        return False
    x, inner = vi.name, vi.name + _SEQ_FIRST
    _rename_uses(g, x, inner)
    shape = vi.type.tensor_type.shape.dim
    shape[0].dim_value, shape[1].dim_value = 1, dims[0]
    nodes = [onnx.helper.make_node("Transpose", [x], [inner], name=inner, perm=[1, 0, 2])]
    out = g.output[0]
    odims = _dims(out)
    if len(g.output) == 1 and len(odims) == 3 and odims[0] == dims[0] and odims[1] == 1:
        y, y_inner = out.name, out.name + _SEQ_FIRST
        for nd in g.node:
            nd.output[:] = [y_inner if o == y else o for o in nd.output]
        _rename_uses(g, y, y_inner)
        for v in g.value_info:
            if v.name == y:
                v.name = y_inner
        oshape = out.type.tensor_type.shape.dim
        oshape[0].dim_value, oshape[1].dim_value = 1, odims[0]
        tail = [onnx.helper.make_node("Transpose", [y_inner], [y], name=y_inner, perm=[1, 0, 2])]
    else:
        tail = []
    old = list(g.node)
    del g.node[:]
    g.node.extend(nodes + old + tail)
    return True


_PATCHES = "__patches"


def _patch_kernel(g: onnx.GraphProto, x: str, inits: dict[str, onnx.TensorProto]
                  ) -> list[int] | None:
    """(kh, kw) of the image's only reader when it is a patch-embedding Conv (kernel ==
    stride, no padding, dilation or groups, a constant 2-D kernel), else None."""
    users = [nd for nd in g.node if x in nd.input]
    if len(users) != 1 or users[0].op_type != "Conv" or list(users[0].input[:1]) != [x] \
            or users[0].input[1] not in inits:
        return None
    kernel = [int(d) for d in inits[users[0].input[1]].dims[2:]]
    conv = Conv("Conv", Node.from_proto(users[0], 0).attrs)
    if len(kernel) != 2 or conv.patchwise_reason(kernel) is not None:
        return None
    return kernel


def _pixels_to_patches(model: onnx.ModelProto) -> tuple[int, ...] | None:
    """A graph on pixels (B, C, H, W) takes tokens instead, put back into the image by a
    Reshape, Transpose, Reshape in front of the graph. When the image's only reader is a
    patch-embedding Conv (kernel == stride, no padding, dilation or groups: ViT, DeiT) the
    tokens are its patches, (B, P, C * kh * kw) (P = (H / kh) (W / kw), each patch flattened
    in the Conv kernel's (C, kh, kw) order); any other reader (an MLP's Flatten, a CNN's
    Conv, a reshape into tokens) gets the whole image as one token (B, 1, C H W). Either map
    only permutes coordinates, so every norm, the Lipschitz constant and the outputs are
    those of the upload. The (C, H, W) of the upload, or None when the input is not 4-D."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    floats = [vi for vi in g.input if vi.name not in inits
              and vi.type.tensor_type.elem_type in FLOAT_TYPES]
    if len(floats) != 1 or len(_dims(floats[0])) != 4:
        return None
    vi = floats[0]
    b, c, h, w = _dims(vi)
    kernel = _patch_kernel(g, vi.name, inits)
    if kernel is None:
        # any other reader (a Flatten, a CNN's Conv, a reshape into tokens): the whole image
        # is one token (C H W) in the image's own order, which the same Reshapes put back
        if None in (c, h, w):
            raise OnnxInputError(f"input {vi.name!r} is an image (rank 4) of shape "
                                 f"{(b, c, h, w)}: export it with a fixed (C, H, W)")
        kernel = [int(h), int(w)]  # type: ignore[arg-type]
    elif None in (c, h, w):
        raise OnnxInputError(f"input {vi.name!r} is an image read by a patch-embedding Conv: "
                             "the image needs a fixed (C, H, W)")
    elif h % kernel[0] or w % kernel[1]:  # type: ignore[operator]
        kernel = [int(h), int(w)]  # type: ignore[arg-type]  # partial patches: one token
    assert c is not None and h is not None and w is not None
    kh, kw = kernel
    hp, wp = h // kh, w // kw
    x = vi.name
    names = [x + _PATCHES + s for s in ("_grid", "_image", "_shape1", "_shape2", "")]
    g.initializer.extend([
        onnx.numpy_helper.from_array(np.array([0, hp, wp, c, kh, kw], np.int64), names[2]),
        onnx.numpy_helper.from_array(np.array([0, c, h, w], np.int64), names[3])])
    nodes = [  # (B, P, C kh kw) -> (B, Hp, Wp, C, kh, kw) -> (B, C, Hp, kh, Wp, kw) -> image
        onnx.helper.make_node("Reshape", [x, names[2]], [names[0]], name=names[0]),
        onnx.helper.make_node("Transpose", [names[0]], [names[1]], name=names[1],
                              perm=[0, 3, 1, 4, 2, 5]),
        onnx.helper.make_node("Reshape", [names[1], names[3]], [names[4]], name=names[4])]
    _rename_uses(g, x, names[4])
    shape = vi.type.tensor_type.shape
    del shape.dim[:]
    for d in (b, hp * wp, c * kh * kw):
        dim = shape.dim.add()
        if d is None:
            dim.dim_param = "batch"
        else:
            dim.dim_value = d
    old = list(g.node)
    del g.node[:]
    g.node.extend(nodes + old)
    return (c, h, w)


def _rename_uses(g: onnx.GraphProto, name: str, new: str) -> None:
    """Every node input reading `name` reads `new` (subgraphs are not used by supported ops)."""
    for nd in g.node:
        nd.input[:] = [new if i == name else i for i in nd.input]


def _select_input(model: onnx.ModelProto, nodes: list[Node]) -> tuple[
        str, int, int | None, int | None, int, set[str], str | None]:
    """(input tensor, D, fixed N, fixed batch, rank, skipped nodes, ids input)."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    inputs = [vi for vi in g.input if vi.name not in inits]
    floats = [vi for vi in inputs if vi.type.tensor_type.elem_type in FLOAT_TYPES]
    if len(floats) > 1:
        raise OnnxInputError("the graph has several float inputs ("
                             + ", ".join(v.name for v in floats)
                             + "); export a model with one input of shape (batch, N, D)")
    if floats:
        vi = floats[0]
        dims = _dims(vi)
        if len(dims) not in (2, 3):
            raise OnnxInputError(f"input {vi.name!r} has rank {len(dims)}; expected "
                                 "(batch, N, D) or (N, D)")
        if dims[-1] is None:
            raise OnnxInputError(f"input {vi.name!r} has a dynamic feature dimension; export "
                                 "with a fixed D")
        n = dims[-2]
        batch = dims[0] if len(dims) == 3 else None
        return vi.name, int(dims[-1]), n, batch, len(dims), set(), None
    # No float input: an embedding lookup may start the continuous part.
    for vi in inputs:
        found = _embedding_lookup(model, nodes, vi, inits)
        if found is not None:
            return found
    raise OnnxInputError("the graph has no float input, and no embedding lookup (a Gather of "
                         "a 2-D float table by the token ids, reshaped or not) whose output "
                         "could serve as one; export the model with `inputs_embeds` (a "
                         "continuous input of shape (batch, N, D))")


_ID_OPS = ("Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Cast")


def _embedding_lookup(model: onnx.ModelProto, nodes: list[Node], vi: onnx.ValueInfoProto,
                      inits: dict[str, onnx.TensorProto]) -> tuple[
                          str, int, int | None, int | None, int, set[str], str | None] | None:
    """Token ids (batch, N) -> Gather of a 2-D float table, possibly through ops that only
    reshape or cast the ids (GPT-2 writes `input_ids.view(-1, N)` first), with the lookup's
    output of shape (batch, N, D): the continuous input starts there."""
    dims = _dims(vi)
    if len(dims) != 2:
        return None
    users: dict[str, list[Node]] = {}
    for nd in nodes:
        for i in nd.inputs:
            users.setdefault(i, []).append(nd)
    skipped: set[str] = set()
    t = vi.name
    while True:
        uses = [nd for nd in users.get(t, []) if nd.op_type != "Shape"]
        if len(uses) != 1:
            return None
        nd = uses[0]
        if nd.op_type in _ID_OPS and nd.inputs[0] == t:
            skipped.add(nd.name)
            t = nd.outputs[0]
            continue
        table = inits.get(nd.inputs[0]) if nd.op_type == "Gather" and nd.inputs[1] == t \
            and int(nd.attrs.get("axis", 0)) == 0 else None
        if table is None or table.data_type not in FLOAT_TYPES or len(table.dims) != 2:
            return None
        out = nd.outputs[0]
        shapes = {v.name: _dims(v) for v in model.graph.value_info}
        if skipped and shapes.get(out) not in ([dims[0], dims[1], int(table.dims[1])], None):
            return None  # reshaped ids whose lookup is not (batch, N, D)
        skipped.add(nd.name)
        return out, int(table.dims[1]), dims[1], dims[0], 3, skipped, vi.name


def load_onnx(data: bytes, filename: str = "", opts: LoadOptions | None = None,
              seq_len: int | None = None) -> OnnxModel:
    opts = opts or LoadOptions()
    if len(data) > opts.max_bytes:
        raise OnnxTooLargeError(f"the upload has {len(data)} bytes, above the limit of "
                                f"{opts.max_bytes}")
    if data[:4] == ZIP_MAGIC:
        raw, files, main = _read_zip(data, opts)
        fmt = "onnx-zip"
    else:
        raw, files, main, fmt = data, None, "model.onnx", "onnx"
    model = _parse(raw)
    views = raw_weight_views(raw, model)  # before external data is inlined: file bytes only
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise OnnxCheckError(f"opset {opset} is not supported; export with opset "
                             f"{MIN_OPSET}..{MAX_OPSET} (17-20 recommended)")
    _check_declared_shapes(model, opts)
    inlined = _resolve_external(model, files, main, opts)
    seq_first = _to_batch_first(model)  # adds Transposes only: supported
    pixels = _pixels_to_patches(model)  # adds Reshapes and a Transpose only: supported
    nodes = [Node.from_proto(n, i) for i, n in enumerate(model.graph.node)]
    bad = unsupported_ops(nodes)
    if bad:
        raise UnsupportedOpsError(bad)
    # what onnxruntime loads: the upload itself unless it changed (serialising a 340 MB
    # model costs ~1.2 s each time)
    blob = model.SerializeToString() if inlined or seq_first or pixels else raw
    try:
        check_and_infer(model)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError,
            RuntimeError) as exc:
        msg = " ".join(str(exc).split())[:500]
        raise OnnxCheckError(f"the ONNX checker rejected the graph: {msg}") from None
    _check_declared_shapes(model, opts)
    if not model.graph.output:
        raise OnnxCheckError("the graph has no output")
    # after the checks: they and onnxruntime see the upload
    nodes = canonical_layouts(nodes, model)
    name, d_model, n, batch, rank, skipped, ids = _select_input(model, nodes)
    spec = GraphSpec(model, nodes, name, model.graph.output[0].name, d_model, n, batch, rank,
                     skipped, ids, opset, blob, seq_first, pixels, views)
    try:
        module = GraphModule(spec)
    except (RuntimeError, ValueError, IndexError, NotImplementedError, KeyError) as exc:
        raise OnnxCheckError(f"the graph's constants could not be evaluated: {exc}") from None
    diff = compare_with_onnxruntime(spec, module, opts, seq_len) if opts.check_ort else None
    return OnnxModel(spec, module, fmt, diff)


def _ort_session(spec: GraphSpec, module: GraphModule | None = None):  # type: ignore[no-untyped-def]
    """An onnxruntime session of the graph. With `module`, its large float32 weights are
    handed to onnxruntime as the module's own arrays (`light.ort_light_model`) instead of
    in the serialised graph: no copies of them, no 340 MB parse (GPT-2-small: 1 GB of fresh
    pages and 0.7 -> 0.3 s CPU)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    # one or a few runs per session: repacking every weight for the GEMM kernels costs more
    # than it saves (GPT-2-small: creating the InferenceSession 0.4 -> 0.25 s, a run +0.02 s)
    so.add_session_config_entry("session.disable_prepacking", "1")
    if module is None:
        return ort.InferenceSession(spec.blob or spec.model.SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])
    blob, weights = ort_light_model(spec.model, module.consts)
    values = [ort.OrtValue.ortvalue_from_numpy(w) for w in weights.values()]
    if values:
        so.add_external_initializers(list(weights), values)
    try:
        sess = ort.InferenceSession(blob, so, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001  (a graph onnxruntime takes only whole: as it was)
        return _ort_session(spec)
    sess.lsa_weights = values  # the OrtValues (and the arrays) live as long as the session
    return sess


def ort_run(spec: GraphSpec, x: np.ndarray, session=None) -> np.ndarray:  # type: ignore[no-untyped-def]
    """The graph output on onnxruntime for a continuous input x (B, N, D) (embedding graphs
    are not replayable from x: their input is token ids)."""
    if spec.ids_name:
        raise OnnxInputError("the model's input is token ids; onnxruntime cannot be fed the "
                             "continuous input of its embedding")
    sess = session or _ort_session(spec)
    outs = []
    xs = [x[b] for b in range(x.shape[0])] if spec.rank == 2 else (
        [x] if spec.batch in (None, x.shape[0]) else np.split(x, x.shape[0] // spec.batch))
    for xb in xs:
        outs.append(sess.run([spec.output_name], {spec.input_name: xb.astype(np.float32)})[0])
    return np.stack(outs) if spec.rank == 2 else np.concatenate(outs)


def compare_with_onnxruntime(spec: GraphSpec, module: GraphModule, opts: LoadOptions,
                             seq_len: int | None) -> float:
    n = spec.seq_len or seq_len or opts.check_seq_len
    batch = spec.batch or 2
    gen = torch.Generator().manual_seed(0)
    try:
        sess = _ort_session(spec, module)
    except Exception as exc:  # onnxruntime raises its own exception types
        msg = " ".join(str(exc).split())[:400]
        raise OnnxCheckError(f"onnxruntime cannot load the graph: {msg}") from None
    if spec.ids_name:
        table_name = next(nd.inputs[0] for nd in spec.nodes
                          if nd.name in spec.skipped and nd.op_type == "Gather")
        table = module.consts[table_name]
        ids = torch.randint(0, table.shape[0], (batch, n), generator=gen)
        x = table[ids]
        try:
            ref = sess.run([spec.output_name], {spec.ids_name: ids.numpy()})[0]
        except Exception as exc:
            raise OnnxCheckError(f"onnxruntime failed on the graph: {exc}") from None
    else:
        shape = (batch, n, spec.d_model) if spec.rank == 3 else (n, spec.d_model)
        x = torch.randn(*shape, generator=gen)
        try:
            ref = sess.run([spec.output_name], {spec.input_name: x.numpy()})[0]
        except Exception as exc:
            msg = " ".join(str(exc).split())[:400]
            raise OnnxCheckError(f"onnxruntime failed on the graph with input shape "
                                 f"{tuple(shape)}: {msg}") from None
    try:
        with torch.no_grad():
            env = module.run_env(x, stop=spec.output_name)
        got = env[spec.output_name].numpy()
    except (RuntimeError, ValueError, IndexError, KeyError, TypeError) as exc:
        raise OnnxCheckError(f"the torch evaluation of the graph failed: {exc}") from None
    if got.shape != ref.shape:
        raise OnnxMismatchError(f"torch evaluation gives shape {got.shape}, onnxruntime "
                                f"{ref.shape}")
    if ref.size and not np.isfinite(ref).all():
        # NaN at a random input (a fully masked attention row, a 0/0, ...): no Lipschitz map
        raise OnnxCheckError(f"onnxruntime's output at a random input of shape "
                             f"{tuple(x.shape)} contains NaN or inf: the model is not defined "
                             "everywhere (e.g. an attention mask hiding every key of a row); "
                             "fix the model so that its output is finite")
    diff = float(np.max(np.abs(got.astype(np.float64) - ref))) if ref.size else 0.0
    scale = 1.0 + float(np.max(np.abs(ref))) if ref.size else 1.0
    if not diff <= opts.rtol * scale:
        raise OnnxMismatchError(f"the torch evaluation differs from onnxruntime by {diff:.3g} "
                                f"(tolerance {opts.rtol * scale:.3g}); the graph uses op "
                                "semantics this service does not reproduce")
    return diff
