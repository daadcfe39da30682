"""Sequence-first attention layouts (docs/bounds.md, "Sequence-first logits"): the rewrites
that put the keys on the last axis keep the function, and L2 attention written in
neural_stpp's `(T, B, E)` style is certified above its Jacobian norm."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from lsa_models.onnx import analyse, load_onnx
from lsa_models.onnx.attention import recognise
from lsa_models.onnx.graph import GraphInfo
from lsa_models.onnx.rewrite import _permuted_matmul, _softmax_perm

from .jacobians import max_jacobian_norm
from .onnx_export import export_to

_EQUATIONS = ["tbhd,sbhd->tsbh", "tsbh,sbhm->tbhm", "bhid,bhjd->bhij", "ik,kj->ij",
              "hid,hjd->ijh", "bij,bjk->bki", "jb,bi->ij"]


@pytest.mark.parametrize("eq", _EQUATIONS)
def test_permuted_matmul_lowering_computes_the_einsum(eq: str) -> None:
    perms = _permuted_matmul(eq)
    assert perms is not None
    pa, pb, po = perms
    lhs, out = eq.split("->")
    a_idx, b_idx = lhs.split(",")
    g = torch.Generator().manual_seed(0)
    size = {c: 2 + k for k, c in enumerate(sorted(set(a_idx + b_idx)))}
    a = torch.randn(*[size[c] for c in a_idx], generator=g, dtype=torch.float64)
    b = torch.randn(*[size[c] for c in b_idx], generator=g, dtype=torch.float64)
    got = (a.permute(pa) @ b.permute(pb)).permute(po)
    torch.testing.assert_close(got, torch.einsum(eq, a, b), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("eq", ["tbhd,tbhd->tbh", "tbm,mhd->tbhd", "ij,jk,kl->il",
                                "...ij,...jk->...ik", "ii,ij->ij"])
def test_permuted_matmul_refuses_other_contractions(eq: str) -> None:
    assert _permuted_matmul(eq) is None


@settings(deadline=None)
@given(rank=st.integers(2, 5), data=st.data())
def test_softmax_perm_puts_keys_last_and_queries_second_to_last(rank: int,
                                                                data: st.DataObject) -> None:
    axis = data.draw(st.integers(0, rank - 1))
    q = data.draw(st.sampled_from([k for k in range(rank) if k != axis]))
    shape = tuple(7 if k in (axis, q) else 2 + k for k in range(rank))
    perm = _softmax_perm(shape, axis)
    if axis == rank - 1:
        assert perm is None
        return
    assert perm is not None and sorted(perm) == list(range(rank))
    assert perm[-1] == axis and shape[perm[-2]] == shape[axis]
    # the softmax over the last axis of the transposed logits, transposed back, is the
    # original softmax
    x = torch.randn(*shape, dtype=torch.float64)
    inv = [perm.index(k) for k in range(rank)]
    back = torch.softmax(x.permute(perm), dim=-1).permute(inv)
    torch.testing.assert_close(back, torch.softmax(x, dim=axis), rtol=1e-15, atol=1e-15)


class _StppL2(nn.Module):
    """neural_stpp-style tied L2 attention on `(T, B, E)`; logits `(T, S, B, H)`."""

    def __init__(self, d: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.h, self.dh, self.causal = heads, d // heads, causal
        self.wq = nn.Parameter(torch.randn(d, heads, self.dh) / math.sqrt(d))  # (D, H, d)
        self.wv = nn.Parameter(torch.randn(heads, d, self.dh) / math.sqrt(d))  # (H, D, d)
        self.out = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:  # (T, B, E)
        t, b, e = x.shape
        q = torch.einsum("tbm,mhd->tbhd", x, self.wq)  # (T, B, H, d)
        sq = (q * q).sum(-1)  # (T, B, H)
        dist = sq.unsqueeze(1) + sq.unsqueeze(0) - 2 * torch.einsum("tbhd,sbhd->tsbh", q, q)
        logits = -dist / math.sqrt(self.dh)  # (T, S, B, H)
        if self.causal:
            mask = torch.full((t, t), float("-inf")).triu(1)  # (T, S)
            logits = logits + mask[..., None, None]
        p = torch.softmax(logits, dim=1)  # (T, S, B, H)
        a = torch.einsum("mhd,nhd->hmn", self.wq, self.wq) / math.sqrt(self.dh)  # (H, D, D)
        xa = torch.einsum("tbm,hmn->tbhn", x, a)  # (T, B, H, D)
        pxa = torch.einsum("tsbh,sbhm->tbhm", p, xa)  # (T, B, H, D)
        pxav = torch.einsum("tbhm,hmd->tbhd", pxa, self.wv)  # (T, B, H, d)
        return self.out(pxav.reshape(t, b, e))  # (T, B, E)


def _export(m: nn.Module, x: Tensor, path: Path, dynamo: bool) -> Path:
    return export_to(m, x, path, dynamo)


@pytest.mark.parametrize("dynamo", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_onnx_seq_first_l2_certified_above_jacobian(tmp_path: Path, causal: bool,
                                                    dynamo: bool) -> None:
    torch.manual_seed(3)
    n, d = 5, 8
    m = _StppL2(d, 2, causal).eval()
    path = _export(m, torch.randn(n, 1, d), tmp_path / "stpp.onnx", dynamo)
    model = load_onnx(path.read_bytes(), path.name)  # checks the rewritten graph against ORT
    (layer,) = recognise(GraphInfo(model.module, n))
    assert (layer.kind, layer.reason, layer.tied, layer.causal, layer.n) == (
        "l2", None, True, causal, n)
    res = analyse(model, "2")
    assert res.verdict == "certified" and res.upper is not None
    f64 = m.double()
    lower = max(max_jacobian_norm(lambda z: f64(z.unsqueeze(1)).squeeze(1),
                                  torch.randn(n, d, dtype=torch.float64,
                                              generator=torch.Generator().manual_seed(s)),
                                  "2", steps=2) for s in range(2))
    assert lower <= res.upper


def test_onnx_seq_first_rewrite_keeps_the_function(tmp_path: Path) -> None:
    """The analysed graph (Einsums lowered, Softmax over the last axis, Transposes merged)
    computes what the torch module does, at a fresh input."""
    torch.manual_seed(4)
    n, d = 6, 8
    m = _StppL2(d, 2, True).eval()
    path = _export(m, torch.randn(n, 1, d), tmp_path / "stpp.onnx", False)
    model = load_onnx(path.read_bytes(), path.name)
    ops = [nd.op_type for nd in model.module.runtime_nodes]
    assert "Softmax" in ops and ops.count("Einsum") < 5  # the two permuted products lowered
    sm = next(nd for nd in model.module.runtime_nodes if nd.op_type == "Softmax")
    assert sm.attrs["axis"] == -1
    x = torch.randn(1, n, d, dtype=torch.float64)  # analysed batch-first
    got = model.module.with_dtype(torch.float64)(x).detach().numpy()
    want = m.double()(x.transpose(0, 1)).transpose(0, 1).detach().numpy()
    # float32 constants of the graph (1/sqrt(d), the folded A) differ from the module's by
    # float32 rounding; a wrong permutation would differ by O(1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


class _SeqFirstDP(nn.Module):
    """Pre-norm dot-product attention on `(T, B, E)` with einsums; logits `(T, S, B, H)`."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.h, self.dh = heads, d // heads
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:  # (T, B, E)
        t, b, e = x.shape
        q, k, v = self.qkv(self.norm(x)).view(t, b, 3, self.h, self.dh).unbind(2)  # (T, B, H, d)
        logits = torch.einsum("tbhd,sbhd->tsbh", q, k) / math.sqrt(self.dh)  # (T, S, B, H)
        p = torch.softmax(logits, dim=1)
        o = torch.einsum("tsbh,sbhd->tbhd", p, v)  # (T, B, H, d)
        return x + self.out(o.reshape(t, b, e))


@pytest.mark.parametrize("dynamo", [False, True])
def test_onnx_seq_first_dp_certified_above_jacobian(tmp_path: Path, dynamo: bool) -> None:
    torch.manual_seed(5)
    n, d = 5, 8
    m = _SeqFirstDP(d, 2).eval()
    path = _export(m, torch.randn(n, 1, d), tmp_path / "sfdp.onnx", dynamo)
    model = load_onnx(path.read_bytes(), path.name)
    (layer,) = recognise(GraphInfo(model.module, n))
    assert (layer.kind, layer.reason, layer.n) == ("dp", None, n)
    res = analyse(model, "2")
    assert res.verdict == "certified" and res.upper is not None
    f64 = m.double()
    lower = max_jacobian_norm(lambda z: f64(z.unsqueeze(1)).squeeze(1),
                              torch.randn(n, d, dtype=torch.float64), "2", steps=2)
    assert lower <= res.upper
