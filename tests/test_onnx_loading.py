"""Safe loading of ONNX uploads: hostile files, external data in zips, op coverage."""

from __future__ import annotations

import io
import stat
import sys
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from lsa_models.analysis import ModelFormatError, load_model_bytes
from lsa_models.onnx import (
    DynamicSeqLenError,
    LoadOptions,
    OnnxCheckError,
    OnnxExternalDataError,
    OnnxInputError,
    OnnxMismatchError,
    OnnxParseError,
    OnnxShapeError,
    OnnxTooLargeError,
    UnsupportedOpsError,
    load_onnx,
)
from lsa_models.onnx.ops import OPS, Flow, Node, RunContext

D, N = 4, 3


def _mlp_graph(opset: int = 18, *, seq: int | str = N, weight: np.ndarray | None = None,
               extra_nodes: list[onnx.NodeProto] | None = None,
               input_type: int = TensorProto.FLOAT) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((D, D)).astype(np.float32) if weight is None else weight
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Relu", ["h"], ["y"], name="relu")]
    nodes += extra_nodes or []
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", input_type, [1, seq, D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, seq, D])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _external(model: onnx.ModelProto, location: str) -> onnx.ModelProto:
    """Move initializer 'w' to external data named `location` (bytes not written anywhere)."""
    t = model.graph.initializer[0]
    raw = numpy_helper.to_array(t).tobytes()
    t.ClearField("raw_data")
    t.ClearField("float_data")
    t.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", str(len(raw)))):
        e = t.external_data.add()
        e.key, e.value = k, v
    return model


def _zip(files: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        for name, target in (links or {}).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, target)
    return buf.getvalue()


@pytest.fixture
def no_file_reads() -> Iterator[list[str]]:
    """Records every Python-level file open while active (sys audit hook)."""
    opened: list[str] = []
    active = [True]

    def hook(event: str, args: tuple) -> None:
        if active[0] and event == "open" and isinstance(args[0], (str, bytes, Path)):
            opened.append(str(args[0]))

    sys.addaudithook(hook)
    yield opened
    active[0] = False


def _weights_bytes() -> bytes:
    return np.random.default_rng(0).standard_normal((D, D)).astype(np.float32).tobytes()


def test_loading_plain_model_evaluates_like_onnxruntime() -> None:
    m = load_onnx(_mlp_graph().SerializeToString(), "m.onnx")
    assert m.format == "onnx" and m.spec.seq_len == N and m.spec.d_model == D
    assert m.max_abs_diff is not None and m.max_abs_diff < 1e-5
    x = torch.randn(2, N, D)
    w = torch.from_numpy(np.random.default_rng(0).standard_normal((D, D)).astype(np.float32))
    assert torch.allclose(m.module(x), torch.relu(x @ w), atol=1e-6)


@pytest.mark.parametrize("opset", [17, 18, 19, 20])
def test_loading_accepts_opsets_17_to_20(opset: int) -> None:
    assert load_onnx(_mlp_graph(opset).SerializeToString()).spec.opset == opset


