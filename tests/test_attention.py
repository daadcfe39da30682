"""Attention layers: the efficient L2 form equals the definition; DP matches torch's MHA."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lsa_models import L2MHA, DotProductMHA, Transformer, TransformerConfig


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d_model,heads", [(1, 1), (6, 3), (16, 4)])
def test_l2_mha_efficient_form_equals_reference(tied: bool, causal: bool, d_model: int,
                                                heads: int) -> None:
    torch.manual_seed(d_model + heads)
    m = L2MHA(d_model, heads, tied=tied, causal=causal).double()
    x = torch.randn(3, 7, d_model, dtype=torch.float64) * 2.0  # (B, N, D)
    torch.testing.assert_close(m(x), m.forward_reference(x), rtol=0, atol=1e-10)


def test_l2_mha_gradients_match_reference() -> None:
    torch.manual_seed(0)
    m = L2MHA(8, 2).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    (g1,) = torch.autograd.grad(m(x).square().sum(), x)
    (g2,) = torch.autograd.grad(m.forward_reference(x).square().sum(), x)
    torch.testing.assert_close(g1, g2, rtol=0, atol=1e-10)


def test_l2_mha_every_token_attends_to_itself_under_causal_mask() -> None:
    m = L2MHA(4, 1, causal=True).double()
    x = torch.randn(1, 5, 4, dtype=torch.float64)
    # Changing a later token leaves earlier outputs unchanged.
    y = x.clone()
    y[0, 4] += 1.0
    torch.testing.assert_close(m(x)[0, :4], m(y)[0, :4])


def test_dot_product_mha_equals_torch_multihead_attention() -> None:
    torch.manual_seed(0)
    ours = DotProductMHA(8, 2).double()
    ref = nn.MultiheadAttention(8, 2, bias=False, batch_first=True).double()
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight,
                                            ours.v_proj.weight]))
        ref.out_proj.weight.copy_(ours.out_proj.weight)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    expected = ref(x, x, x, need_weights=False)[0] + ours.out_proj.bias
    torch.testing.assert_close(ours(x), expected)


def test_transformer_keeps_shape_and_is_deterministic_in_eval() -> None:
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(d_model=8, n_heads=2, n_layers=2, d_ff=16)).eval()
    x = torch.randn(2, 6, 8)
    assert model(x).shape == (2, 6, 8)
    torch.testing.assert_close(model(x), model(x))
