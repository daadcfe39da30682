"""Masked attention as the exporters write it: logits replaced by constants (`masked_fill`,
`Where(mask, c, logits)`) and the NaN guard of `F.scaled_dot_product_attention`
(`Where(IsNaN(P), 0, P)`). The replaced-logits bound (docs/bounds.md, "Logits replaced by a
constant") against exact float64 Jacobians, and its recognition in exported graphs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from lsa_models.attention import _head_columns
from lsa_models.bounds.formulas import dp_mha_radius_bound
from lsa_models.onnx import OnnxLoadError, analyse, load_onnx
from lsa_models.onnx.empirical import lower_bound
from tests.jacobians import jacobian_matrix, norm_of
from tests.profile import at_most
from tests.zoo.models_l2 import L2Expanded

from .onnx_export import export_to

N, D, H = 5, 8, 2
F32_MAX = float(torch.finfo(torch.float32).max)


# ---- the bound: exact float64 Jacobians ------------------------------------------------------

class _Weights:
    """One DP-MHA layer's weights in the row-vector convention, float64, with biases."""

    def __init__(self, n: int, dm: int, h: int, scale: float, bias: float, seed: int,
                 key_bias: float | None = None) -> None:
        g = torch.Generator().manual_seed(seed)
        d = dm // h

        def w(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float64) * scale / math.sqrt(dm)

        self.wq, self.wk, self.wv = w(h, dm, d), w(h, dm, d), w(h, dm, d)
        self.wo = w(dm, dm)
        self.bq, self.bk, self.bv = (b * torch.randn(h, d, generator=g, dtype=torch.float64)
                                     for b in (bias, bias if key_bias is None else key_bias,
                                               bias))
        self.bo = torch.randn(dm, generator=g, dtype=torch.float64)
        self.n, self.dm, self.h, self.d = n, dm, h, d

    def bound(self, radius: float, norm: str, replaced: bool = True) -> float:
        return dp_mha_radius_bound(self.wq, self.wk, self.wv, self.wo, self.n, radius, norm,
                                   bq=self.bq.reshape(-1), bk=self.bk.reshape(-1),
                                   replaced=replaced)


def _masked_dp(w: _Weights, additive: Tensor, replaced: Tensor, fill: Tensor):  # type: ignore[no-untyped-def]
    """`softmax(where(replaced, fill, s q.k + additive)) V W^O + b^O` from the definition."""
    s = 1.0 / math.sqrt(w.d)

    def f(x: Tensor) -> Tensor:  # (N, D) -> (N, D)
        q = torch.einsum("nd,hde->hne", x, w.wq) + w.bq[:, None]  # (H, N, d)
        k = torch.einsum("nd,hde->hne", x, w.wk) + w.bk[:, None]  # (H, N, d)
        v = torch.einsum("nd,hde->hne", x, w.wv) + w.bv[:, None]  # (H, N, d)
        z = torch.where(replaced, fill, s * q @ k.transpose(-1, -2) + additive)  # (H, N, N)
        o = torch.softmax(z, -1) @ v  # (H, N, d)
        return o.transpose(0, 1).reshape(x.shape[0], -1) @ w.wo + w.bo

    return f


_FILLS = [-1e30, -1e9, -3.0, 0.0, 2.0, 1e3, float("-inf")]


