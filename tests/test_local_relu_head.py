"""Margins through a ReLU head (lsa_models/engine/heads/relu_head.py): the last ReLU's one-sided
relaxations chosen per margin give lower bounds that never exceed the margins (exact
functions at the extreme points and random points of the ball, PGD on ONNX models) and are
never below the plain forms' bounds."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lsa_models.engine.affine import form as affine
from lsa_models.engine.affine import walk as affine_rules
from lsa_models.engine.drivers import jacobian as driver
from lsa_models.engine.heads import relu_head
from lsa_models.engine.values import Ball
from lsa_models.onnx import load_onnx
from lsa_models.onnx.loading import OnnxModel
from lsa_models.onnx.ops import Node

from .margins import with_and_without_heads
from .test_local_affine import _points, _source, _symbols
from .test_local_deferred import _pgd_min

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from local_models import center, export, relu_mlp  # noqa: E402

from tests.profile import at_most


@settings(max_examples=at_most(150), deadline=None)  # an example costs ~80 ms on 2 shared cores
@given(seed=st.integers(0, 10**6), eps=st.sampled_from([1e-2, 0.1, 0.5]),
       norm=st.sampled_from(["2", "inf"]), shift=st.sampled_from([-1.0, 0.0, 1.0]),
       tied=st.booleans())
def test_relu_head_margins_are_below_the_margins_everywhere(
        seed: int, eps: float, norm: str, shift: float, tied: bool) -> None:
    """logits = W2 ReLU(z) + b2, z = shift + tanh(c + A d) (H = 6 units, most of them
    unstable on the larger balls): relu_head.margins' values lie below the exact margins at
    the extreme points of every unit's and every margin's linear part, random points, and
    projected-descent ends. `tied`: the units in equal pairs (z_h = z_h+3), so that a unit
    with a positive coefficient can be active at the minimiser, pulled there by its twin's
    negative one (distinct units put it where the unit is off, and there any alpha's line
    lies below ReLU). Dropping the chord's offset, or alphas up to 5 instead of 1, fails it,
    and with `tied` alphas up to 1.2 do."""
    rng = np.random.default_rng(seed)
    p, h, k = 4, 6, 3
    ball = Ball(rng.standard_normal(p), eps, norm)
    w2 = rng.standard_normal((k, h))
    b2 = rng.standard_normal(k)
    env = {"W": torch.from_numpy(w2), "B": torch.from_numpy(b2)}
    gemm = Node("g", "Gemm", ["y", "W", "B"], ["out"], {"transB": 1})
    relu = Node("r", "Relu", ["z"], ["y"], {})
    with _symbols(ball):
        if tied:
            half, fh = _source(rng, (1, h // 2), ball)
            t = affine.Aff(*(np.concatenate([v, v], axis=1)
                             for v in (half.c, half.m, half.o, half.a, half.b)))

            def ft(d: torch.Tensor, fh: Callable[[torch.Tensor], torch.Tensor] = fh
                   ) -> torch.Tensor:
                v = fh(d)
                return torch.cat([v, v], dim=-1)
        else:
            t, ft = _source(rng, (1, h), ball)
        z = Aff_shift(t, shift)
        y = affine_rules.elementwise(z, affine_rules.RELU, ball,
                                     out_c=np.maximum(z.c, 0.0), out_m=np.zeros((1, h)))
        out_c = np.maximum(z.c, 0.0) @ w2.T + b2
        out = affine_rules.step(gemm, [y, w2, b2], [out_c], ball, lambda i: None)[0]
        env["y"] = torch.from_numpy(np.maximum(z.c, 0.0))
        env["out"] = torch.from_numpy(out_c)
        label = int(np.argmax(out_c))
        low = relu_head.margins([gemm], env, ball, relu, z, y, out, label)
    w2t, b2t = torch.from_numpy(w2), torch.from_numpy(b2)

    def logits(d: torch.Tensor) -> torch.Tensor:
        return torch.relu(ft(d) + shift).reshape(-1) @ w2t.T + b2t

    dirs = [z.a.reshape(h, -1)[i, :p] for i in range(h)]
    for j, bound in low.items():
        pts = [torch.from_numpy(d) for d in _points(rng, ball, dirs)]
        d = pts[-1].clone()  # from a random point of the ball
        for _ in range(30):  # projected descent on the margin
            d.requires_grad_(True)
            out_d = logits(d)
            (g,) = torch.autograd.grad(out_d[label] - out_d[j], d)
            with torch.no_grad():
                step = -torch.sign(g) if norm == "inf" else -g / max(float(g.norm()), 1e-300)
                d = d + eps / 8 * step
                n = max(float(d.norm()), 1e-300)
                d = d.clamp(-eps, eps) if norm == "inf" else d * min(1.0, eps / n)
            pts.append(d.detach())
        for pt in pts:
            with torch.no_grad():
                o = logits(pt)
            assert float(o[label] - o[j]) >= bound - 1e-12, (float(o[label] - o[j]), bound)


def Aff_shift(x: affine.Aff, k: float) -> affine.Aff:  # noqa: N802
    """x + k (a constant): the change is the same, the centre moves."""
    return affine.Aff(x.c + k, x.m, x.o, x.a, x.b)


class DistilHead(nn.Module):
    """An attention block, LayerNorm, then DistilBERT's head on the first token:
    Linear -> ReLU -> Linear."""

    def __init__(self, d: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.d = d
        self.qkv = nn.Linear(d, 3 * d)
        self.ln = nn.LayerNorm(d)
        self.pre, self.cls = nn.Linear(d, hidden), nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, 3)
        q, k, v = self.qkv(x).split(self.d, dim=-1)
        x = self.ln(x + torch.softmax(q @ k.transpose(-1, -2) / self.d**0.5, dim=-1) @ v)
        return self.cls(torch.relu(self.pre(x[:, 0])))


def _exported(make: type[nn.Module], seed: int, tmp: Path) -> OnnxModel:
    """make() with weights from `seed`, exported on a (1, 4, 8) input and loaded."""
    torch.manual_seed(seed)
    path = tmp / f"{make.__name__}.onnx"
    torch.onnx.export(make().eval(), (torch.randn(1, 4, 8),), str(path), dynamo=False,
                      opset_version=17, input_names=["x"], output_names=["logits"])
    return load_onnx(path.read_bytes())


class TorchPreNorm(nn.Module):
    """torch's own pre-norm encoder layer (ReLU FFN, no final norm), a mean-pooled head: the
    ReLU reaches the output through the residual Add (a side: the attention branch)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.body = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, 3)
        return self.head(self.body(x).mean(dim=1))


