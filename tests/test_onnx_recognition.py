"""Attention recognised by what it computes, whatever the exporter wrote (issue 12).

L2 attention written from the paper's definition in four ways (tests/onnx_l2_models.py),
through both exporters, 2-D and 3-D inputs, tied and untied, causal, inside a residual block:
tied layers certify with exactly Theorem 3.2's bound on the module's own weights, and that
bound is never below a float64 Jacobian norm of the torch module; untied ones do not certify,
and say why.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from lsa_models.bounds.formulas import l2_mha_bound
from lsa_models.bounds.numerics import add_up
from lsa_models.onnx import analyse, load_onnx

from .jacobians import jacobian_norm
from .onnx_l2_models import L2Attention

N, D = 6, 16
REL = 1e-9


def _export(module: nn.Module, x: torch.Tensor, path: Path, dynamo: bool,
            opset: int = 18) -> bytes:
    module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            prog = torch.onnx.export(module, (x,), dynamo=True, opset_version=opset,
                                     input_names=["x"], output_names=["y"], verbose=False)
            assert prog is not None
            prog.save(str(path), external_data=False)
        else:
            torch.onnx.export(module, (x,), str(path), dynamo=False, opset_version=opset,
                              input_names=["x"], output_names=["y"])
    return path.read_bytes()


def _theorem(m: L2Attention, norm: str) -> float:
    """Theorem 3.2 on the module's weights (canonical scales: no value factor)."""
    wq, wv, wo = (t.detach().double().numpy() for t in (m.wq, m.wv, m.wo))
    local = l2_mha_bound(wq, wv, wo, N, norm, m.causal)
    return add_up(1.0, local) if m.residual else local


def _input(form: str, rank: int) -> torch.Tensor:
    if form == "stpp":
        return torch.randn(N, 1, D)  # (T, B, D)
    return torch.randn(1, N, D) if rank == 3 else torch.randn(N, D)


def _jacobian_lower(m: nn.Module, x: torch.Tensor, norm: str, samples: int = 3) -> float:
    md = m.double()
    gen = torch.Generator().manual_seed(0)
    best = 0.0
    for _ in range(samples):
        xs = 2.0 * torch.randn(x.shape, generator=gen, dtype=torch.float64)
        best = max(best, jacobian_norm(md, xs, norm))
    m.float()
    return best


# (form, heads, rank, dynamo, causal, residual): torch.cdist has no dynamo export
_TIED = [
    ("broadcast", 1, 2, False, False, False),
    ("broadcast", 2, 3, False, False, False),
    ("broadcast", 2, 3, True, False, False),
    ("broadcast", 2, 2, True, True, True),
    ("cdist", 1, 3, False, False, False),
    ("cdist", 2, 2, False, False, True),
    ("expanded", 2, 3, True, False, False),
    ("expanded", 1, 2, False, True, False),
]


@pytest.mark.parametrize("form,heads,rank,dynamo,causal,residual", _TIED)
def test_onnx_recognition_l2_forms_certify_theorem_bound(
        tmp_path: Path, form: str, heads: int, rank: int, dynamo: bool, causal: bool,
        residual: bool) -> None:
    m = L2Attention(D, heads, form, causal=causal, residual=residual, seed=heads + rank).eval()
    x = _input(form, rank)
    model = load_onnx(_export(m, x, tmp_path / "m.onnx", dynamo))
    for norm in ("2", "inf"):
        got = analyse(model, norm)  # type: ignore[arg-type]
        assert got.verdict == "certified", got.reason
        want = _theorem(m, norm)
        # A = W^Q W^Q^T / sqrt(d) folded in float32 by the exporter: the graph's constant is
        # a float32 rounding away from the module's product, and the bound with it
        rel = 1e-6 if dynamo else REL
        assert got.upper is not None and want * (1 - rel) <= got.upper <= want * (1 + 1e-6), \
            (got.upper, want)
        assert got.upper >= _jacobian_lower(m, x, norm)
    kinds = [lb.kind for lb in got.layers]
    assert ("l2_mha_causal" if causal else "l2_mha") in kinds


@pytest.mark.parametrize("form,dynamo", [("broadcast", False), ("broadcast", True),
                                         ("cdist", False), ("expanded", True)])
def test_onnx_recognition_untied_l2_is_refused_with_a_reason(
        tmp_path: Path, form: str, dynamo: bool) -> None:
    m = L2Attention(D, 2, form, tied=False, seed=3).eval()
    model = load_onnx(_export(m, _input(form, 3), tmp_path / "m.onnx", dynamo))
    got = analyse(model, "2")
    assert got.verdict == "not_certified"
    assert "untied" in (got.reason or "") and "Softmax" in (got.reason or "")


