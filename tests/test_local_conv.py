"""The local Conv rule (lsa_models/engine/rules_conv.py, docs/local-bounds.md "Conv"): the
enclosure holds the exact float64 Jacobian and value at points of the ball for strided,
padded, dilated, grouped 1-D/2-D Convs; ViT blocks on pixels get local bounds between the
in-ball lower bound and the global bound; a pixel classifier gets a robustness radius."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from lsa_models.empirical.local import local_lower_bound
from lsa_models.engine import primitives as pr
from lsa_models.engine.driver import graph_input_shape, local_jacobian
from lsa_models.engine.local import certify_local, robustness
from lsa_models.engine.rules import LOCAL_RULES
from lsa_models.engine.values import Ball, LocalValue, input_value
from lsa_models.onnx import analyse, load_onnx
from lsa_models.onnx.ops import Node

from .test_onnx_conv import _ConvMixer, _ViT
from .test_onnx_recognition import _export

_CONV = {1: F.conv1d, 2: F.conv2d}


def _ball_points(x0: np.ndarray, eps: float, norm: str, rng: np.random.Generator,
                 n: int) -> list[np.ndarray]:
    """The centre, then corners of the inf-ball / points of the 2-sphere."""
    pts = [x0]
    for _ in range(n):
        if norm == "inf":
            d = rng.choice([-1.0, 1.0], size=x0.shape) * eps
        else:
            d = rng.standard_normal(x0.shape)
            d *= eps / np.linalg.norm(d)
        pts.append(x0 + d)
    return pts


@settings(max_examples=60, deadline=None)
@given(scale=st.sampled_from([1e-3, 1.0, 1e3]), k=st.integers(1, 3), stride=st.integers(1, 3),
       dilation=st.integers(1, 2), pad_lo=st.integers(0, 2), pad_hi=st.integers(0, 2),
       groups=st.sampled_from([1, 2]), seed=st.integers(0, 2**31 - 1),
       norm=st.sampled_from(["2", "inf"]), spatial=st.sampled_from([1, 2]),
       eps=st.sampled_from([0.0, 1e-3, 0.1, 1.0]))
def test_local_conv_enclosure_holds_exact_jacobians_in_the_ball(
        scale: float, k: int, stride: int, dilation: int, pad_lo: int, pad_hi: int,
        groups: int, seed: int, norm: str, spatial: int, eps: float) -> None:
    """Y = Conv(tanh(X)) + b: the tanh gives the Conv's input a nonzero Jacobian radius; at
    the centre and at corners / sphere points, the exact float64 Jacobian of Y lies in
    jc +- jr and Y in [lo, hi]."""
    gen = torch.Generator().manual_seed(seed)
    c_in, out = 2 * groups, 2 * groups
    kern = (k,) * spatial
    w = scale * torch.randn(out, c_in // groups, *kern, generator=gen, dtype=torch.float64)
    b = torch.randn(out, generator=gen, dtype=torch.float64)
    size = (1 + dilation * (k - 1) + stride,) * spatial
    x0 = torch.randn(1, c_in, *size, generator=gen, dtype=torch.float64)  # (1, C, *size)
    pads = [pad_lo] * spatial + [pad_hi] * spatial  # ONNX: begins, then ends
    attrs = {"kernel_shape": list(kern), "strides": [stride] * spatial,
             "dilations": [dilation] * spatial, "pads": pads, "group": groups}
    node = Node("c", "Conv", ["x", "w", "b"], ["y"], attrs)

    def f(z: Tensor) -> Tensor:
        zp = F.pad(torch.tanh(z), [p for i in reversed(range(spatial))
                                   for p in (pads[i], pads[i + spatial])])
        return _CONV[spatial](zp, w, b, stride=stride, dilation=dilation, groups=groups)

    ball = Ball(x0.numpy(), eps, norm)
    t = pr.elementwise(input_value(ball), "tanh", np.tanh(x0.numpy()), ball)
    with torch.no_grad():
        yc = f(x0).numpy()
    y = LOCAL_RULES["Conv"].apply(node, [t, w.numpy(), b.numpy()], [yc], ball)[0]
    assert isinstance(y, LocalValue) and y.term is None  # linear: no remainder
    p = x0.numel()
    rng = np.random.default_rng(seed)
    for pt in _ball_points(x0.numpy(), eps, norm, rng, 6):
        xt = torch.from_numpy(pt)
        jac = torch.autograd.functional.jacobian(f, xt).reshape(*yc.shape, p).numpy()
        assert np.all(np.abs(jac - y.jc) <= y.jr), float(np.max(np.abs(jac - y.jc) - y.jr))
        with torch.no_grad():
            val = f(xt).numpy()
        assert np.all(y.lo <= val) and np.all(val <= y.hi)


def test_local_conv_jacobian_centre_is_the_exact_one() -> None:
    """At eps = 0 with an exact input (Jacobian the identity), jc is the Conv's matrix and
    jr only the rounding of float64 sums (relative, about 1e-15)."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(4, 1, 3, generator=gen, dtype=torch.float64)
    x0 = torch.randn(1, 2, 7, generator=gen, dtype=torch.float64)
    node = Node("c", "Conv", ["x", "w"], ["y"], {"strides": [2], "pads": [1, 2], "group": 2})
    ball = Ball(x0.numpy(), 0.0, "2")

    def f(z: Tensor) -> Tensor:
        return F.conv1d(F.pad(z, [1, 2]), w, stride=2, groups=2)

    y = LOCAL_RULES["Conv"].apply(node, [input_value(ball), w.numpy()], [f(x0).numpy()],
                                  ball)[0]
    assert isinstance(y, LocalValue)
    jac = torch.autograd.functional.jacobian(f, x0).reshape(*y.shape, -1).numpy()
    np.testing.assert_allclose(y.jc, jac, rtol=0, atol=1e-15)
    assert float(y.jr.max()) <= 1e-13 * float(np.abs(jac).max())