@st.composite
def _masks(draw: st.DrawFn, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """(additive, replaced, fill), each (N, N): random entries replaced by constants from
    very negative to large positive, additive -inf entries, fully replaced rows, and rows
    whose every entry but one is masked (replaced or -inf). Every row keeps a finite logit."""
    flat = st.lists(st.booleans(), min_size=n * n, max_size=n * n)
    replaced = torch.tensor(draw(flat)).reshape(n, n)
    hidden = torch.tensor(draw(flat)).reshape(n, n) & ~replaced
    # constants near the scores' range matter most (a replaced entry then competes with the
    # scored ones, and the key bias is felt); extremes test the saturated cases
    values = st.sampled_from(_FILLS) | st.floats(-40.0, 40.0)
    fill = torch.tensor(draw(st.lists(values, min_size=n * n, max_size=n * n)),
                        dtype=torch.float64).reshape(n, n)
    for i in range(n):
        kind = draw(st.sampled_from(["random", "all-replaced", "one-left"]))
        if kind == "all-replaced":
            replaced[i], hidden[i] = True, False
        elif kind == "one-left":
            j = draw(st.integers(0, n - 1))
            replaced[i] = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
            hidden[i] = ~replaced[i]
            replaced[i, j], hidden[i, j] = False, False
        finite = (~replaced[i] & ~hidden[i]) | (replaced[i] & torch.isfinite(fill[i]))
        if not bool(finite.any()):
            replaced[i, 0], hidden[i, 0] = False, False
    additive = torch.zeros(n, n, dtype=torch.float64).masked_fill(hidden, float("-inf"))
    additive = additive + torch.randn(n, n, dtype=torch.float64).masked_fill(hidden, 0.0)
    return additive, replaced, fill


def _in_ball(n: int, dm: int, radius: float, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dm, generator=g, dtype=torch.float64)
    r = radius * torch.rand(n, 1, generator=g, dtype=torch.float64) ** 0.5
    return x / x.norm(dim=-1, keepdim=True) * r


_shapes = st.sampled_from([(2, 1), (2, 2), (4, 1), (4, 2), (6, 3)])


@given(shape=_shapes, n=st.integers(1, 4), radius=st.floats(0.05, 6.0),
       scale=st.floats(0.2, 3.0), bias=st.floats(0.0, 8.0), key_bias=st.floats(0.0, 40.0),
       seed=st.integers(0, 10**6), data=st.data())
def test_replaced_dp_bound_dominates_jacobian_inside_ball(
        shape: tuple[int, int], n: int, radius: float, scale: float, bias: float,
        key_bias: float, seed: int, data: st.DataObject) -> None:
    dm, h = shape
    w = _Weights(n, dm, h, scale, bias, seed, key_bias)
    f = _masked_dp(w, *data.draw(_masks(n)))
    jac = jacobian_matrix(f, _in_ball(n, dm, radius, seed + 1))
    assert torch.isfinite(jac).all()
    assert norm_of(jac, "2") <= w.bound(radius, "2")
    assert norm_of(jac, "inf") <= w.bound(radius, "inf")


@settings(max_examples=at_most(40))  # an example costs ~810 ms on 2 shared cores
@given(shape=_shapes, n=st.integers(2, 4), radius=st.floats(0.5, 4.0),
       scale=st.floats(0.5, 3.0), bias=st.floats(0.0, 8.0), key_bias=st.floats(0.0, 40.0),
       seed=st.integers(0, 10**6), data=st.data())
def test_replaced_dp_bound_dominates_projected_gradient_ascent(
        shape: tuple[int, int], n: int, radius: float, scale: float, bias: float,
        key_bias: float, seed: int, data: st.DataObject) -> None:
    dm, h = shape
    w = _Weights(n, dm, h, scale, bias, seed, key_bias)
    f = _masked_dp(w, *data.draw(_masks(n)))
    up2 = w.bound(radius, "2")
    x = _in_ball(n, dm, radius, seed + 2).requires_grad_(True)
    for _ in range(12):
        jac = torch.autograd.functional.jacobian(f, x, create_graph=True).reshape(
            x.numel(), x.numel())
        val = torch.linalg.matrix_norm(jac, 2)
        assert float(val.detach()) <= up2
        (g,) = torch.autograd.grad(val, x)
        with torch.no_grad():
            x += 0.25 * radius * g / (g.norm() + 1e-12)
            x *= torch.clamp(radius / x.norm(dim=-1, keepdim=True).clamp_min(1e-30), max=1.0)


@given(shape=_shapes, n=st.integers(2, 4), radius=st.floats(0.05, 2.0),
       scale=st.floats(0.2, 3.0), bias=st.sampled_from([0.0, 1.0, 4.0]),
       key_bias=st.floats(0.0, 40.0), seed=st.integers(0, 10**6), data=st.data())
def test_replaced_dp_bound_dominates_jacobian_when_the_key_bias_counts(
        shape: tuple[int, int], n: int, radius: float, scale: float, bias: float,
        key_bias: float, seed: int, data: st.DataObject) -> None:
    """The regime where a replaced entry matters most: one scored key per row, every other
    entry replaced by a constant equal to that row's score at the point (so the two compete,
    p ~ 1/2), a large key bias and a small radius. The plain DP bound fails here (a few
    percent of the examples); the replaced one must not."""
    dm, h = shape
    w = _Weights(n, dm, h, scale, bias, seed, key_bias)
    x = _in_ball(n, dm, radius, seed + 3)
    x = x / x.norm(dim=-1, keepdim=True) * radius  # on the sphere: the worst radius
    scored = torch.tensor(data.draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=n)))
    replaced = torch.ones(n, n, dtype=torch.bool)
    replaced[torch.arange(n), scored] = False
    q = x @ w.wq + w.bq[:, None]  # (H, N, d)
    k = x @ w.wk + w.bk[:, None]  # (H, N, d)
    z = q @ k.transpose(-1, -2) / math.sqrt(w.d)  # (H, N, N)
    fill = z[:, torch.arange(n), scored][:, :, None].expand(h, n, n).clone()  # constants
    f = _masked_dp(w, torch.zeros(n, n, dtype=torch.float64), replaced, fill)
    jac = jacobian_matrix(f, x)
    assert norm_of(jac, "2") <= w.bound(radius, "2")
    assert norm_of(jac, "inf") <= w.bound(radius, "inf")