def test_loading_truncated_file_is_a_parse_error() -> None:
    data = _mlp_graph().SerializeToString()
    with pytest.raises(OnnxParseError, match="truncated|corrupt|no ONNX graph"):
        load_onnx(data[: len(data) // 2], "m.onnx")


def test_loading_random_bytes_is_a_parse_error() -> None:
    data = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    with pytest.raises(OnnxParseError):
        load_onnx(data, "m.onnx")
    # without the .onnx name, the bytes are not claimed by any loader
    with pytest.raises(ModelFormatError):
        load_model_bytes(data, "upload.bin")


def test_loading_external_data_in_zip_is_inlined(no_file_reads: list[str]) -> None:
    model = _external(_mlp_graph(), "model.onnx.data")
    data = _zip({"model.onnx": model.SerializeToString(), "model.onnx.data": _weights_bytes()})
    no_file_reads.clear()
    m = load_onnx(data, "m.zip")
    assert m.format == "onnx-zip" and m.max_abs_diff is not None
    assert not [p for p in no_file_reads if "model.onnx" in p or "etc" in p]


def test_loading_external_data_in_subfolder_of_zip() -> None:
    model = _external(_mlp_graph(), "weights/w.bin")
    data = _zip({"m/model.onnx": model.SerializeToString(), "m/weights/w.bin": _weights_bytes()})
    assert load_onnx(data).format == "onnx-zip"


@pytest.mark.parametrize("location", ["../../etc/passwd", "/etc/passwd", "a/../../b.data"])
def test_loading_external_data_escaping_the_upload_is_rejected(
        location: str, no_file_reads: list[str]) -> None:
    model = _external(_mlp_graph(), location)
    for data in (model.SerializeToString(),
                 _zip({"model.onnx": model.SerializeToString(), "x.data": _weights_bytes()})):
        no_file_reads.clear()
        with pytest.raises(OnnxExternalDataError, match="absolute|'\\.\\.'"):
            load_onnx(data, "m.onnx")
        assert not [p for p in no_file_reads if "passwd" in p or p.endswith(".data")]


def test_loading_external_data_at_an_existing_absolute_path_is_not_read(
        tmp_path: Path, no_file_reads: list[str]) -> None:
    secret = tmp_path / "w.bin"
    secret.write_bytes(_weights_bytes())
    model = _external(_mlp_graph(), str(secret))
    no_file_reads.clear()
    with pytest.raises(OnnxExternalDataError):
        load_onnx(model.SerializeToString(), "m.onnx")
    assert str(secret) not in no_file_reads


def test_loading_missing_external_data_file_is_rejected() -> None:
    model = _external(_mlp_graph(), "model.onnx.data")
    with pytest.raises(OnnxExternalDataError, match="not uploaded|zip"):
        load_onnx(model.SerializeToString(), "m.onnx")
    with pytest.raises(OnnxExternalDataError, match="not in the zip"):
        load_onnx(_zip({"model.onnx": model.SerializeToString()}), "m.zip")


def test_loading_short_external_data_is_rejected() -> None:
    model = _external(_mlp_graph(), "model.onnx.data")
    data = _zip({"model.onnx": model.SerializeToString(), "model.onnx.data": b"\0" * 8})
    with pytest.raises(OnnxExternalDataError, match="bytes its shape needs"):
        load_onnx(data)


def test_loading_zip_with_symlink_or_dotdot_member_is_rejected() -> None:
    model = _external(_mlp_graph(), "model.onnx.data")
    raw = model.SerializeToString()
    with pytest.raises(OnnxExternalDataError, match="symbolic link"):
        load_onnx(_zip({"model.onnx": raw}, links={"model.onnx.data": "/etc/passwd"}))
    with pytest.raises(OnnxExternalDataError, match="relative paths"):
        load_onnx(_zip({"model.onnx": raw, "../model.onnx.data": _weights_bytes()}))


def test_loading_zip_without_exactly_one_graph_is_rejected() -> None:
    raw = _mlp_graph().SerializeToString()
    with pytest.raises(OnnxParseError, match="exactly one"):
        load_onnx(_zip({"a.onnx": raw, "b.onnx": raw}))


def test_loading_size_cap_applies_to_upload_and_unpacked_zip() -> None:
    raw = _mlp_graph().SerializeToString()
    with pytest.raises(OnnxTooLargeError):
        load_onnx(raw, opts=LoadOptions(max_bytes=len(raw) - 1))
    bomb = _zip({"model.onnx": raw, "pad.bin": b"\0" * 100_000})
    assert len(bomb) < 50_000  # compressed: the unpacked size is what counts
    with pytest.raises(OnnxTooLargeError, match="unpacks"):
        load_onnx(bomb, opts=LoadOptions(max_bytes=50_000))


def test_loading_unsupported_ops_are_listed_with_counts() -> None:
    extra = [helper.make_node("Loop", ["y", "w"], ["c1"], name="c1"),
             helper.make_node("Loop", ["y", "w"], ["c2"], name="c2"),
             helper.make_node("LSTM", ["y", "w", "w"], ["l"], name="l")]
    model = _mlp_graph(extra_nodes=extra)
    with pytest.raises(UnsupportedOpsError) as err:
        load_onnx(model.SerializeToString())
    assert err.value.counts == {"Loop": 2, "LSTM": 1}
    assert "Loop x2" in str(err.value) and "LSTM x1" in str(err.value)
    assert "dynamo=True" in str(err.value)  # what the user can do about it


def test_loading_huge_declared_shape_is_rejected_without_allocating() -> None:
    model = _mlp_graph(seq=10**9 // D)  # (1, 2.5e8, 4): 10^9 elements
    with pytest.raises(OnnxShapeError, match="1000000000 elements"):
        load_onnx(model.SerializeToString())
    # an initializer declaring 10^9 elements without data
    big = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[10**9])
    model = _mlp_graph()
    model.graph.initializer[0].CopyFrom(big)
    with pytest.raises(OnnxShapeError):
        load_onnx(model.SerializeToString())


def test_loading_graph_without_float_input_is_rejected() -> None:
    model = _mlp_graph(input_type=TensorProto.INT64)
    model.graph.node[0].op_type = "Cast"
    del model.graph.node[0].input[1:]
    model.graph.node[0].attribute.append(helper.make_attribute("to", TensorProto.FLOAT))
    with pytest.raises(OnnxInputError, match="no float input"):
        load_onnx(model.SerializeToString())


def test_loading_checker_rejects_broken_graph() -> None:
    model = _mlp_graph()
    model.graph.node[1].input[0] = "nowhere"
    with pytest.raises(OnnxCheckError):
        load_onnx(model.SerializeToString())


def test_loading_shape_inference_on_large_weights_still_catches_mismatches() -> None:
    """Weights above 4096 elements reach shape inference as typed inputs, not data: a weight
    whose shape does not fit the product is still an error."""
    w = np.zeros((100, 100), dtype=np.float32)  # x is (1, N, 4): the inner dims disagree
    with pytest.raises(OnnxCheckError, match="checker rejected"):
        load_onnx(_mlp_graph(weight=w).SerializeToString())


def _wide_graph() -> onnx.ModelProto:
    """x (1, N, 80) @ w (80, 80): a weight above 4096 elements, which the checker and shape
    inference see as a typed graph input (light.light_copy)."""
    w = np.random.default_rng(1).standard_normal((80, 80)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, N, 80])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N, 80])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def _dup_init(m: onnx.ModelProto) -> None:
    m.graph.initializer.append(m.graph.initializer[0])