@pytest.fixture(scope="module")
def vit_pixels(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, np.ndarray]:
    m = _ViT().eval()
    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    om = load_onnx(_export(m, x, tmp_path_factory.mktemp("vit") / "vit.onnx", False))
    shape = graph_input_shape(om)  # the patches (1, P, C kh kw) the loader rewrote
    x0 = np.random.default_rng(1).standard_normal(shape)
    return om, x0


@pytest.mark.parametrize("norm", ["2", "inf"])
def test_local_conv_vit_on_pixels_certified_between_lower_and_global(
        vit_pixels: tuple[object, np.ndarray], norm: str) -> None:
    om, x0 = vit_pixels
    eps = 1e-2
    lj = local_jacobian(om, x0, eps, norm)  # type: ignore[arg-type]
    assert lj.forward_checked, lj.forward_detail  # the Conv's forward error is proven too
    enclosure = lj.upper()
    res = certify_local(om, x0, eps, norm)  # type: ignore[arg-type]
    glob = analyse(om, norm)  # type: ignore[arg-type]
    assert glob.upper is not None and res.upper is not None
    f64 = om.module.with_dtype(torch.float64)  # type: ignore[attr-defined]
    lb = local_lower_bound(f64, x0, eps, norm, restarts=2, steps=6, seed=0)
    assert lb.lower <= enclosure and lb.lower <= res.upper <= glob.upper
    # the Jacobian enclosure itself is the local bound here (far below the global one)
    assert res.upper <= enclosure and enclosure < glob.upper


@pytest.mark.parametrize("dynamo", [False, True])
def test_local_conv_depthwise_token_conv_block_certified_locally(tmp_path: Path,
                                                                 dynamo: bool) -> None:
    """A Conv inside the graph (Conformer-style depthwise Conv1d over the tokens, padded,
    D groups) in a residual before attention: local bound between the in-ball lower bound and
    the global bound, in both norms and through both exporters."""
    m = _ConvMixer().eval()
    om = load_onnx(_export(m, torch.randn(1, 6, 16), tmp_path / "mix.onnx", dynamo))
    x0 = np.random.default_rng(0).standard_normal((1, 6, 16))
    f64 = om.module.with_dtype(torch.float64)
    for norm in ("2", "inf"):
        lj = local_jacobian(om, x0, 1e-2, norm)
        glob = analyse(om, norm).upper
        lb = local_lower_bound(f64, x0, 1e-2, norm, restarts=2, steps=6, seed=0)
        assert glob is not None and lb.lower <= lj.upper() < glob, norm


class _PixelNet(nn.Module):
    """A tiny pixel classifier: ViT patch embedding, tanh, linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.proj = nn.Conv2d(2, 4, 2, stride=2)
        self.head = nn.Linear(4 * 4, 3)

    def forward(self, x: Tensor) -> Tensor:  # (B, 2, 4, 4)
        t = self.proj(x).flatten(2).transpose(1, 2)  # (B, 4, 4)
        return self.head(torch.tanh(t).flatten(1))  # (B, 3)


@pytest.mark.parametrize("norm", ["2", "inf"])
def test_local_conv_pixel_classifier_robustness_radius(tmp_path: Path, norm: str) -> None:
    m = _PixelNet().eval()
    om = load_onnx(_export(m, torch.randn(1, 2, 4, 4), tmp_path / "px.onnx", False))
    x0 = np.random.default_rng(2).standard_normal(graph_input_shape(om))  # the patches
    f64 = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        label = int(f64(torch.from_numpy(x0)).argmax())
    r = robustness(om, x0, label, norm, attack_restarts=2)
    assert r.predicted == label and r.certified_radius > 0
    assert r.attack_radius is None or r.certified_radius <= r.attack_radius