def test_replaced_dp_bound_needs_the_key_bias() -> None:
    """Why a new formula: with a key bias, a replaced entry no longer lets `s dq_i . b^K`
    drop out, and the plain DP bound (which drops it) is exceeded; the replaced one is not."""
    n, dm, h = 3, 2, 1
    w = _Weights(n, dm, h, math.sqrt(dm), 0.0, 0)  # unit-variance weights
    w.bk = torch.full((h, dm), 30.0, dtype=torch.float64)
    replaced = torch.zeros(n, n, dtype=torch.bool)
    replaced[:, 1:] = True  # only key 0 is scored: its logit moves against constants
    f = _masked_dp(w, torch.zeros(n, n, dtype=torch.float64), replaced,
                   torch.zeros(n, n, dtype=torch.float64))
    sphere = (x / x.norm(dim=-1, keepdim=True) for x in (_in_ball(n, dm, 1.0, s)
                                                        for s in range(40)))
    worst = max(norm_of(jacobian_matrix(f, x), "2") for x in sphere)
    assert worst > w.bound(1.0, "2", replaced=False)
    assert worst <= w.bound(1.0, "2")


def test_replaced_dp_bound_without_key_bias_is_the_plain_bound() -> None:
    """With no key bias `Kmax = R ||W^K||`: the same number as the plain DP bound, up to the
    order of the upward roundings."""
    w = _Weights(4, 4, 2, 1.0, 1.0, 3)
    w.bk = torch.zeros_like(w.bk)
    for norm in ("2", "inf"):
        plain, repl = w.bound(2.0, norm, replaced=False), w.bound(2.0, norm)
        assert abs(repl - plain) <= 1e-13 * plain


# ---- recognition in exported graphs ----------------------------------------------------------

def _export(module: nn.Module, path: Path, dynamo: bool) -> Path:
    return export_to(module, torch.randn(1, N, D), path, dynamo)


def _mask(kind: str) -> Tensor:
    """(N, N) bool, True = masked: causal; rows 0-2 hiding every key but one; row 1 hiding
    every key (with a finite fill it is replaced entirely: uniform, constant weights)."""
    if kind == "causal":
        return torch.ones(N, N, dtype=torch.bool).triu(1)
    m = torch.zeros(N, N, dtype=torch.bool)
    if kind == "one-left":
        m[:3] = True
        m[0, 4], m[1, 0], m[2, 2] = False, False, False
    elif kind == "full-row":
        m[1] = True
        m[3, 1:] = True
    return m