def _empty_name(m: onnx.ModelProto) -> None:
    m.graph.initializer[0].name = ""
    m.graph.node[0].input[1] = ""


def _ir3_not_an_input(m: onnx.ModelProto) -> None:
    m.ir_version = 3
    m.opset_import[0].version = 13


def _two_value_fields(m: onnx.ModelProto) -> None:
    m.graph.initializer[0].float_data.append(1.0)


def _undefined_type(m: onnx.ModelProto) -> None:
    m.graph.initializer[0].data_type = TensorProto.UNDEFINED


def _short_raw(m: onnx.ModelProto) -> None:
    t = m.graph.initializer[0]
    t.raw_data = t.raw_data[:-4]


@pytest.mark.parametrize("breakage", [_dup_init, _empty_name, _ir3_not_an_input,
                                      _two_value_fields, _undefined_type, _short_raw])
def test_loading_checker_on_light_copy_rejects_what_the_whole_file_checker_rejects(
        breakage) -> None:  # type: ignore[no-untyped-def]
    model = _wide_graph()
    load_onnx(model.SerializeToString())  # the intact graph loads
    breakage(model)
    blob = model.SerializeToString()
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(blob)
    with pytest.raises(OnnxCheckError):
        load_onnx(blob)


@pytest.mark.parametrize("delta", [-4, 4])
def test_loading_raw_weight_of_the_wrong_size_is_rejected(delta: int) -> None:
    model = _wide_graph()
    t = model.graph.initializer[0]
    t.raw_data = t.raw_data[:delta] if delta < 0 else t.raw_data + bytes(delta)
    with pytest.raises(OnnxCheckError):
        load_onnx(model.SerializeToString())