@pytest.mark.parametrize(("kind", "norm", "eps"),
                         [("relu-mlp", "inf", 0.05), ("relu-mlp", "2", 0.6),
                          ("distil", "inf", 0.1), ("distil", "2", 0.4),
                          ("torch-prenorm", "inf", 0.03), ("torch-prenorm", "2", 0.15)])
def test_relu_head_margins_hold_against_pgd_and_lift_the_plain_ones(
        kind: str, norm: str, eps: float, tmp_path: Path) -> None:
    """The ReLU head is found behind the linear classifier (an MLP's last hidden layer; a
    DistilBERT-style pre-classifier on the first token; torch's pre-norm layer's FFN through
    the residual Add, the attention branch a side); PGD on each margin stays above its bound,
    which is at least the plain forms' and above it somewhere."""
    if kind == "relu-mlp":
        om = load_onnx(export(relu_mlp(), tmp_path / "relu.onnx").read_bytes())
        x0 = center(1).numpy().astype(np.float64)
    else:
        om = _exported(DistilHead, 5, tmp_path) if kind == "distil" else \
            _exported(TorchPreNorm, 7, tmp_path)
        x0 = np.random.default_rng(6).standard_normal((1, 4, 8))
    ctr = driver.Centre(om, x0)
    with ctr:
        found = relu_head.find_relu_tail(list(ctr.module.runtime_nodes), om.spec.output_name,
                                         ctr.env, om.spec.input_name)
    assert found is not None and found[0].op_type == "Relu"
    # the residual join is a side (torch's layer); the others have none
    assert len(found[2]) == (1 if kind == "torch-prenorm" else 0)
    f = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        label = int(f(torch.from_numpy(x0)).reshape(-1).argmax())
    low, plain = with_and_without_heads(om, x0, eps, norm, label)
    assert all(low[j] >= plain[j] for j in low) and any(low[j] > plain[j] for j in low)
    for j, bound in low.items():
        assert _pgd_min(om, x0, label, j, eps, norm, seed=j) >= bound - 1e-12