class _Filled(nn.Module):
    """Attention whose logits are `masked_fill`ed: `fill` a constant, or "input" (a value
    computed from x: not a mask), `row_term` adds an input-dependent per-row term to the
    scores (it drops out of an unreplaced softmax, not of a replaced one)."""

    def __init__(self, fill: float | str, mask: str, row_term: float = 0.0,
                 data_mask: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)  # with biases: the key bias counts here
        self.out = nn.Linear(D, D)
        self.u = nn.Parameter(torch.randn(D) * row_term)
        self.fill, self.data_mask = fill, data_mask
        self.register_buffer("hidden", _mask(mask))

    def forward(self, x: Tensor) -> Tensor:  # (B, N, D)
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, H, D // H).transpose(1, 2) for t in self.qkv(x).split(D, 2))
        z = q @ k.transpose(-1, -2) / math.sqrt(D // H)  # (B, H, N, N)
        z = z + (x @ self.u)[:, None, :, None]  # a per-row term (zero unless row_term)
        hidden = (x[:, None, :, :1] > 0).expand_as(z) if self.data_mask else self.hidden
        fill = x.mean() if self.fill == "input" else self.fill
        y = z.masked_fill(hidden, fill).softmax(-1) @ v  # (B, H, N, d)
        return self.out(y.transpose(1, 2).reshape(b, n, D))

    def formula(self, radius: float, replaced: bool) -> float:
        w, bias = self.qkv.weight.detach(), self.qkv.bias.detach()
        wq, wk, wv = (_head_columns(w[i * D:(i + 1) * D], H) for i in range(3))
        return dp_mha_radius_bound(wq, wk, wv, self.out.weight.detach().T, N, radius, "2",
                                   bq=bias[:D], bk=bias[D:2 * D], replaced=replaced)


@pytest.mark.parametrize(("fill", "mask", "dynamo"), [
    (-F32_MAX, "causal", False), (-F32_MAX, "causal", True), (-1e9, "one-left", True),
    (0.0, "full-row", False), (5.0, "one-left", False), (-3.0, "full-row", True)])
def test_masked_fill_attention_is_certified_with_the_replaced_bound(
        tmp_path: Path, fill: float, mask: str, dynamo: bool) -> None:
    """A finite constant replacing logits on a fixed set of entries (x-transformers' causal
    mask is -finfo.max): certified with the replaced-logits formula on the true weights
    (key bias included), never below the graph's float64 Jacobian ascent."""
    torch.manual_seed(21)
    mod = _Filled(fill, mask).eval()
    path = _export(mod, tmp_path / "f.onnx", dynamo)
    res = analyse(load_onnx(path.read_bytes()), "2", None, 1.0)
    assert res.verdict == "certified", res.reason
    expect = mod.formula(1.0, replaced=True)
    assert res.upper is not None and expect <= res.upper <= expect * (1 + 1e-5)
    assert res.upper > mod.formula(1.0, replaced=False)  # the key bias counted
    low = lower_bound(load_onnx(path.read_bytes()), "2", N, radius=1.0, restarts=1, steps=4)
    assert low.lower <= res.upper


@pytest.mark.parametrize("dynamo", [False, True])
def test_masked_fill_with_minus_inf_keeps_the_plain_bound(tmp_path: Path, dynamo: bool) -> None:
    """-inf replacing logits is an additive -inf mask: the plain DP number, unchanged."""
    torch.manual_seed(22)
    mod = _Filled(float("-inf"), "one-left").eval()
    res = analyse(load_onnx(_export(mod, tmp_path / "f.onnx", dynamo).read_bytes()),
                  "2", None, 1.0)
    assert res.verdict == "certified", res.reason
    expect = mod.formula(1.0, replaced=False)
    assert res.upper is not None and expect <= res.upper <= expect * (1 + 1e-5)


@pytest.mark.parametrize(("what", "dynamo"), [("fill", False), ("fill", True),
                                              ("mask", False), ("row", True), ("row", False)])
def test_masked_fill_that_is_not_a_constant_mask_is_not_certified(
        tmp_path: Path, what: str, dynamo: bool) -> None:
    """An input-dependent fill value or mask is not a mask; scores with an input-dependent
    per-row term are not `c q.k + const` (the term would not drop out of the softmax once
    entries are replaced). None is certified."""
    torch.manual_seed(23)
    mod = _Filled("input" if what == "fill" else -1e9, "causal",
                  row_term=3.0 if what == "row" else 0.0, data_mask=what == "mask").eval()
    res = analyse(load_onnx(_export(mod, tmp_path / "f.onnx", dynamo).read_bytes()),
                  "2", None, 1.0)
    assert res.verdict == "not_certified"
    assert "Softmax" in (res.reason or "")
    if what == "row":
        assert "replaces logits by constants" in (res.reason or "")


class _FilledL2(L2Expanded):
    """Tied L2 attention (the zoo's expanded form) masked by a finite constant."""

    def mask(self, logits: Tensor) -> Tensor:
        n = logits.shape[-1]
        return logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -1e9)


