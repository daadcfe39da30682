"""`lsa supports`: the listing matches what the loader and the op registry accept."""

from __future__ import annotations

import json

import onnx
import pytest
from typer.testing import CliRunner

from lsa_models.onnx import UnsupportedOpsError, load_onnx, supported_op_types
from lsa_models.onnx.loading import MAX_OPSET, MIN_OPSET
from lsa_models.onnx.ops import Node, unsupported_ops
from service.cli import app

runner = CliRunner()


def _supports_json() -> dict:  # type: ignore[type-arg]
    res = runner.invoke(app, ["supports", "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_supports_json_lists_the_registry_and_opsets() -> None:
    data = _supports_json()
    ops = [o["op"] for o in data["onnx"]["operators"]]
    assert ops == supported_op_types()
    assert (data["onnx"]["opset_min"], data["onnx"]["opset_max"]) == (MIN_OPSET, MAX_OPSET)
    # every listed op is one the loader evaluates
    assert unsupported_ops([Node(f"n{i}", op, [], []) for i, op in enumerate(ops)]) == {}
    families = data["onnx"]["families"]
    assert {o["family"] for o in data["onnx"]["operators"]} == set(families)
    assert all(families.values())
    names = " ".join(p["pattern"] for p in data["patterns"])
    for pattern in ("L2 self-attention", "dot-product", "LayerNorm", "GELU"):
        assert pattern in names
    assert {"(N, D)", "(N, 1, D)"} <= {lay["layout"] for lay in data["layouts"]}
    assert data["norms"] == ["2", "inf"]


def test_supports_table_names_every_operator() -> None:
    res = runner.invoke(app, ["supports"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for op in supported_op_types():
        assert op in res.stdout
    assert f"{MIN_OPSET}..{MAX_OPSET}" in res.stdout


@pytest.mark.parametrize("op", ["NonMaxSuppression", "LSTM"])
def test_supports_unlisted_op_is_refused_by_the_loader(op: str) -> None:
    assert op not in {o["op"] for o in _supports_json()["onnx"]["operators"]}
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4, 4])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 4])
    node = onnx.helper.make_node(op, ["x"], ["y"], name="n")
    graph = onnx.helper.make_graph([node], "g", [x], [y])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    with pytest.raises(UnsupportedOpsError, match=op):
        load_onnx(model.SerializeToString())