@pytest.mark.parametrize("dynamo", [False, True])
def test_loading_shape_inference_matches_inference_on_the_whole_file(dynamo: bool) -> None:
    torch.manual_seed(0)

    class Attn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(96, 4, batch_first=True)  # 27648 weights

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mha(x, x, x, need_weights=False)[0]

    x = torch.randn(1, 8, 96)
    with warnings.catch_warnings():  # the exporters' deprecation and tracer chatter
        warnings.simplefilter("ignore")
        if dynamo:
            prog = torch.onnx.export(Attn().eval(), (x,), dynamo=True, opset_version=18)
            assert prog is not None
            blob = prog.model_proto.SerializeToString()
        else:
            buf = io.BytesIO()
            torch.onnx.export(Attn().eval(), (x,), buf, dynamo=False, opset_version=18)
            blob = buf.getvalue()
    whole = onnx.shape_inference.infer_shapes(blob, strict_mode=True).graph
    loaded = load_onnx(blob, "attn.onnx").spec.model.graph
    assert [v.SerializeToString() for v in loaded.value_info] == \
        [v.SerializeToString() for v in whole.value_info]
    assert [v.SerializeToString() for v in loaded.output] == \
        [v.SerializeToString() for v in whole.output]
    assert len(loaded.value_info) > 20


def test_loading_old_opset_is_rejected() -> None:
    with pytest.raises(OnnxCheckError, match="opset"):
        load_onnx(_mlp_graph(opset=9).SerializeToString())


def test_loading_mismatch_with_onnxruntime_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from lsa_models.onnx import ops
    from lsa_models.onnx.ops.activation import ActivationOp

    class Wrong(ActivationOp):
        def run(self, node, ins, ctx):  # type: ignore[no-untyped-def]
            return [torch.tanh(ins[0])]

    monkeypatch.setitem(ops.OPS, "Relu", Wrong())
    with pytest.raises(OnnxMismatchError, match="differs from onnxruntime"):
        load_onnx(_mlp_graph().SerializeToString())


def test_loading_dynamic_seq_len_needs_seq_len() -> None:
    loaded = load_model_bytes(_mlp_graph(seq="n").SerializeToString(), "m.onnx")
    assert loaded.format == "onnx" and loaded.seq_len is None
    with pytest.raises(DynamicSeqLenError, match="--seq-len"):
        loaded.certify("2")
    res = loaded.certify("2", seq_len=5)
    assert res.verdict == "certified" and res.seq_len == 5


