"""The local Conv rule (lsa_models/engine/enclosure/rules_conv.py, docs/local-enclosure.md "Conv"):
the enclosure holds the exact float64 Jacobian and value at points of the ball for strided, padded,
dilated, grouped 1-D/2-D Convs; ViT blocks on pixels get local bounds between the in-ball lower
bound and the global bound; a pixel classifier gets a robustness radius."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from lsa_models.empirical.local import local_lower_bound
from lsa_models.engine.affine import walk as affine_rules
from lsa_models.engine.affine.form import Aff
from lsa_models.engine.drivers.centre import graph_input_shape
from lsa_models.engine.drivers.jacobian import local_jacobian
from lsa_models.engine.drivers.margins import margin_lower_bounds
from lsa_models.engine.enclosure import primitives as pr
from lsa_models.engine.enclosure.rules import LOCAL_RULES
from lsa_models.engine.routes.certify import certify_local, robustness
from lsa_models.engine.routes.radius_search import affine_radius
from lsa_models.engine.values import Ball, LocalValue, input_value
from lsa_models.onnx import analyse, load_onnx
from lsa_models.onnx.ops import Node
from tests.profile import at_most

from .margins import descend_margin
from .test_local_affine import _check, _source, _symbols
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


def _conv_case(scale: float, k: int, stride: int, dilation: int, pad_lo: int, pad_hi: int,
               groups: int, seed: int, spatial: int
               ) -> tuple[Node, Tensor, Tensor, tuple[int, ...], Callable[[Tensor], Tensor]]:
    """A Conv node with random kernel and bias, the input shape (1, C, *size) it takes, and
    the exact float64 Conv (padding, stride, dilation, groups as the node's attributes)."""
    gen = torch.Generator().manual_seed(seed)
    c_in, out = 2 * groups, 2 * groups
    kern = (k,) * spatial
    w = scale * torch.randn(out, c_in // groups, *kern, generator=gen, dtype=torch.float64)
    b = torch.randn(out, generator=gen, dtype=torch.float64)
    size = (1 + dilation * (k - 1) + stride,) * spatial
    pads = [pad_lo] * spatial + [pad_hi] * spatial  # ONNX: begins, then ends
    attrs = {"kernel_shape": list(kern), "strides": [stride] * spatial,
             "dilations": [dilation] * spatial, "pads": pads, "group": groups}
    node = Node("c", "Conv", ["x", "w", "b"], ["y"], attrs)

    def conv(z: Tensor) -> Tensor:
        zp = F.pad(z, [p for i in reversed(range(spatial)) for p in (pads[i], pads[i + spatial])])
        return _CONV[spatial](zp, w, b, stride=stride, dilation=dilation, groups=groups)
    return node, w, b, (1, c_in, *size), conv


@settings(max_examples=at_most(60), deadline=None)  # an example costs ~90 ms on 2 shared cores
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
    node, w, b, shape, conv = _conv_case(scale, k, stride, dilation, pad_lo, pad_hi, groups,
                                         seed, spatial)
    gen = torch.Generator().manual_seed(seed + 1)
    x0 = torch.randn(*shape, generator=gen, dtype=torch.float64)  # (1, C, *size)

    def f(z: Tensor) -> Tensor:
        return conv(torch.tanh(z))

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


# --- the affine forms through a Conv (affine_rules.linear; the robustness radius's route) ----


@settings(max_examples=at_most(60), deadline=None)  # an example costs ~60 ms on 2 shared cores
@given(scale=st.sampled_from([1e-3, 1.0, 1e3]), k=st.integers(1, 3), stride=st.integers(1, 3),
       dilation=st.integers(1, 2), pad_lo=st.integers(0, 2), pad_hi=st.integers(0, 2),
       groups=st.sampled_from([1, 2]), seed=st.integers(0, 2**31 - 1),
       norm=st.sampled_from(["2", "inf"]), spatial=st.sampled_from([1, 2]),
       eps=st.sampled_from([1e-3, 0.1, 1.0]))
def test_affine_conv_form_encloses_every_functional(
        scale: float, k: int, stride: int, dilation: int, pad_lo: int, pad_hi: int,
        groups: int, seed: int, norm: str, spatial: int, eps: float) -> None:
    """Y = Conv(tanh(X)) + b through the affine forms: every linear functional of the exact
    float64 Y - Y(X0) lies in the range the form gives it, at the extreme points of its linear
    part and random points of the ball (the bias cancels in the change; the kernel acts on the
    offset and every symbol's column, |K| on the box)."""
    node, w, b, shape, conv = _conv_case(scale, k, stride, dilation, pad_lo, pad_hi, groups,
                                         seed, spatial)
    rng = np.random.default_rng(seed)
    ball = Ball(rng.standard_normal(4), eps, norm)  # d: 4 input entries
    with _symbols(ball):
        x, fx = _source(rng, shape, ball)
        with torch.no_grad():
            yc = conv(torch.from_numpy(x.c)).numpy()
        y = affine_rules.step(node, [x, w.numpy(), b.numpy()], [yc], ball, lambda i: None)[0]
    assert isinstance(y, Aff) and y.shape == yc.shape
    _check(lambda d: conv(fx(d)), y, ball, rng)


def test_affine_conv_of_a_variable_kernel_is_refused() -> None:
    ball = Ball(np.zeros(2), 0.1, "2")
    x = Aff(np.ones((1, 1, 3)), np.zeros((1, 1, 3)), np.zeros((1, 1, 3)),
            np.zeros((1, 1, 3, 2)), np.zeros((1, 1, 3)))
    kern = Aff(np.ones((1, 1, 2)), np.zeros((1, 1, 2)), np.zeros((1, 1, 2)),
               np.ones((1, 1, 2, 2)), np.zeros((1, 1, 2)))
    node = Node("c", "Conv", ["x", "w"], ["y"], {"kernel_shape": [2]})
    with pytest.raises(affine_rules.NotAffine, match="variable weight"):
        affine_rules.step(node, [x, kern], [np.ones((1, 1, 2))], ball, lambda i: None)


@pytest.mark.parametrize("norm", ["2", "inf"])
def test_affine_margins_of_a_vit_on_pixels_hold_against_pgd(
        vit_pixels: tuple[object, np.ndarray], norm: str) -> None:
    """The affine forms reach a pixel ViT's output through its patch Conv (before: no affine
    rule for Conv, so its radius came from the sweep alone), and PGD on each margin inside the
    ball never goes below the margin's lower bound."""
    om, x0 = vit_pixels
    f = om.module.with_dtype(torch.float64)  # type: ignore[attr-defined]
    with torch.no_grad():
        logits = f(torch.from_numpy(x0)).reshape(-1)
    label = int(logits.argmax())
    eps = 0.05 if norm == "2" else 0.005
    low = margin_lower_bounds(om, x0, eps, norm, label)  # type: ignore[arg-type]
    assert low is not None and set(low) == set(range(logits.numel())) - {label}
    assert max(low.values()) > 0
    gen = torch.Generator().manual_seed(0)
    for j, bound in low.items():
        d = (torch.rand(x0.shape, generator=gen, dtype=torch.float64) * 2 - 1) * eps
        if norm == "2":
            d *= eps / float(d.norm())
        for m in descend_margin(f, torch.from_numpy(x0), label, j, eps, norm, d):
            assert m >= bound - 1e-12


@pytest.mark.parametrize("norm", ["2", "inf"])
def test_affine_route_certifies_the_pixel_classifier(tmp_path: Path, norm: str) -> None:
    """The pixel classifier's affine route certifies a radius now (its Conv has an affine
    rule; before, the walk stopped there), below the attack's; the job reports it or the
    sweep's, whichever is larger."""
    m = _PixelNet().eval()
    om = load_onnx(_export(m, torch.randn(1, 2, 4, 4), tmp_path / "px.onnx", False))
    x0 = np.random.default_rng(2).standard_normal(graph_input_shape(om))
    f64 = om.module.with_dtype(torch.float64)
    with torch.no_grad():
        label = int(f64(torch.from_numpy(x0)).argmax())
    aff, walks = affine_radius(om, x0, norm, label, 1e-2)
    r = robustness(om, x0, label, norm, attack_restarts=2)
    assert aff > 0 and walks > 0
    # (the job's own search starts elsewhere: its end point differs within the tolerance)
    assert r.certified_radius >= aff * (1 - 5e-3)
    assert r.attack_radius is None or max(aff, r.certified_radius) <= r.attack_radius