def test_onnx_recognition_cdist_exponent_is_read_as_exact(tmp_path: Path) -> None:
    # TorchScript writes cdist's square root as Pow(s, 0.49999976): the graph is read as the
    # exact squared distance the module computes (docs/bounds.md, Conventions)
    m = L2Attention(D, 1, "cdist", seed=5).eval()
    data = _export(m, _input("cdist", 3), tmp_path / "m.onnx", False)
    exps = [float(onnx.numpy_helper.to_array(n.attribute[0].t).reshape(-1)[0])
            for n in onnx.load_from_string(data).graph.node
            if n.op_type == "Constant" and n.attribute[0].t.dims in ([], [1])
            and n.attribute[0].t.data_type == 1]
    assert any(0.4999 < e < 0.5 for e in exps), exps  # what the exporter writes today
    got = analyse(load_onnx(data), "2")
    assert got.verdict == "certified"
    assert np.isclose(got.upper, _theorem(m, "2"), rtol=1e-6, atol=0)


class _Unsqueezed(nn.Module):
    """`nn.TransformerEncoderLayer` on a 2-D `(N, D)` input, wrapped as users do."""

    def __init__(self, norm_first: bool) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.layer = nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True,
                                                norm_first=norm_first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, D) -> (N, D)
        return self.layer(x.unsqueeze(0)).squeeze(0)


@pytest.mark.parametrize("dynamo", [False, True])
def test_onnx_recognition_encoder_layer_on_2d_input(tmp_path: Path, dynamo: bool) -> None:
    # the packed QKV projection runs on (1, N, D) inside a graph whose input is (N, D): the
    # same rows, so the LayerNorm output is the attention input (pre-norm: certified)
    for norm_first in (True, False):
        m = _Unsqueezed(norm_first).eval()
        x = torch.randn(N, D)
        model = load_onnx(_export(m, x, tmp_path / "m.onnx", dynamo))
        got = analyse(model, "2")
        if not norm_first:
            assert got.verdict == "not_lipschitz" and "Theorem 3.1" in (got.reason or "")
            continue
        assert got.verdict == "certified", got.reason
        assert any(lb.kind == "dp_mha_radius" for lb in got.layers)
        assert got.upper is not None and got.upper >= _jacobian_lower(m, x, "2")


class _SDPA(nn.Module):
    """Pre-norm block around `F.scaled_dot_product_attention` with a packed QKV projection."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.ln, self.qkv, self.out = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (1, N, D)
        q, k, v = self.qkv(self.ln(x)).view(1, N, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return x + self.out(o.transpose(1, 2).reshape(1, N, D))  # (1, N, D)


@pytest.mark.parametrize("causal", [False, True])
def test_onnx_recognition_sdpa_both_exporters_agree(tmp_path: Path, causal: bool) -> None:
    m = _SDPA(causal).eval()
    x = torch.randn(1, N, D)
    uppers = []
    for dynamo in (False, True):
        got = analyse(load_onnx(_export(m, x, tmp_path / f"s{int(dynamo)}.onnx", dynamo)), "2")
        assert got.verdict == "certified", got.reason
        assert any(lb.kind == "dp_mha_radius" for lb in got.layers)
        uppers.append(got.upper)
    assert uppers[0] is not None and uppers[1] is not None
    assert abs(uppers[0] - uppers[1]) <= 1e-9 * uppers[1]
    assert uppers[0] >= _jacobian_lower(m, x, "2")


@pytest.mark.parametrize("form,dynamo,note", [("cdist", False, "Pow(Pow(s, e), p)"),
                                              ("broadcast", True, "folded value-path")])
def test_onnx_recognition_float32_readings_named_in_method(tmp_path: Path, form: str,
                                                           dynamo: bool, note: str) -> None:
    # a certificate relying on a float32 reading (docs/bounds.md, Conventions) says it is for
    # the exact constants; one that relies on none does not
    m = L2Attention(D, 2, form, seed=4).eval()
    got = analyse(load_onnx(_export(m, _input(form, 3), tmp_path / "m.onnx", dynamo)), "2")
    assert got.verdict == "certified", got.reason
    assert "exact constants" in got.method and note in got.method, got.method
    plain = L2Attention(D, 2, "broadcast", seed=4).eval()
    got = analyse(load_onnx(_export(plain, _input("broadcast", 3), tmp_path / "p.onnx",
                                    False)), "2")
    assert got.verdict == "certified" and "exact constants" not in got.method, got.method
