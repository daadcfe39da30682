"""Conv patch embeddings (ViT, DeiT on pixels): the image input is read as its patches, the
Conv is bounded by its kernel matrix (docs/bounds.md, "Conv"), and everything certified is
above the exact float64 Jacobian norm on the pixels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from typer.testing import CliRunner

from lsa_models.onnx import analyse, load_onnx, load_onnx_model
from lsa_models.onnx.ops import OPS, Flow, Node, NotCertified
from service.cli import app

from .jacobians import jacobian_norm
from .test_onnx_recognition import _export, _jacobian_lower

C, IMAGE, PATCH, D = 3, 8, 4, 16  # 4 patches of 3 * 4 * 4 = 48 pixels


class _Patches(nn.Module):
    """A ViT patch embedding: Conv (kernel == stride), flatten, transpose to tokens."""

    def __init__(self, kernel: int = PATCH, stride: int = PATCH, padding: int = 0) -> None:
        super().__init__()
        self.proj = nn.Conv2d(C, D, kernel, stride=stride, padding=padding)

    def forward(self, x: Tensor) -> Tensor:  # (B, C, H, W)
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, P, D)


class _ViT(nn.Module):
    """Patch embedding, class token, positions, one pre-norm dot-product attention block."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.patches = _Patches()
        p = (IMAGE // PATCH) ** 2
        self.cls = nn.Parameter(torch.randn(1, 1, D, generator=gen))
        self.pos = nn.Parameter(0.1 * torch.randn(1, p + 1, D, generator=gen))
        self.norm = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:  # (B, C, H, W)
        t = self.patches(x)  # (B, P, D)
        t = torch.cat([self.cls.expand(t.shape[0], -1, -1), t], dim=1) + self.pos  # (B, P+1, D)
        h = self.norm(t)  # (B, P+1, D)
        return t + self.attn(h, h, h, need_weights=False)[0]  # (B, P+1, D)


def _pixels() -> Tensor:
    return torch.randn(1, C, IMAGE, IMAGE, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dynamo", [False, True])
@pytest.mark.parametrize("norm", ["2", "inf"])
def test_onnx_conv_patch_embedding_bound_is_its_kernel_norm(tmp_path: Path, dynamo: bool,
                                                            norm: str) -> None:
    torch.manual_seed(1)
    m = _Patches().eval()
    x = _pixels()
    model = load_onnx(_export(m, x, tmp_path / "m.onnx", dynamo))
    assert model.spec.pixels == (C, IMAGE, IMAGE)
    assert (model.spec.seq_len, model.spec.d_model) == ((IMAGE // PATCH) ** 2, C * PATCH ** 2)
    got = analyse(model, norm)  # type: ignore[arg-type]
    assert got.verdict == "certified", got.reason
    # a linear map: its Jacobian norm anywhere is its Lipschitz constant, and the bound is tight
    exact = jacobian_norm(m.double(), x.double(), norm)
    assert got.upper is not None and exact <= got.upper <= exact * (1 + 1e-6)


@pytest.mark.parametrize("dynamo", [False, True])
def test_onnx_conv_vit_on_pixels_certified_above_jacobian(tmp_path: Path, dynamo: bool) -> None:
    torch.manual_seed(0)
    m = _ViT().eval()
    x = _pixels()
    model = load_onnx(_export(m, x, tmp_path / "m.onnx", dynamo))
    got = analyse(model, "2")
    assert got.verdict == "certified", got.reason
    assert any(lb.kind == "dp_mha_radius" for lb in got.layers)
    assert got.upper is not None and got.upper >= _jacobian_lower(m, x, "2")


def test_onnx_conv_pixel_upload_summary_says_pixels(tmp_path: Path) -> None:
    loaded = load_onnx_model(_export(_Patches().eval(), _pixels(), tmp_path / "m.onnx", False))
    assert loaded.summary["layout"] == "pixels"
    assert (loaded.summary["seq_len"], loaded.summary["d_model"]) == (4, C * PATCH ** 2)


class _PixelMLP(nn.Module):
    """An MLP on the flattened image: its first op is a Flatten, not a patch embedding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(C * IMAGE * IMAGE, 32), nn.ReLU(),
                                 nn.Linear(32, 10))

    def forward(self, x: Tensor) -> Tensor:  # (B, C, H, W) -> (B, 10)
        return self.net(x)


@pytest.mark.parametrize("name,module", [
    ("overlapping Conv", lambda: _Patches(kernel=PATCH, stride=PATCH // 2)),
    ("padded Conv", lambda: _Patches(kernel=3, stride=1, padding=1)),
    ("partial patches", lambda: _Patches(kernel=3, stride=3)),
    ("Flatten", _PixelMLP),
])
def test_onnx_image_not_read_by_a_patch_conv_is_one_token(
        tmp_path: Path, name: str, module: type[nn.Module]) -> None:
    # any other first reader: the whole image is one token in its own (C, H, W) order, a
    # permutation of nothing, so the bound is on the pixels themselves
    m = module().eval()
    x = _pixels()
    loaded = load_onnx_model(_export(m, x, tmp_path / "m.onnx", False))
    assert loaded.summary["layout"] == "pixels"
    assert (loaded.summary["seq_len"], loaded.summary["d_model"]) == (1, C * IMAGE * IMAGE)
    for norm in ("2", "inf"):
        got = analyse(load_onnx(_export(m, x, tmp_path / "m.onnx", False)), norm)  # type: ignore[arg-type]
        assert got.verdict == "certified", (name, got.reason)
        assert got.upper is not None and got.upper >= _jacobian_lower(m, x, norm)


def test_onnx_conv_padded_conv_is_bounded_by_its_overlap() -> None:
    """Kernel 3, stride 1, padding 1: a pixel lies in up to 3 x 3 patches, so the 2-norm
    constant is sqrt(9) ||K|| (docs/bounds.md, "Conv"); the inf-norm one a kernel row's sum."""
    node = Node("c", "Conv", ["x", "w"], ["y"], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]})
    w = np.ones((4, 3, 3, 3))
    two = OPS["Conv"].bound(node, [Flow(1.0, None, (1, 3, 5, 5)), w], [(1, 4, 5, 5)], "2")[0]
    inf = OPS["Conv"].bound(node, [Flow(1.0, None, (1, 3, 5, 5)), w], [(1, 4, 5, 5)], "inf")[0]
    assert two is not None and inf is not None
    assert two.lip == pytest.approx(3.0 * np.linalg.norm(w.reshape(4, -1), 2), rel=1e-9)
    assert two.lip >= 3.0 * np.linalg.norm(w.reshape(4, -1), 2)
    assert inf.lip >= 27.0 and inf.lip == pytest.approx(27.0, rel=1e-12)


def test_onnx_conv_input_dependent_kernel_refused() -> None:
    node = Node("c", "Conv", ["x", "w"], ["y"], {"kernel_shape": [2, 2]})
    x = Flow(1.0, None, (1, 3, 4, 4))
    with pytest.raises(NotCertified, match="Conv node c: only an input-dependent image"):
        OPS["Conv"].bound(node, [x, x], [(1, 3, 3, 3)], "2")


@settings(deadline=None)
@given(scale=st.sampled_from([1e-3, 1.0, 1e3]), k=st.integers(1, 4), stride=st.integers(1, 3),
       dilation=st.integers(1, 2), pad=st.integers(0, 2), groups=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**31 - 1), norm=st.sampled_from(["2", "inf"]),
       spatial=st.sampled_from([1, 2]))
def test_onnx_conv_general_rule_never_below_exact_jacobian(
        scale: float, k: int, stride: int, dilation: int, pad: int, groups: int, seed: int,
        norm: str, spatial: int) -> None:
    """Overlapping, strided, dilated, padded and grouped Convs (1-D and 2-D) against the
    exact float64 Jacobian, and against the Jacobian's norm at the worst kernel placement:
    a constant image's Jacobian is the map itself (linear), so this hunts the overlap factor."""
    gen = torch.Generator().manual_seed(seed)
    c_in, out = 2 * groups, 2 * groups
    kern = (k,) * spatial
    w = scale * torch.randn(out, c_in // groups, *kern, generator=gen, dtype=torch.float64)
    size = (2 + dilation * (k - 1) + 2 * stride,) * spatial
    x = torch.randn(1, c_in, *size, generator=gen, dtype=torch.float64)
    conv = F.conv1d if spatial == 1 else F.conv2d

    def f(z: Tensor) -> Tensor:
        return conv(z, w, stride=stride, padding=pad, dilation=dilation, groups=groups)

    attrs = {"kernel_shape": list(kern), "strides": [stride] * spatial,
             "dilations": [dilation] * spatial, "pads": [pad] * (2 * spatial), "group": groups}
    node = Node("c", "Conv", ["x", "w"], ["y"], attrs)
    y = f(x)
    flow = OPS["Conv"].bound(node, [Flow(1.0, None, tuple(x.shape)), w.numpy()],
                             [tuple(y.shape)], norm)[0]
    assert flow is not None
    assert jacobian_norm(f, x, norm) <= flow.lip


class _ConvMixer(nn.Module):
    """Tokens through a depthwise Conv1d over the sequence (Conformer's convolution module,
    CPVT's positional conv in 1-D) in a residual, then a pre-norm attention block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.conv = nn.Conv1d(D, D, 3, padding=1, groups=D)
        self.norm = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:  # (B, N, D)
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)  # (B, N, D)
        h = self.norm(x)  # (B, N, D)
        return x + self.attn(h, h, h, need_weights=False)[0]  # (B, N, D)


@pytest.mark.parametrize("dynamo", [False, True])
@pytest.mark.parametrize("norm", ["2", "inf"])
def test_onnx_conv_sequence_conv_block_certified_above_jacobian(tmp_path: Path, dynamo: bool,
                                                                norm: str) -> None:
    m = _ConvMixer().eval()
    x = torch.randn(1, 6, D, generator=torch.Generator().manual_seed(1))
    model = load_onnx(_export(m, x, tmp_path / "m.onnx", dynamo))
    r = analyse(model, norm)
    assert r.verdict == "certified", r.reason
    assert r.upper is not None and r.upper >= _jacobian_lower(m, x, norm)


def test_onnx_conv_run_matches_torch_with_padding() -> None:
    node = Node("c", "Conv", ["x", "w", "b"], ["y"], {"strides": [1, 2], "pads": [1, 0, 2, 1],
                                                      "dilations": [2, 1]})
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=gen) for s in ((1, 3, 7, 6), (4, 3, 3, 2), (4,)))
    got = OPS["Conv"].run(node, [x, w, b], None)[0]  # type: ignore[arg-type]
    want = F.conv2d(F.pad(x, [0, 1, 1, 2]), w, b, stride=(1, 2), dilation=(2, 1))
    assert torch.equal(got, want)


@settings(deadline=None)
@given(scale=st.sampled_from([1e-3, 1.0, 1e3]), out=st.integers(1, 6), k=st.integers(1, 3),
       seed=st.integers(0, 2**31 - 1), norm=st.sampled_from(["2", "inf"]))
def test_onnx_conv_rule_never_below_exact_jacobian(scale: float, out: int, k: int, seed: int,
                                                   norm: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = scale * torch.randn(out, 2, k, k, generator=gen, dtype=torch.float64)
    node = Node("c", "Conv", ["x", "w"], ["y"], {"kernel_shape": [k, k], "strides": [k, k]})
    x = torch.randn(1, 2, 2 * k, 3 * k, generator=gen, dtype=torch.float64)
    flow = OPS["Conv"].bound(node, [Flow(1.0, None, tuple(x.shape)), w.numpy()],
                             [(1, out, 2, 3)], norm)[0]
    assert flow is not None
    assert jacobian_norm(lambda z: F.conv2d(z, w, stride=k), x, norm) <= flow.lip


def test_onnx_pixel_vit_takes_the_token_counts_it_has(tmp_path: Path) -> None:
    # 4 patches and a class token: --seq-len 4 (the patches) and 5 (what the attention sees)
    # both mean the graph's own shape; anything else is refused naming both, exit 2
    path = tmp_path / "vit.onnx"
    _export(_ViT().eval(), _pixels(), path, False)
    loaded = load_onnx_model(path.read_bytes())
    assert loaded.summary["seq_len_choices"] == [5]
    want = loaded.certify("2")
    for n in (4, 5):
        assert loaded.certify("2", seq_len=n).upper == want.upper
    with pytest.raises(ValueError, match=r"its input has 4 tokens and its attention sees 5.*"
                                         r"one of 4, 5"):
        loaded.certify("2", seq_len=9)
    res = CliRunner().invoke(app, ["bound", str(path), "--seq-len", "9"])
    assert res.exit_code == 2
    assert "one of 4, 5" in res.output
    ok = CliRunner().invoke(app, ["bound", str(path), "--seq-len", "5", "--json"])
    assert ok.exit_code == 0, ok.output
