"""Language models are analysed after their embedding: embedded tokens -> logits."""

from __future__ import annotations

import pytest
import torch

import lsa_models
from lsa_models.analysis import load_model_bytes
from lsa_models.lm import CharTransformerLM, LMConfig
from tests.jacobians import max_jacobian_norm


def _lm(kind: str) -> CharTransformerLM:
    torch.manual_seed(0)
    return CharTransformerLM(LMConfig(vocab_size=11, d_model=4, n_heads=2, n_layers=2, d_ff=8,
                                      seq_len=6, attention=kind, ln_eps=0.1))


@pytest.mark.parametrize("kind", ["l2", "contractive_l2"])
def test_uploaded_lm_is_certified_on_its_continuous_part(kind: str) -> None:
    loaded = load_model_bytes(lsa_models.to_bytes(_lm(kind)), "lm.safetensors")
    assert loaded.d_model == 4
    result = loaded.certify("2")
    assert result.seq_len == 6  # the LM's own context length is the default N
    assert result.verdict == "certified" and result.upper is not None
    assert [lb.name for lb in result.layers][-2:] == ["ln_f", "head"]
    module = loaded.module.double()
    x = torch.randn(6, 4, dtype=torch.float64) * 3
    observed = max_jacobian_norm(lambda z: module(z[None])[0], x, "2", steps=3)
    assert observed <= result.upper


def test_uploaded_untied_lm_is_not_certified() -> None:
    loaded = load_model_bytes(lsa_models.to_bytes(_lm("l2_untied")), "lm.safetensors")
    assert loaded.certify("inf").verdict == "not_certified"
