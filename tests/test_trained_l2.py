"""The paper's L2-attention ViT (einsum heads, `P X A W^V`, no LayerNorm) trained on the
digits: its attention is recognised through both exporters, the certified global constant is
above float64 Jacobian norms of the trained module, and every correctly classified test image
gets a positive certified radius (docs/bounds.md, "L2 attention read from a graph")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from bench.trained.models import digits, paper_l2_vit, train
from bench.trained.train import export
from lsa_models.analysis import load_model_bytes
from lsa_models.engine.routes.at_radius import decide
from lsa_models.onnx import analyse, load_onnx
from service.bounds.local import model_input

from .jacobians import jacobian_norm

pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def trained() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.set_num_threads(1)
    data = digits()
    model, rec = train("paper_l2_vit", epochs=30, data=data,
                       build=lambda: paper_l2_vit(d=16, layers=1))
    assert rec["clean_accuracy"] > 0.5  # trained: chance is 0.1
    return model, data


@pytest.mark.parametrize("dynamo", [False, True])
def test_trained_paper_l2_vit_certified_above_jacobians(
        trained: tuple, tmp_path: Path, dynamo: bool) -> None:
    model, data = trained
    path = export(model, tmp_path / "l2.onnx", dynamo=dynamo)
    got = analyse(load_onnx(path.read_bytes()), "2")
    assert got.verdict == "certified", got.reason
    assert "l2_mha" in [lb.kind for lb in got.layers]
    f64 = model.double()
    try:
        for i in range(3):  # the map on pixels: the graph's patches are a permutation of them
            x = data[2][i:i + 1].double()
            assert got.upper is not None and got.upper >= jacobian_norm(f64, x, "2")
    finally:
        model.float()


@pytest.mark.timeout(240)
def test_trained_paper_l2_vit_certifies_a_positive_radius(trained: tuple,
                                                          tmp_path: Path) -> None:
    model, data = trained
    path = export(model, tmp_path / "l2.onnx")
    loaded = load_model_bytes(path.read_bytes(), path.name)
    x_te, y_te = data[2], data[3]
    with torch.no_grad():
        right = torch.nonzero(model(x_te[:12]).argmax(1) == y_te[:12]).flatten().tolist()
    assert right
    for i in right[:4]:
        xi = model_input(loaded, x_te[i].numpy().astype(np.float64))
        v = decide(loaded, xi, int(y_te[i]), "inf", 1e-3, sweep=False)
        assert v.status == "certified", (i, v)
