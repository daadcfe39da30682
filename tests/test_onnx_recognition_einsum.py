"""Einsum attention (x-transformers) read as MatMul; masks by finite replacement refused with
the fix named (issue 12)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lsa_models.onnx import analyse, load_onnx
from lsa_models.onnx.ops import OPS, Node, RunContext
from lsa_models.onnx.rewrite import _batched_matmul, lower_einsum

from .test_onnx_recognition import _export, _jacobian_lower

N, D = 6, 16


@pytest.mark.parametrize("eq,want", [
    ("b h i d, b h j d -> b h i j", True), ("bhij,bhjd->bhid", False), ("ik,kj->ij", False),
    ("ik,jk->ij", True), ("bhid,bhjd->bhji", None), ("...ik,...kj->...ij", None),
    ("tbe,hed->tbhd", None), ("ij,jk,kl->il", None), ("ii,ij->ij", None)])
def test_onnx_recognition_einsum_batched_matmul_forms(eq: str, want: bool | None) -> None:
    assert _batched_matmul(eq) is want


def test_onnx_recognition_einsum_lowering_computes_the_same() -> None:
    node = Node("e", "Einsum", ["a", "b"], ["y"], {"equation": b"bhid,bhjd->bhij"})
    lowered = lower_einsum([node])
    assert [n.op_type for n in lowered] == ["Transpose", "MatMul"]
    gen = torch.Generator().manual_seed(0)
    env = {"a": torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64),
           "b": torch.randn(2, 3, 6, 5, generator=gen, dtype=torch.float64)}
    ctx = RunContext(torch.float64)
    for nd in lowered:
        (env[nd.outputs[0]],) = OPS[nd.op_type].run(nd, [env[i] for i in nd.inputs], ctx)
    want = torch.einsum("bhid,bhjd->bhij", env["a"], env["b"])
    assert torch.allclose(env["y"], want, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("dynamo", [False, True])
def test_onnx_recognition_x_transformers_encoder_and_decoder(tmp_path: Path,
                                                             dynamo: bool) -> None:
    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    enc = xt.Encoder(dim=D, depth=1, heads=2, attn_dim_head=8).eval()
    x = torch.randn(1, N, D)
    got = analyse(load_onnx(_export(enc, x, tmp_path / "e.onnx", dynamo)), "2")
    assert got.verdict == "certified", got.reason  # pre-norm: LayerNorm bounds the input
    assert any(lb.kind == "dp_mha_radius" for lb in got.layers)
    assert got.upper is not None and got.upper >= _jacobian_lower(enc, x, "2")
    # the decoder's causal mask replaces logits by -finfo.max (not additive, not -inf):
    # certified with the replaced-logits bound (docs/bounds.md; tests/test_onnx_masks.py)
    dec = xt.Decoder(dim=D, depth=1, heads=2, attn_dim_head=8).eval()
    got = analyse(load_onnx(_export(dec, x, tmp_path / "d.onnx", dynamo)), "2")
    assert got.verdict == "certified", got.reason
    assert any(lb.kind == "dp_mha_radius" for lb in got.layers)
    assert got.upper is not None and got.upper >= _jacobian_lower(dec, x, "2")