@pytest.mark.parametrize("dynamo", [False, True])
def test_masked_fill_on_l2_logits_is_refused_naming_the_where(tmp_path: Path,
                                                              dynamo: bool) -> None:
    torch.manual_seed(26)
    mod = _FilledL2(D, H, causal=True)
    res = analyse(load_onnx(_export(mod, tmp_path / "l.onnx", dynamo).read_bytes()), "2")
    assert res.verdict == "not_certified"
    assert "replaces logits by constants" in (res.reason or "")
    assert "float('-inf')" in (res.reason or "")


class _SDPA(nn.Module):
    """`F.scaled_dot_product_attention` with a constant mask: a bool one (torch writes it as
    an additive -inf mask and guards P with `where(isnan(P), 0, P)`) or a float one (added,
    no guard)."""

    def __init__(self, mask: Tensor) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)
        self.register_buffer("mask", mask)

    def forward(self, x: Tensor) -> Tensor:  # (B, N, D)
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, H, D // H).transpose(1, 2) for t in self.qkv(x).split(D, 2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        return self.out(y.transpose(1, 2).reshape(b, n, D))

    def formula(self, radius: float) -> float:
        w, bias = self.qkv.weight.detach(), self.qkv.bias.detach()
        wq, wk, wv = (_head_columns(w[i * D:(i + 1) * D], H) for i in range(3))
        return dp_mha_radius_bound(wq, wk, wv, self.out.weight.detach().T, N, radius, "2",
                                   bq=bias[:D])


def _float_mask(hide_row: bool) -> Tensor:
    m = torch.randn(N, N)
    m[:, -1] = float("-inf")  # padding: the last key
    m[2, :3] = float("-inf")
    if hide_row:
        m[3] = float("-inf")
    return m


@pytest.mark.parametrize(("kind", "dynamo"), [("bool", False), ("bool", True),
                                              ("float", False), ("float", True)])
def test_sdpa_nan_guard_is_read_as_the_identity(tmp_path: Path, kind: str,
                                                dynamo: bool) -> None:
    """No row of the constant mask hides every key, so P is never NaN and the guard never
    fires: the plain DP bound (the additive mask is covered by it)."""
    torch.manual_seed(24)
    mask = ~torch.isinf(_float_mask(False)) if kind == "bool" else _float_mask(False)
    mod = _SDPA(mask).eval()
    path = _export(mod, tmp_path / "s.onnx", dynamo)
    res = analyse(load_onnx(path.read_bytes()), "2", None, 1.0)
    assert res.verdict == "certified", res.reason
    expect = mod.formula(1.0)
    assert res.upper is not None and expect <= res.upper <= expect * (1 + 1e-5)
    low = lower_bound(load_onnx(path.read_bytes()), "2", N, radius=1.0, restarts=1, steps=4)
    assert low.lower <= res.upper


def test_sdpa_nan_guard_that_can_fire_is_not_certified(tmp_path: Path) -> None:
    """A bool mask with a row hiding every key, TorchScript export (an additive -inf mask):
    that row's softmax is NaN and the guard fires (the row becomes 0). Not certified, and the
    reason says which property is missing. (The dynamo export writes float32's lowest number
    instead of -inf: a finite constant mask, no NaN possible, covered by the DP bound.)"""
    torch.manual_seed(25)
    mod = _SDPA(~torch.isinf(_float_mask(True))).eval()
    res = analyse(load_onnx(_export(mod, tmp_path / "s.onnx", False).read_bytes()),
                  "2", None, 1.0)
    assert res.verdict == "not_certified"
    assert "hides every key" in (res.reason or "")


def test_sdpa_float_mask_hiding_a_row_is_refused_at_load(tmp_path: Path) -> None:
    """A float mask writes no guard: the output is NaN, and loading says so (CLI exit 2)."""
    torch.manual_seed(25)
    mod = _SDPA(_float_mask(True)).eval()
    with pytest.raises(OnnxLoadError, match="NaN or inf"):
        load_onnx(_export(mod, tmp_path / "s.onnx", False).read_bytes())
