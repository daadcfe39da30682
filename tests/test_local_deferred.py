"""Margins past the final LayerNorm with its product deferred past the head
(lsa_models/engine/deferred.py): the tail is found only where it is linear and read once, and
the deferred lower bounds never exceed the margins PGD reaches inside the ball, on the
issue-15 Transformers and on tails spelled differently (CLS token, flattened tokens, a
temperature)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from lsa_models.engine import deferred, driver
from lsa_models.engine.driver import Centre, margin_lower_bounds
from lsa_models.onnx import load_onnx
from lsa_models.onnx.loading import OnnxModel
from tests.margins import descend_margin

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from local_models import build, center, export  # noqa: E402

N, D = 4, 8


class Tail(nn.Module):
    """A pre-norm attention block, then LayerNorm and a head spelled as `kind` says."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(D, 3 * D)
        self.ln0, self.ln = nn.LayerNorm(D), nn.LayerNorm(D)
        self.head = nn.Linear(N * D if kind == "flat" else D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, 3)
        q, k, v = self.qkv(self.ln0(x)).split(D, dim=-1)
        x = x + torch.softmax(q @ k.transpose(-1, -2) / D**0.5, dim=-1) @ v
        y = self.ln(x)  # (B, N, D)
        if self.kind == "cls":
            return self.head(y[:, 0]) / 0.7
        if self.kind == "flat":
            return self.head(y.flatten(1))
        if self.kind == "twice":  # the LayerNorm's output read twice: no tail
            return self.head(y.mean(1)) + self.head(y[:, 0])
        return self.head(torch.tanh(y).mean(1))  # "tanh": a nonlinear op in the tail


def _tail_model(kind: str, tmp: Path) -> OnnxModel:
    torch.manual_seed(1)
    path = tmp / f"{kind}.onnx"
    torch.onnx.export(Tail(kind).eval(), (torch.randn(1, N, D),), str(path), dynamo=False,
                      opset_version=17, input_names=["x"], output_names=["logits"])
    return load_onnx(path.read_bytes())


def _tail_of(om: OnnxModel, x0: np.ndarray) -> tuple | None:
    ctr = Centre(om, x0)
    return deferred.find_tail(list(ctr.module.runtime_nodes), om.spec.output_name, ctr.env)


def test_find_tail_takes_linear_tails_read_once(tmp_path: Path) -> None:
    x0 = np.random.default_rng(0).standard_normal((1, N, D))
    for kind in ("cls", "flat"):
        tail = _tail_of(_tail_model(kind, tmp_path), x0)
        assert tail is not None and tail[0].op_type == "LayerNormalization"
    for kind in ("twice", "tanh"):
        assert _tail_of(_tail_model(kind, tmp_path), x0) is None
    mlp = load_onnx(export(build("mlp", 0), tmp_path / "mlp.onnx").read_bytes())
    assert _tail_of(mlp, center(1).numpy().astype(np.float64)) is None


def _pgd_min(om: OnnxModel, x0: np.ndarray, label: int, j: int, eps: float, norm: str,
             seed: int) -> float:
    """The smallest margin f_label - f_j projected gradient descent finds in the ball."""
    f = om.module.with_dtype(torch.float64)
    gen = torch.Generator().manual_seed(seed)
    best = float("inf")
    for _ in range(2):
        d = (torch.rand(x0.shape, generator=gen, dtype=torch.float64) * 2 - 1) * eps
        if norm == "2":
            d = d * min(1.0, eps / float(d.norm()))
        best = min(best, *descend_margin(f, torch.from_numpy(x0), label, j, eps, norm, d))
    return best


CASES = [("tf1", "inf", 0.05), ("tf1", "2", 0.2), ("tf2", "inf", 0.034),
         ("cls", "inf", 0.05), ("flat", "2", 0.3)]


@pytest.mark.parametrize(("kind", "norm", "eps"), CASES)
def test_deferred_margins_hold_against_pgd(kind: str, norm: str, eps: float,
                                           tmp_path: Path) -> None:
    if kind in ("tf1", "tf2"):
        om = load_onnx(export(build(kind, 0), tmp_path / f"{kind}.onnx").read_bytes())
        x0 = center(1).numpy().astype(np.float64)
    else:
        om = _tail_model(kind, tmp_path)
        x0 = np.random.default_rng(3).standard_normal((1, N, D))
    f = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        label = int(f(torch.from_numpy(x0)).reshape(-1).argmax())
    low = margin_lower_bounds(om, x0, eps, norm, label)
    assert low is not None
    for j, bound in low.items():
        assert _pgd_min(om, x0, label, j, eps, norm, seed=j) >= bound - 1e-12


def test_deferred_margins_are_tighter_on_the_transformer(tmp_path: Path) -> None:
    """tf1 at 0.048 (the affine route's radius before session 11): the plain forms leave the
    worst margin 0.066, the deferred product 0.095 (session 11): at least 1.3x as much."""
    om = load_onnx(export(build("tf1", 0), tmp_path / "tf1.onnx").read_bytes())
    x0 = center(1).numpy().astype(np.float64)
    f = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        label = int(f(torch.from_numpy(x0)).reshape(-1).argmax())
    with_ = margin_lower_bounds(om, x0, 0.048, "inf", label)
    token = driver.DEFER
    driver.DEFER = False
    try:
        without = margin_lower_bounds(om, x0, 0.048, "inf", label)
    finally:
        driver.DEFER = token
    assert with_ is not None and without is not None
    assert all(with_[j] >= without[j] for j in with_)
    worst = min(with_, key=lambda j: without[j])
    assert with_[worst] >= 1.3 * max(without[worst], 1e-3)