def test_loading_embedding_lookup_starts_the_continuous_input() -> None:
    rng = np.random.default_rng(1)
    table = rng.standard_normal((11, D)).astype(np.float32)
    w = rng.standard_normal((D, D)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["emb", "ids"], ["e"], name="embed"),
         helper.make_node("MatMul", ["e", "w"], ["y"], name="mm")],
        "emb", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, N])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N, D])],
        [numpy_helper.from_array(table, "emb"), numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    m = load_onnx(model.SerializeToString())
    assert m.spec.input_name == "e" and m.spec.d_model == D
    x = torch.randn(1, N, D)
    assert torch.allclose(m.module(x), x @ torch.from_numpy(w), atol=1e-6)


def test_gather_elements_runs_and_bounds_as_a_selection() -> None:
    node = Node("ge", "GatherElements", ["x", "i"], ["y"], {"axis": 1})
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    idx = torch.tensor([[0, 0, 2], [1, -1, 1]])
    (y,) = OPS["GatherElements"].run(node, [x, idx], RunContext(torch.float64))
    assert y.tolist() == [[0.0, 0.0, 2.0], [4.0, 5.0, 4.0]]
    for norm, want in (("2", np.sqrt(2.0)), ("inf", 1.0)):
        (f,) = OPS["GatherElements"].bound(node, [Flow(1.0, None, (2, 3)), idx.numpy()],
                                           [(2, 3)], norm)
        assert f is not None and want <= f.lip <= want * (1 + 1e-12)
        # the selection matrix's exact norm: entries copied twice count twice
        sel = torch.zeros(6, 6, dtype=torch.float64)
        flat = [0, 0, 2, 4, 5, 4]
        for r, c in enumerate(flat):
            sel[r, c] = 1.0
        exact = float(torch.linalg.matrix_norm(sel, 2)) if norm == "2" else float(
            sel.abs().sum(1).max())
        assert exact <= f.lip


@pytest.mark.parametrize("array", [
    np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5,
    np.float32(2.5),
    np.zeros((0, 3), np.float32),
    np.arange(6, dtype=np.float16).reshape(2, 3),
    np.arange(6, dtype=np.int64),
    np.array([1.0, -2.0], np.float64),
])
def test_graph_initializer_is_the_value_of_tensor_from_proto(array: np.ndarray) -> None:
    from lsa_models.onnx.graph import _initializer
    from lsa_models.onnx.ops import tensor_from_proto

    ctx = RunContext(torch.float32)
    for t in (numpy_helper.from_array(array, "w"),
              helper.make_tensor("w", helper.np_dtype_to_tensor_dtype(array.dtype),
                                 array.shape, array.ravel().tolist())):  # raw and typed fields
        got, want = _initializer(t, ctx), tensor_from_proto(t, ctx)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_graph_initializer_with_short_raw_data_is_an_error() -> None:
    from lsa_models.onnx.graph import _initializer

    t = numpy_helper.from_array(np.ones((2, 3), np.float32), "w")
    t.raw_data = t.raw_data[:-4]
    with pytest.raises(ValueError, match="raw bytes"):
        _initializer(t, RunContext(torch.float32))


def _attn_blob(dynamo: bool) -> bytes:
    torch.manual_seed(0)

    class Attn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(96, 4, batch_first=True)  # 27648 weights
            self.ff = torch.nn.Linear(96, 96)  # 9216: both above the 4096 of a weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.ff(self.mha(x, x, x, need_weights=False)[0])

    x = torch.randn(1, 8, 96)
    with warnings.catch_warnings():  # the exporters' deprecation and tracer chatter
        warnings.simplefilter("ignore")
        if dynamo:
            prog = torch.onnx.export(Attn().eval(), (x,), dynamo=True, opset_version=18)
            assert prog is not None
            return prog.model_proto.SerializeToString()
        buf = io.BytesIO()
        torch.onnx.export(Attn().eval(), (x,), buf, dynamo=False, opset_version=18)
        return buf.getvalue()


@pytest.mark.parametrize("dynamo", [False, True])
def test_ort_session_on_module_weights_gives_the_outputs_of_the_whole_file(dynamo: bool) -> None:
    """The onnxruntime check gets the large float32 weights as the module's arrays
    (light.ort_light_model): the outputs are bit for bit those of the file as uploaded."""
    from lsa_models.onnx.light import ort_light_model
    from lsa_models.onnx.loading import _ort_session

    loaded = load_onnx(_attn_blob(dynamo), "attn.onnx")
    _, weights = ort_light_model(loaded.spec.model, loaded.module.consts)
    assert len(weights) >= 2  # the test exercises the arrays path
    x = np.random.default_rng(0).standard_normal((1, 8, 96)).astype(np.float32)
    name = loaded.spec.input_name
    whole = _ort_session(loaded.spec).run(None, {name: x})[0]
    light = _ort_session(loaded.spec, loaded.module).run(None, {name: x})[0]
    assert np.array_equal(whole, light)


def test_loading_mismatch_with_onnxruntime_on_large_weights_is_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch op that misreads a large weight is still caught: onnxruntime computes with
    the file's weights, not with what the op made of them."""
    from lsa_models.onnx import ops
    from lsa_models.onnx.ops.linear import LinearOp

    class Transposed(LinearOp):  # reads W^T instead of W
        def run(self, node, ins, ctx):  # type: ignore[no-untyped-def]
            return super().run(node, [ins[0], ins[1].transpose(-1, -2)], ctx)

    monkeypatch.setitem(ops.OPS, "MatMul", Transposed())
    with pytest.raises(OnnxMismatchError, match="differs from onnxruntime"):
        load_onnx(_wide_graph().SerializeToString())


def _varint_bytes(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:  # one length-delimited protobuf field
    return _varint_bytes(number << 3 | 2) + _varint_bytes(len(payload)) + payload


@pytest.mark.parametrize("dynamo", [False, True])
def test_raw_weight_views_are_the_initializers_of_exported_models(dynamo: bool) -> None:
    from lsa_models.onnx.light import raw_weight_views

    blob = _attn_blob(dynamo)
    model = onnx.ModelProto()
    model.ParseFromString(blob)
    views = raw_weight_views(blob, model)
    large = [t for t in model.graph.initializer
             if t.data_type == TensorProto.FLOAT and np.prod(t.dims) > 4096]
    assert len(large) >= 2 and set(views) == {t.name for t in large}
    for t in large:
        assert np.array_equal(views[t.name], numpy_helper.to_array(t))
    loaded = load_onnx(blob)
    for t in large:  # the evaluator's constants are those views
        assert np.shares_memory(loaded.module.consts[t.name].numpy(), np.frombuffer(blob, np.uint8))


def test_raw_weight_views_follow_protobuf_merging() -> None:
    """A graph split over two fields (initializers concatenate) and a tensor whose raw_data
    appears twice (the last wins): the views are what the parser read."""
    from lsa_models.onnx.light import raw_weight_views

    model = _wide_graph()
    t = model.graph.initializer[0]
    real = t.raw_data
    garbage = onnx.TensorProto()
    garbage.CopyFrom(t)
    garbage.raw_data = bytes(len(real))
    tensor = garbage.SerializeToString() + _field(9, real)  # raw_data twice: the last wins
    del model.graph.initializer[:]
    graph = model.graph.SerializeToString()
    model.ClearField("graph")
    blob = (model.SerializeToString() + _field(7, graph)
            + _field(7, _field(5, tensor)))  # a second graph field holding the initializer
    parsed = onnx.ModelProto()
    parsed.ParseFromString(blob)
    assert parsed.graph.initializer[0].raw_data == real
    views = raw_weight_views(blob, parsed)
    assert np.array_equal(views["w"], np.frombuffer(real, np.float32).reshape(80, 80))
    assert torch.equal(load_onnx(blob).module.consts["w"],
                       torch.from_numpy(numpy_helper.to_array(parsed.graph.initializer[0])))


def test_raw_weight_views_of_bytes_that_do_not_match_are_empty() -> None:
    from lsa_models.onnx.light import raw_weight_views

    model = _wide_graph()
    blob = model.SerializeToString()
    other = _wide_graph()
    other.graph.initializer[0].name = "v"  # the parsed model does not match the bytes
    assert raw_weight_views(blob, other) == {}
    assert raw_weight_views(blob[:-7], model) == {}  # a field runs past the end


def test_ort_session_falls_back_to_the_whole_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """A light graph onnxruntime refuses is no reason to refuse the upload: the check then
    runs on the file as uploaded."""
    from lsa_models.onnx import loading

    monkeypatch.setattr(loading, "ort_light_model", lambda model, consts: (b"\x08\x99", {}))
    loaded = load_onnx(_wide_graph().SerializeToString())
    assert loaded.max_abs_diff is not None and loaded.max_abs_diff < 1e-4
